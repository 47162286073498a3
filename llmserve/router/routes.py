"""The router's own routes (everything but the proxied POSTs): probes, metrics, the backends' state,
the web page, and /v1/models merged over the healthy backends."""

from __future__ import annotations

import os

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .errors import RouterError
from .state import Router


def add_routes(app: FastAPI, router: Router) -> None:
    def check_key(request: Request) -> JSONResponse | None:
        if router.authorized(request.headers):
            return None
        err = RouterError(401, "invalid or missing API key", "invalid_request_error", "invalid_api_key")
        return JSONResponse(status_code=401, content=err.payload())

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        n = len(router.healthy_backends())
        body = {"ready": n > 0, "healthy_backends": n, "backends": len(router.registry)}
        return JSONResponse(body, status_code=200 if n else 503)

    @app.get("/metrics")
    async def metrics():
        data, ctype = router.metrics.render()
        return Response(data, media_type=ctype)

    @app.get("/router/backends")
    async def backends():
        return {
            "policy": router.policy.name,
            "queued": router.queued,
            "backends": [
                {
                    "url": b.url,
                    "healthy": b.healthy,
                    "models": sorted(b.models),
                    "outstanding": b.outstanding,
                    "weight": b.weight,
                    "source": b.source,
                    "ejected_reason": b.ejected_reason,
                    "prompt_tokens": [b.min_prompt_tokens, b.max_prompt_tokens],
                    "running": b.running,
                    "waiting": b.waiting,
                    "kv_usage": b.kv_usage,
                    "kv_blocks": None if b.kv_blocks is None else len(b.kv_blocks),  # from its KV events
                    "kv_events_seq": b.kv_events_seq,
                }
                for b in router.registry
            ],
            "recent": list(router.recent_decisions)[::-1],
        }

    # the web page (docs/web.md): shares the server's static files; no engine import here
    static = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "server", "static")

    @app.get("/", include_in_schema=False)
    async def index():
        from fastapi.responses import FileResponse

        return FileResponse(os.path.join(static, "router.html"), media_type="text/html")

    if os.path.isdir(static):
        from fastapi.staticfiles import StaticFiles

        app.mount("/static", StaticFiles(directory=static), name="static")

    @app.get("/v1/models")
    async def models(request: Request):
        if (denied := check_key(request)) is not None:
            return denied
        cards: dict[str, dict] = {}
        for b in router.healthy_backends():
            for m in sorted(b.models):
                cards.setdefault(m, dict(b.model_cards.get(m) or {"id": m, "object": "model", "owned_by": "llmserve"}))
        return {"object": "list", "data": list(cards.values())}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request):
        if (denied := check_key(request)) is not None:
            return denied
        for b in router.healthy_backends():
            if model in b.models:
                return b.model_cards.get(model) or {"id": model, "object": "model", "owned_by": "llmserve"}
        err = RouterError(
            404, f"The model '{model}' does not exist", "invalid_request_error", "model_not_found", "model"
        )
        return JSONResponse(status_code=404, content=err.payload())
