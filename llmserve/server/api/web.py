"""The web page: GET / (llmserve/server/static/index.html, docs/web.md) and its files under /static/."""

from __future__ import annotations

import os

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

STATIC_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "static")

router = APIRouter()


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def index():
    page = os.path.join(STATIC_DIR, "index.html")
    if os.path.exists(page):
        with open(page, encoding="utf-8") as f:
            return HTMLResponse(f.read())
    return HTMLResponse("<h1>llmserve</h1><p>OpenAI-compatible API at /v1</p>")


if os.path.isdir(STATIC_DIR):
    from fastapi.staticfiles import StaticFiles

    router.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
