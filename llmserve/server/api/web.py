"""The web page: GET / (llmserve/web/, docs/web.md) and its files under /static/."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from llmserve.web import mount_static, page

router = APIRouter()


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def index():
    return HTMLResponse(page("server") or "<h1>llmserve</h1><p>OpenAI-compatible API at /v1</p>")


mount_static(router)
