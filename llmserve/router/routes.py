"""The router's own routes (everything but the proxied POSTs): probes, metrics, the backends' state,
the web page, /v1/models merged over the healthy backends (a model loaded on one of them shows as loaded),
and Ollama's GET /api/tags, /api/ps (merged by name) and /api/version (the lowest)."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from llmserve import web

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

    # the web page (docs/web.md): the server's page with the router's dashboard (llmserve/web/)
    @app.get("/", include_in_schema=False)
    async def index():
        from fastapi.responses import HTMLResponse

        return HTMLResponse(web.page("router"))

    web.mount_static(app)

    @app.get("/v1/models")
    async def models(request: Request):
        if (denied := check_key(request)) is not None:
            return denied
        cards: dict[str, dict] = {}
        for b in router.healthy_backends():
            for m in sorted(b.models):
                card = dict(b.model_cards.get(m) or {"id": m, "object": "model", "owned_by": "llmserve"})
                if m not in cards or _loaded(card) and not _loaded(cards[m]):
                    cards[m] = card
        return {"object": "list", "data": list(cards.values())}

    async def _gather(path: str) -> list[dict]:
        """The JSON bodies of GET `path` on the healthy backends that answer it (the others left out)."""

        async def one(b):
            try:
                r = await router.client.get(
                    b.url + path, timeout=router.config.health_timeout, headers=_backend_headers()
                )
                return r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None

        bodies = await asyncio.gather(*(one(b) for b in router.healthy_backends()))
        return [x for x in bodies if isinstance(x, dict)]

    def _backend_headers() -> dict:
        key = router.config.backend_api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    @app.get("/api/tags")
    async def ollama_tags(request: Request):
        if (denied := check_key(request)) is not None:
            return denied
        return {"models": _merge_by_name(await _gather("/api/tags"))}

    @app.get("/api/ps")
    async def ollama_ps(request: Request):
        if (denied := check_key(request)) is not None:
            return denied
        return {"models": _merge_by_name(await _gather("/api/ps"))}

    @app.get("/api/version")
    async def ollama_version(request: Request):
        versions = [v["version"] for v in await _gather("/api/version") if isinstance(v.get("version"), str)]
        return {"version": min(versions) if versions else "0.0.0"}

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


def _loaded(card: dict) -> bool:
    return (card.get("status") or {"value": "loaded"}).get("value") == "loaded"


def _merge_by_name(bodies: list[dict]) -> list[dict]:
    """Ollama's model lists of several backends as one: each name once (the first backend's entry)."""
    out: dict[str, dict] = {}
    for body in bodies:
        for m in body.get("models") or ():
            if isinstance(m, dict) and isinstance(m.get("name"), str):
                out.setdefault(m["name"], m)
    return list(out.values())
