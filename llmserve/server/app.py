"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncEngine.

The server never sees a block or a tensor: it validates, renders chat templates, tokenizes, hands
token ids and SamplingParams to the engine, and turns the engine's outputs into OpenAI's JSON and SSE.

    api/           one module per API: its router, protocol models and rendering (api/__init__.py)
    state.py       ServerSettings, ServerState (the engine, loaded in the background; readiness; metrics)
    models_dir.py  --models-dir: a ServerState per model, loaded on demand, unloaded when idle (ModelPool)
    middleware.py  API key, body size and time limits (413 after draining, 408), CORS
    protocol.py    the request pieces the APIs share (chat messages, sampling fields), the error shape
    prepare.py     request body -> engine runs: chat encoding, SamplingParams, admission
    serving.py     Generation: the one serving loop (engine stream, pings, timeout, abort, usage)
    rendering.py   the Rendering interface, OpenAI's choices envelope, the reasoning / content split
    tool_parsers/, reasoning.py  tool calls (prompt, grammar, one parser per model format) and thinking
                   models' reasoning, for all APIs
    errors.py      APIError (the shape is llmserve/errors.py's)
    openapi.py     /openapi.json: each operation's statuses, error models and streamed media types declared
    faults.py      fault injection, a test facility

This module assembles the app: `build_app(settings)`.
"""

from __future__ import annotations

import logging
import threading

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmserve import __version__
from llmserve.server.api import include_apis
from llmserve.server.errors import APIError, from_validation_errors
from llmserve.server.faults import FAULT_LOOP_MARKER, FAULT_REQUEST_MARKER
from llmserve.server.middleware import BodyRefused, install_middleware
from llmserve.server.models_dir import InFlight, ModelPool
from llmserve.server.openapi import install as install_openapi
from llmserve.server.state import ServerSettings, ServerState

# what other modules and the tests import from here
__all__ = ["FAULT_LOOP_MARKER", "FAULT_REQUEST_MARKER", "ServerSettings", "ServerState", "build_app"]

log = logging.getLogger("llmserve.server")


def build_app(settings: ServerSettings, load_in_background: bool = True) -> FastAPI:
    state = ServerState(settings)
    app = FastAPI(
        title="llmserve",
        version=__version__,
        description="OpenAI-compatible LLM server (chat and text completions, SSE streaming).",
    )
    app.state.llm = state
    install_middleware(app, state)
    if settings.models.models_dir:  # several models, loaded on demand (server/models_dir.py)
        if settings.engine.model:
            raise ValueError("--models-dir: give it or --model, not both")
        if settings.batch_dir:
            raise ValueError("--batch-dir: not supported with --models-dir yet")
        state.models = ModelPool(state)
        app.add_middleware(InFlight, pool=state.models)

    @app.on_event("startup")
    async def _startup():
        if state.models is not None:
            state.models.start()
        elif load_in_background:
            threading.Thread(target=state.load, name="llmserve-load", daemon=True).start()
        else:
            state.load()
        if state.batches is not None:  # the batches left unfinished run on (they wait for the model)
            state.batches.start(app)

    @app.on_event("shutdown")
    async def _shutdown():
        state.draining = True
        if state.models is not None:
            state.models.shutdown()
        if state.batches is not None:
            await state.batches.stop()
        if state.engine is not None:
            state.engine.shutdown()
        if state.tracer is not None:  # export the spans still queued
            state.tracer.shutdown()

    # errors answer in the shape of the API the path belongs to (Anthropic's on /v1/messages)
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if state.metrics is not None and exc.status != 404:
            state.metrics.error(str(exc.status))
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return from_validation_errors(exc.errors()).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if isinstance(exc, BodyRefused):
            return exc.error.response(request.url.path)
        return APIError(exc.status_code, str(exc.detail)).response(request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}").response(request.url.path)

    install_openapi(app, include_apis(app, state))  # every status and streamed media type declared (server/openapi.py)
    return app
