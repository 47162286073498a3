"""The router: an OpenAI-API reverse proxy over several llmserve (or vLLM) servers.

    state.py     RouterConfig, Router: backends, policy, health, the router queue, timeouts, the key
    proxy.py     ProxyEndpoint: the proxied POSTs (retries before the first byte, streaming relay,
                 disconnect -> abort); the request facts the policies route on
    routes.py    /health, /ready, /metrics, /router/backends, the web page, /v1/models
    errors.py    RouterError, in OpenAI's error shape (llmserve/errors.py)
    policies/ (one module per policy), health.py, discovery.py, upstream.py, metrics.py: see docs/router.md

This module assembles the ASGI app: `build_app(router)`.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from .config import RouterConfig
from .proxy import ProxyEndpoint
from .routes import add_routes
from .state import Router

# what the CLI, the launcher, the fake backend and the tests import from here
__all__ = ["PROXY_PATHS", "Router", "RouterApp", "RouterConfig", "build_app"]

# Requests the router proxies (POST). Any other POST under /v1/ is proxied too.
PROXY_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/tokenize",
    "/detokenize",
    "/api/chat",  # Ollama's
    "/api/generate",
    "/api/embed",
    "/api/embeddings",
    "/api/show",
    "/api/pull",  # (--models-dir: loads the model on a backend that has it)
)


def build_app(router: Router) -> "RouterApp":
    @asynccontextmanager
    async def lifespan(app):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="llmserve router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router
    add_routes(app, router)
    return RouterApp(app, ProxyEndpoint(router))


class RouterApp:
    """The ASGI app: proxied POSTs go straight to the proxy (no middleware stack on the hot
    path: each streamed chunk would cross five wrappers); everything else, lifespan included,
    to the FastAPI app."""

    def __init__(self, app: FastAPI, proxy: ProxyEndpoint):
        self.app, self.proxy = app, proxy
        self.router = proxy.router

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and (scope["path"] in PROXY_PATHS or scope["path"].startswith("/v1/"))
        ):
            await self.proxy(scope, receive, send)
        else:
            await self.app(scope, receive, send)
