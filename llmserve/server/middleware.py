"""The server's HTTP middleware: API key auth (any one of the keys: llmserve/security.py), body size and
time limits, CORS wiring.

GuardMiddleware is pure ASGI, so that streamed answers stay unbuffered. Header size and header time
limits are uvicorn's protocol's (http_limits.py); the body's are here: a body over
--max-request-body-bytes gets a 413 (declared by Content-Length or found while reading), one that does
not arrive within --read-timeout a 408. An oversize body is drained first (_drain_body), so that a
client that writes its whole body before reading sees the 413.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmserve.security import key_ok
from llmserve.server.errors import APIError
from llmserve.server.state import ServerState


def install_middleware(app: FastAPI, state: ServerState) -> None:
    """CORS (only with --allowed-origins), then the guard (outermost: it runs first)."""
    settings = state.settings
    if settings.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            allow_credentials=False,
        )
    app.add_middleware(GuardMiddleware, state=state)


class BodyRefused(StarletteHTTPException):
    """Too large or too slow. An HTTPException, so that FastAPI's body parsing re-raises it as is."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.status, error.message)
        self.error = error


def _too_large_error(limit: int) -> APIError:
    return APIError(
        413,
        f"request body is larger than the limit of {limit} bytes (--max-request-body-bytes)",
        code="request_too_large",
        headers={"Connection": "close"},
    )


def _too_slow_error(timeout: float) -> APIError:
    return APIError(
        408,
        f"the request body did not arrive within {timeout:g} s (--read-timeout)",
        code="request_timeout",
        headers={"Connection": "close"},
    )


OPEN_PATHS = ("/health", "/ready", "/version", "/metrics", "/stats", "/openapi.json", "/docs", "/")


class GuardMiddleware:
    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        s = self.state.settings
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        if self.state.api_keys and scope.get("method") != "OPTIONS":
            open_path = (path in OPEN_PATHS or path.startswith("/static/")) and not (
                s.protect_metrics and path in ("/health", "/ready", "/version", "/metrics", "/stats")
            )
            if not open_path and not key_ok(headers, self.state.api_keys):
                err = APIError(
                    401,
                    "invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                    code="invalid_api_key",
                )
                return await err.response(path)(scope, receive, send)
        limit = s.max_request_body_bytes
        if path == "/v1/files" and s.batch_dir:  # uploads: the file's limit, and room for the multipart framing
            limit = max(limit, s.max_batch_file_bytes + 64 * 1024)
        try:
            declared = int(headers.get("content-length", "0") or 0)
        except ValueError:
            declared = 0
        if declared > limit:
            return await self._too_large(scope, receive, send, limit, headers, s.read_timeout, path)
        seen = 0
        started = False
        body_done = False
        read_timeout = s.read_timeout
        deadline = None

        async def limited_receive():
            nonlocal seen, body_done, deadline
            if body_done or not read_timeout:
                msg = await receive()
            else:  # the whole body must arrive within read_timeout of the first read (slow bodies)
                loop = asyncio.get_running_loop()
                deadline = deadline or loop.time() + read_timeout
                try:
                    msg = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    raise BodyRefused(_too_slow_error(read_timeout)) from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if not msg.get("more_body"):
                    body_done = True
                if seen > limit:
                    if not body_done:
                        await _drain_body(receive, read_timeout)
                    raise BodyRefused(_too_large_error(limit))
            return msg

        async def tracking_send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyRefused as e:
            if not started:
                await e.error.response(path)(scope, receive, send)

    @staticmethod
    async def _too_large(scope, receive, send, limit, headers, read_timeout, path):
        # A client that waits for "100 Continue" has sent no body: answer at once, it sends none.
        if headers.get("expect", "").lower() != "100-continue":
            await _drain_body(receive, read_timeout)
        await _too_large_error(limit).response(path)(scope, receive, send)


DRAIN_MAX_BYTES = 64 * 1024 * 1024  # of an oversize body, read and discarded before the 413


async def _drain_body(receive, read_timeout: float) -> None:
    """Read and discard the rest of a refused body (up to DRAIN_MAX_BYTES, within the read timeout or
    30 s), as nginx's lingering close does: a client that writes its whole body before reading the answer
    (urllib, requests) would otherwise have its connection reset mid-upload and never see the 413."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (read_timeout or 30.0)
    drained = 0
    while drained <= DRAIN_MAX_BYTES:
        left = deadline - loop.time()
        if left <= 0:
            return
        getter = asyncio.ensure_future(receive())
        done, _ = await asyncio.wait({getter}, timeout=left)
        if not done:
            getter.cancel()
            return
        msg = getter.result()
        if msg["type"] != "http.request":
            return  # the client went away
        drained += len(msg.get("body", b""))
        if not msg.get("more_body"):
            return
