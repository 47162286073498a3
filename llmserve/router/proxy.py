"""The proxy: a raw ASGI endpoint for the POSTs the router forwards.

    client ──▶ ProxyEndpoint ──▶ Router.acquire()  (candidates: healthy, serving the model, not tried;
                   │                               waits in the router queue when all are saturated)
                   │            ──▶ policy.choose()   (round_robin, least_outstanding, cache_aware, ...)
                   ▼
             upstream HTTP/1.1 request to the backend; wait for its first body byte
                   │  connection refused / reset, 502, 503, 429 before that byte → next backend
                   ▼
             response start + bytes as they come (never buffered, never replayed)

A client that disconnects cancels the request task, which closes the upstream connection: the
backend sees its client go and aborts the request. Errors are in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
import uuid
from contextlib import asynccontextmanager

from starlette.datastructures import Headers

from llmserve.errors import is_ollama_path

from .config import RouterConfig
from .errors import RouterError, send_error
from .policies import Backend, RouteRequest
from .state import Router
from .upstream import ConnectFailed, ConnectionLost, UpstreamResponse

log = logging.getLogger("llmserve.router")

RETRYABLE_STATUS = {429, 502, 503}
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "accept-encoding",
}
_RESPONSE_DROP = {"connection", "keep-alive", "transfer-encoding", "date", "server"}
_RESPONSE_DROP_B = {h.encode() for h in _RESPONSE_DROP}


if hasattr(asyncio, "timeout_at"):  # Python 3.11+
    timeout_at = asyncio.timeout_at
else:  # 3.10: cancel the task at the deadline ourselves

    @asynccontextmanager
    async def timeout_at(when: float):
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        fired = False

        def fire():
            nonlocal fired
            fired = True
            task.cancel()

        handle = loop.call_at(when, fire)
        try:
            yield
        except asyncio.CancelledError:
            if fired:
                raise asyncio.TimeoutError from None
            raise
        finally:
            handle.cancel()


def _flatten_content(content) -> str:
    """A message's content as text: a string, or parts / blocks (OpenAI's text parts, the Responses API's
    input_text / output_text, Anthropic's text, thinking, tool_result and tool_use blocks)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_text(p) for p in content)
    return "" if content is None else str(content)


def _image_tag(data: str) -> str:
    """An image as prompt text for the policies: a short hash of its URL (a data: URL holds the encoded picture),
    so that the same picture keys the same prefix (and backend) and another picture never does."""
    return f"<image {hashlib.sha256(data.encode()).hexdigest()[:16]}>"


def _image_ref(p: dict) -> str | None:
    """An image part's URL (chat image_url, Responses input_image) or source (Anthropic image), else None."""
    url = p.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if isinstance(url, str):
        return url
    source = p.get("source")
    if p.get("type") == "image" and isinstance(source, dict):
        return str(source.get("data") or source.get("url") or "")
    return None


def _part_text(p) -> str:
    if not isinstance(p, dict):
        return str(p)
    image = _image_ref(p)
    if image is not None:
        return _image_tag(image)
    if isinstance(p.get("images"), list):  # Ollama: a message's base64 images beside its content
        return "".join(_image_tag(str(i)) for i in p["images"]) + _flatten_content(p.get("content"))
    for key in ("text", "thinking", "output", "arguments"):
        if isinstance(p.get(key), str):
            return p[key]
    if "content" in p:
        return _flatten_content(p["content"])
    return json.dumps(p.get("input"), sort_keys=True) if "input" in p else ""


def _turns(items: list, system=None) -> str:
    """Messages (chat, Anthropic) or input items (Responses) as role-tagged text, the system prompt first."""
    head = f"<system>{_flatten_content(system)}\n" if system else ""
    return head + "".join(
        f"<{m.get('role') or m.get('type', '')}>{_part_text(m)}\n" for m in items if isinstance(m, dict)
    )


def route_request(payload: dict, headers: Headers, cfg: RouterConfig, path: str = "") -> RouteRequest:
    """The facts a policy routes on, read from the JSON body of any proxied API (chat and text
    completions, Responses, Anthropic's Messages, embeddings, Ollama's on /api/*: `name:latest` is `name`,
    streaming unless `stream` is false, `options.num_predict`). No tokenizer at the router: the prompt
    length is estimated as characters / chars_per_token."""
    text, ntok = "", None
    prompt = payload.get("prompt", payload.get("input", ""))
    if isinstance(payload.get("messages"), list):  # chat; Anthropic (with `system`)
        text = _turns(payload["messages"], payload.get("system"))
    elif isinstance(prompt, list) and any(isinstance(x, dict) for x in prompt):  # Responses input items
        text = _turns(prompt, payload.get("instructions"))
    elif isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
        text, ntok = " ".join(map(str, prompt)), len(prompt)
    elif isinstance(prompt, list):
        text = "\n".join(p if isinstance(p, str) else " ".join(map(str, p)) for p in prompt)
    else:
        text = str(prompt or "")
        if payload.get("instructions"):  # Responses, input as a string
            text = _turns([{"role": "user", "content": text}], payload["instructions"])
    if ntok is None:
        ntok = math.ceil(len(text) / cfg.chars_per_token)
    max_tokens = payload.get("max_completion_tokens") or payload.get("max_tokens") or payload.get("max_output_tokens")
    metadata = payload.get("metadata")
    session = (
        headers.get(cfg.session_header)
        or payload.get("user")
        or (metadata.get("user_id") if isinstance(metadata, dict) else None)
    )
    model, stream = payload.get("model"), bool(payload.get("stream"))
    if is_ollama_path(path):
        options = payload.get("options") if isinstance(payload.get("options"), dict) else {}
        max_tokens = options.get("num_predict") if isinstance(options.get("num_predict"), int) else None
        max_tokens = max_tokens if max_tokens is not None and max_tokens > 0 else None
        model = model.removesuffix(":latest") if isinstance(model, str) else model
        stream = payload.get("stream", True) is not False and path in ("/api/chat", "/api/generate")
    return RouteRequest(
        model=model if isinstance(model, str) and model else None,
        prompt_text=text,
        prompt_tokens=ntok,
        max_tokens=max_tokens if isinstance(max_tokens, int) else None,
        session_key=str(session) if session else None,
        stream=stream,
    )


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ConnectionAbortedError
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)


async def _send_sse_error(send, err: RouterError, path: str) -> None:
    """A stream that fails after it started: an error event, as the path's API sends it."""
    await send({"type": "http.response.body", "more_body": True, "body": err.sse(path)})


class _Retry(Exception):
    def __init__(self, reason: str, response: tuple | None = None):
        super().__init__(reason)
        self.reason, self.response = reason, response


class ProxyEndpoint:
    """A raw ASGI endpoint, so that the proxy controls exactly when the response starts and can
    watch for the client going away while it waits for a backend."""

    def __init__(self, router: Router):
        self.router = router

    async def __call__(self, scope, receive, send) -> None:
        r = self.router
        t0 = time.perf_counter()
        headers = Headers(scope=scope)
        try:
            body = await _read_body(receive)
        except ConnectionAbortedError:
            return
        try:
            if not r.authorized(headers):
                raise RouterError(401, "invalid or missing API key", "invalid_request_error", "invalid_api_key")
            try:
                payload = json.loads(body) if body else {}
            except ValueError as e:
                raise RouterError(
                    400, f"request body is not valid JSON: {e}", "invalid_request_error", "invalid_json"
                ) from None
            if not isinstance(payload, dict):
                raise RouterError(400, "request body must be a JSON object", "invalid_request_error", "invalid_json")
            req = route_request(payload, headers, r.config, scope["path"])
            if req.model is not None and req.model not in r.known_models():
                if not r.known_models():
                    raise RouterError(503, "no backend is ready yet", "service_unavailable_error", "no_healthy_backend")
                raise RouterError(
                    404, f"The model '{req.model}' does not exist", "invalid_request_error", "model_not_found", "model"
                )
        except RouterError as e:
            r.metrics.requests.labels("none", str(e.status)).inc()
            await send_error(send, e, scope["path"])
            return

        req.token_ids = await r.prompt_token_ids(payload, req, scope["path"])
        started = False

        async def tracked_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        work = asyncio.create_task(self._serve(scope, tracked_send, body, headers, req, t0))
        watch = asyncio.create_task(self._wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:  # the client left: abort the backend request
                r.metrics.client_disconnects.inc()
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            elif work.exception() is not None:
                log.error("request failed in the router", exc_info=work.exception())
                if not started:
                    r.metrics.requests.labels("none", "502").inc()
                    await send_error(
                        send,
                        RouterError(502, f"router error: {work.exception()!r}", "bad_gateway", "router_error"),
                        scope["path"],
                    )
        finally:
            for t in (work, watch):
                if not t.done():
                    t.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)

    @staticmethod
    async def _wait_disconnect(receive) -> None:
        while True:
            if (await receive())["type"] == "http.disconnect":
                return

    def _upstream_headers(self, headers: Headers, request_id: str) -> list[tuple[str, str]]:
        drop = set(_HOP_BY_HOP) | {"x-request-id"}
        key = self.router.config.backend_api_key
        if key or not self.router.config.forward_client_key:  # the client's key stays here by default
            drop |= {"authorization", "x-api-key"}
        out = [(k, v) for k, v in headers.items() if k not in drop]
        if key:
            out.append(("authorization", f"Bearer {key}"))
        out.append(("x-request-id", request_id))
        return out

    async def _serve(self, scope, send, body: bytes, headers: Headers, req: RouteRequest, t0: float) -> None:
        r, cfg = self.router, self.router.config
        loop = asyncio.get_running_loop()
        timeout = r.request_timeout(req, headers)
        deadline = loop.time() + timeout
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        up_headers = self._upstream_headers(headers, request_id)
        path = scope["path"] + (("?" + scope["query_string"].decode()) if scope.get("query_string") else "")
        tried: set[int] = set()
        fallback: tuple | None = None  # the last retryable answer, given if nobody else can
        for attempt in range(1 + max(cfg.max_retries, 0)):
            last = attempt == cfg.max_retries
            try:
                backend = await r.acquire(req, tried, deadline)
            except RouterError as e:
                if fallback is not None:
                    await self._send_buffered(send, *fallback, request_id)
                else:
                    r.metrics.requests.labels("none", str(e.status)).inc()
                    await send_error(send, e, scope["path"])
                return
            tried.add(id(backend))
            t_sent = time.perf_counter()
            if attempt == 0:
                r.metrics.overhead.observe(t_sent - t0)
            upstream = None
            try:
                budget = deadline - loop.time()
                if req.stream:
                    budget = min(budget, cfg.first_byte_timeout)
                async with timeout_at(loop.time() + budget):
                    upstream, first = await self._open(backend, path, scope["method"], body, up_headers, last)
                await self._relay(send, backend, upstream, first, req, deadline, request_id, t0, scope["path"])
                return
            except _Retry as e:
                r.metrics.retries.labels(backend.url, e.reason).inc()
                log.info("retrying %s: %s on %s", request_id, e.reason, backend.url)
                if e.response is not None:
                    fallback = e.response
                else:
                    fallback = (
                        502,
                        {"content-type": "application/json"},
                        RouterError(
                            502, f"backend {backend.url} failed: {e.reason}", "bad_gateway", "backend_error"
                        ).body(scope["path"]),
                        backend,
                    )
            except asyncio.TimeoutError:
                r.metrics.requests.labels(backend.url, "504").inc()
                what = "first byte" if req.stream else "response"
                await send_error(
                    send,
                    RouterError(
                        504,
                        f"backend {backend.url} sent no {what} within {budget:.1f}s",
                        "timeout_error",
                        "backend_timeout",
                    ),
                    scope["path"],
                )
                return
            finally:
                if upstream is not None:
                    await upstream.aclose()
                r.release(backend)
        await self._send_buffered(send, *fallback, request_id)

    async def _open(
        self, backend: Backend, path: str, method: str, body: bytes, headers: list[tuple[str, str]], last: bool
    ):
        """Send the request and wait for the first body byte. Raises _Retry for failures that
        happened before anything reached the client."""
        health = self.router.health
        resp = None
        try:
            resp = await self.router.upstream.request(method, backend.url, path, headers, body)
            if resp.status_code in RETRYABLE_STATUS and not last:
                data = await resp.aread()
                raise _Retry(str(resp.status_code), (resp.status_code, resp.headers, data, backend))
            first = await anext(resp, b"")
            return resp, first
        except ConnectFailed as e:
            health.report_failure(backend, e)
            raise _Retry("connect_error") from e
        except ConnectionLost as e:
            # the backend died (or dropped us) before its first byte: nothing was sent yet
            if resp is not None:
                await resp.aclose()
            health.report_failure(backend, e)
            raise _Retry("connection_lost") from e
        except BaseException:
            if resp is not None:
                await resp.aclose()
            raise

    async def _relay(
        self,
        send,
        backend: Backend,
        upstream: UpstreamResponse,
        first: bytes,
        req: RouteRequest,
        deadline: float,
        request_id: str,
        t0: float,
        path: str,
    ) -> None:
        r = self.router
        status = upstream.status_code
        out = [(k.lower(), v) for k, v in upstream.raw_headers if k.lower() not in _RESPONSE_DROP_B]
        out.append((b"x-llmserve-backend", backend.url.encode()))
        if not any(k == b"x-request-id" for k, _ in out):
            out.append((b"x-request-id", request_id.encode()))
        sse = any(k == b"content-type" and (b"text/event-stream" in v or b"ndjson" in v) for k, v in out)
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": first, "more_body": True})
        r.metrics.ttfb.labels(backend.url).observe(time.perf_counter() - t0)
        outcome = str(status)
        try:
            async with timeout_at(deadline):
                async for chunk in upstream:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except asyncio.TimeoutError:
            outcome = "timeout"
            log.warning("request %s timed out mid-stream on %s", request_id, backend.url)
            if sse:
                await _send_sse_error(
                    send, RouterError(504, "request timed out at the router", "timeout_error", "request_timeout"), path
                )
        except ConnectionLost as e:
            # Cut mid-stream: never replayed. Tell an SSE client in OpenAI's way.
            outcome = "stream_error"
            r.metrics.stream_errors.labels(backend.url).inc()
            r.health.report_failure(backend, e)
            log.warning("stream %s from %s cut: %s", request_id, backend.url, e)
            if sse:
                await _send_sse_error(
                    send,
                    RouterError(502, f"backend {backend.url} failed mid-stream", "bad_gateway", "backend_stream_error"),
                    path,
                )
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        r.metrics.requests.labels(backend.url, outcome).inc()
        r.metrics.duration.labels(backend.url).observe(time.perf_counter() - t0)

    async def _send_buffered(
        self, send, status: int, headers: dict, data: bytes, backend: Backend, request_id: str
    ) -> None:
        out = [
            (k.encode("latin-1"), v.encode("latin-1"))
            for k, v in headers.items()
            if k.lower() not in _RESPONSE_DROP and k.lower() != "content-length"
        ]
        out += [(b"content-length", str(len(data)).encode()), (b"x-llmserve-backend", backend.url.encode())]
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": data, "more_body": False})
        self.router.metrics.requests.labels(backend.url, str(status)).inc()
