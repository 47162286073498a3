"""Probes: GET /health (liveness: the process answers), /ready (readiness: the model loaded and the engine
loop making progress; 503 otherwise) and /version."""

from __future__ import annotations

from fastapi import APIRouter

from llmserve import __version__
from llmserve.server import protocol as P
from llmserve.server.state import State

router = APIRouter()


@router.get("/health", summary="Liveness: the process answers")
async def health():
    return {"status": "ok"}


@router.get(
    "/ready",
    summary="Readiness: model loaded and engine loop making progress",
    responses={503: {"model": P.ErrorResponse}},
)
async def ready(state: State):
    if state.ready:
        return {"status": "ready", "model": state.model_names[0] if state.model_names else None}
    return state.engine_or_503()


@router.get("/version")
async def version():
    return {"version": __version__}
