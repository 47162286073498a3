"""GET /metrics (Prometheus' text format: the server's and the engine's metrics, llmserve/server/metrics.py)
and GET /stats (a JSON snapshot for the web page: engine state, recent TTFT/ITL percentiles)."""

from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from llmserve.server.state import State

router = APIRouter()


@router.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
async def metrics(state: State):
    if state.models is not None:  # --models-dir: every model's, told apart by `model_name`
        return Response(state.models.render_metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")
    if state.metrics is None:
        return PlainTextResponse("", media_type="text/plain; version=0.0.4")
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/stats", summary="JSON snapshot for the web page: engine state, recent TTFT/ITL percentiles")
async def stats(state: State):
    if state.models is not None:  # --models-dir: the most recently used loaded model's, and every model's state
        listing = [{"id": c["id"], "status": c["status"]} for c in (s.card() for s in state.models.slots.values())]
        loaded = state.models.loaded()
        if not loaded:
            return {"time": time.time(), "ready": state.ready, "models": listing}
        slot = max(loaded, key=lambda s: s.last_used)
        return {"ready": state.ready, **slot.state.metrics.stats(), "models": listing}
    if state.metrics is None:
        return {"time": time.time(), "ready": False}
    return {"ready": state.ready, **state.metrics.stats()}
