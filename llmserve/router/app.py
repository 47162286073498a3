"""The router: an OpenAI-API reverse proxy over several llmserve (or vLLM) servers.

    client ──▶ ProxyEndpoint ──▶ Router.acquire()  (candidates: healthy, serving the model, not tried;
                   │                               waits in the router queue when all are saturated)
                   │            ──▶ policy.choose()   (round_robin, least_outstanding, cache_aware, ...)
                   ▼
             httpx stream to the backend; wait for its first body byte
                   │  connection refused / reset, 502, 503, 429 before that byte → next backend
                   ▼
             response start + bytes as they come (never buffered, never replayed)

A client that disconnects cancels the request task, which closes the upstream connection: the
backend sees its client go and aborts the request. Errors are in OpenAI's shape.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import os
import time
import uuid
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, fields

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers

from .discovery import DnsDiscovery, DnsSource, Registry, Resolver
from .health import HealthChecker
from .metrics import RouterMetrics
from .policies import Backend, Policy, RouteRequest, make_policy
from .upstream import ConnectFailed, ConnectionLost, UpstreamPool, UpstreamResponse

log = logging.getLogger("llmserve.router")

# Requests the router proxies (POST). Any other POST under /v1/ is proxied too.
PROXY_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize",
               "/detokenize")
RETRYABLE_STATUS = {429, 502, 503}
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
               "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
               "accept-encoding"}
_RESPONSE_DROP = {"connection", "keep-alive", "transfer-encoding", "date", "server"}
_RESPONSE_DROP_B = {h.encode() for h in _RESPONSE_DROP}


@dataclass
class RouterConfig:
    policy: str = "cache_aware"
    max_retries: int = 2                  # extra attempts on other backends, before the 1st byte
    connect_timeout: float = 5.0
    first_byte_timeout: float = 120.0     # streams: until the backend's first byte
    request_timeout: float | None = None  # fixed per-request limit; None: from the request's size
    timeout_base: float = 60.0            # computed limit = base + prompt_tokens * per_prompt
    timeout_per_prompt_token: float = 0.02  #                 + max_tokens * per_output
    timeout_per_output_token: float = 0.25
    default_max_tokens: int = 1024        # when the request gives no max_tokens
    max_outstanding: int = 64             # per backend; 0: unlimited (no router queue)
    max_queued: int = 256                 # beyond this, 429 with Retry-After
    queue_timeout: float = 60.0
    health_interval: float = 5.0
    health_timeout: float = 2.0
    unhealthy_threshold: int = 3
    healthy_threshold: int = 1
    scrape_metrics: bool = False
    power_of_two: bool = False
    cache_threshold: float = 0.5
    balance_abs_threshold: float = 32
    balance_rel_threshold: float = 1.5
    session_header: str = "x-session-id"
    chars_per_token: float = 4.0
    api_key: str | None = None            # the router's own key (clients must send it)
    backend_api_key: str | None = None    # sent to backends instead of the client's key
    forward_client_key: bool = False      # pass the client's Authorization/x-api-key through to backends
    dns_interval: float = 10.0
    backends: list[str] = field(default_factory=list)
    backend_dns: list[str] = field(default_factory=list)

    @classmethod
    def from_namespace(cls, ns) -> "RouterConfig":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


if hasattr(asyncio, "timeout_at"):          # Python 3.11+
    timeout_at = asyncio.timeout_at
else:                                       # 3.10: cancel the task at the deadline ourselves
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


class RouterError(Exception):
    """An answer the router gives itself, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, type: str, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_json(self.message, self.type, self.code, self.param)


def error_json(message: str, type: str, code: str | None = None, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": param,
                                 "code": code}}).encode()


def _flatten_content(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def route_request(payload: dict, headers: Headers, cfg: RouterConfig) -> RouteRequest:
    """The facts a policy routes on, read from the JSON body (no tokenizer at the router: the
    prompt length is estimated as characters / chars_per_token)."""
    text, ntok = "", None
    if isinstance(payload.get("messages"), list):
        text = "".join(f"<{m.get('role', '')}>{_flatten_content(m.get('content'))}\n"
                       for m in payload["messages"] if isinstance(m, dict))
    else:
        prompt = payload.get("prompt", payload.get("input", ""))
        if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
            text, ntok = " ".join(map(str, prompt)), len(prompt)
        elif isinstance(prompt, list):
            text = "\n".join(p if isinstance(p, str) else " ".join(map(str, p)) for p in prompt)
        else:
            text = str(prompt or "")
    if ntok is None:
        ntok = math.ceil(len(text) / cfg.chars_per_token)
    max_tokens = payload.get("max_completion_tokens") or payload.get("max_tokens")
    session = headers.get(cfg.session_header) or payload.get("user")
    model = payload.get("model")
    return RouteRequest(model=model if isinstance(model, str) and model else None,
                        prompt_text=text, prompt_tokens=ntok,
                        max_tokens=max_tokens if isinstance(max_tokens, int) else None,
                        session_key=str(session) if session else None,
                        stream=bool(payload.get("stream")))


class Router:
    """Backends, policy, health and the queue; the HTTP side is `build_app`."""

    def __init__(self, config: RouterConfig, registry: Registry | None = None,
                 dns_resolver: Resolver | None = None):
        self.config = cfg = config
        self.metrics = RouterMetrics()
        self.registry = registry or Registry()
        for url in cfg.backends:
            self.registry.add(Backend(url=url, source="static"))
        self.policy: Policy = make_policy(
            cfg.policy, use_metrics=cfg.scrape_metrics, power_of_two=cfg.power_of_two,
            cache_threshold=cfg.cache_threshold, balance_abs_threshold=cfg.balance_abs_threshold,
            balance_rel_threshold=cfg.balance_rel_threshold)
        self.registry.on_removed(self._on_removed)
        self.registry.on_added(lambda b: self.metrics.healthy.labels(b.url).set(0))
        for b in self.registry:
            self.metrics.healthy.labels(b.url).set(0)
        self.dns = [DnsDiscovery(self.registry, DnsSource.parse(spec), cfg.dns_interval,
                                 resolver=dns_resolver, on_change=self._on_dns_change)
                    for spec in cfg.backend_dns]
        self.client: httpx.AsyncClient | None = None      # health checks, metrics scraping
        self.upstream: UpstreamPool | None = None         # proxied requests
        self.health: HealthChecker | None = None
        self.queued = 0
        self.recent_decisions: deque[dict] = deque(maxlen=50)   # for the web page: where and why
        self._waiters: deque[asyncio.Future] = deque()
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle --
    async def start(self) -> None:
        cfg = self.config
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            timeout=httpx.Timeout(cfg.connect_timeout, read=None), follow_redirects=False)
        self.upstream = UpstreamPool(connect_timeout=cfg.connect_timeout)
        headers = {"Authorization": f"Bearer {cfg.backend_api_key}"} if cfg.backend_api_key else {}
        self.health = HealthChecker(
            self.registry, self.client, self.metrics, interval=cfg.health_interval,
            timeout=cfg.health_timeout, unhealthy_threshold=cfg.unhealthy_threshold,
            healthy_threshold=cfg.healthy_threshold, scrape_metrics=cfg.scrape_metrics,
            headers=headers, on_change=self.wake_waiters)
        for d in self.dns:
            await d.refresh()
        await self.health.check_all()      # ready at once when the backends already are
        self._tasks = [asyncio.create_task(self.health.run())]
        self._tasks += [asyncio.create_task(d.run()) for d in self.dns]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.client is not None:
            await self.client.aclose()
        if self.upstream is not None:
            await self.upstream.aclose()

    def _on_removed(self, b: Backend) -> None:
        self.policy.on_backend_removed(b)
        for g in (self.metrics.healthy, self.metrics.in_flight):
            try:
                g.remove(b.url)
            except KeyError:
                pass

    def _on_dns_change(self, added: list[str], removed: list[str]) -> None:
        if added and self.health is not None:   # check new addresses now, not in one interval
            for url in added:
                b = self.registry.get(url)
                if b is not None:
                    asyncio.get_running_loop().create_task(self.health.check(b))

    # -- state --
    def healthy_backends(self) -> list[Backend]:
        return [b for b in self.registry if b.healthy]

    def known_models(self) -> set[str]:
        return set().union(*(b.models for b in self.registry)) if len(self.registry) else set()

    def candidates(self, model: str | None, exclude: set[int] = frozenset()) -> list[Backend]:
        return [b for b in self.registry
                if b.healthy and id(b) not in exclude and (model is None or model in b.models)]

    def saturated(self, b: Backend) -> bool:
        limit = b.max_outstanding if b.max_outstanding is not None else self.config.max_outstanding
        return bool(limit) and b.outstanding >= limit

    def wake_waiters(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)

    # -- choosing a backend --
    async def acquire(self, req: RouteRequest, exclude: set[int], deadline: float) -> Backend:
        """A backend for `req`, its in-flight count already taken. Waits in the router queue
        while every candidate is saturated; raises RouterError (503 none healthy, 429 queue full
        or waited too long)."""
        loop = asyncio.get_running_loop()
        queued_since = None
        try:
            while True:
                cands = self.candidates(req.model, exclude)
                if not cands:
                    what = f" for model '{req.model}'" if req.model else ""
                    raise RouterError(503, f"no healthy backend{what}",
                                      "service_unavailable_error", "no_healthy_backend")
                free = [b for b in cands if not self.saturated(b)]
                if free:
                    break
                if queued_since is None:
                    if self.queued >= self.config.max_queued:
                        self.metrics.rejected.labels("queue_full").inc()
                        raise RouterError(429, "all backends are saturated and the router queue "
                                          "is full; retry later", "rate_limit_error",
                                          "router_queue_full", headers={"Retry-After": "1"})
                    queued_since = time.perf_counter()
                    self.queued += 1
                    self.metrics.queued.set(self.queued)
                remaining = min(queued_since + self.config.queue_timeout - time.perf_counter(),
                                deadline - loop.time())
                if remaining <= 0:
                    self.metrics.rejected.labels("queue_timeout").inc()
                    raise RouterError(429, "timed out waiting for a backend with room",
                                      "rate_limit_error", "router_queue_timeout",
                                      headers={"Retry-After": "1"})
                fut = loop.create_future()
                self._waiters.append(fut)
                try:   # asyncio.wait, not wait_for: 3.11's drops a cancellation (client gone) that
                    await asyncio.wait({fut}, timeout=remaining)   # lands as a slot frees
                finally:
                    fut.cancel()   # a no-op once woken (every waiter is woken and looks again)
        finally:
            if queued_since is not None:
                self.queued -= 1
                self.metrics.queued.set(self.queued)
                self.metrics.queue_time.observe(time.perf_counter() - queued_since)
        decision = self.policy.choose(req, free)
        b = decision.backend
        self.policy.on_routed(req, b)
        self.metrics.decisions.labels(self.policy.name, decision.reason).inc()
        self.recent_decisions.append({"time": time.time(), "backend": b.url, "reason": decision.reason,
                                      "model": req.model})
        b.outstanding += 1
        self.metrics.in_flight.labels(b.url).set(b.outstanding)
        return b

    def release(self, b: Backend) -> None:
        b.outstanding -= 1
        if b.url in self.registry.backends:
            self.metrics.in_flight.labels(b.url).set(b.outstanding)
        self.wake_waiters()

    def request_timeout(self, req: RouteRequest, headers: Headers) -> float:
        """The article's lesson: a long answer needs a long timeout. Header `X-Request-Timeout`
        (seconds) wins, then `--request-timeout`, then base + prompt and output allowances."""
        override = headers.get("x-request-timeout")
        if override:
            try:
                return max(float(override), 0.001)
            except ValueError:
                pass
        cfg = self.config
        if cfg.request_timeout:
            return cfg.request_timeout
        max_tokens = req.max_tokens or cfg.default_max_tokens
        return (cfg.timeout_base + req.prompt_tokens * cfg.timeout_per_prompt_token
                + max_tokens * cfg.timeout_per_output_token)

    def authorized(self, headers: Headers) -> bool:
        key = self.config.api_key
        if not key:
            return True
        auth = headers.get("authorization", "").encode("latin-1", "replace")
        xkey = headers.get("x-api-key", "").encode("latin-1", "replace")
        want = key.encode()   # constant-time comparisons: no timing oracle on the key
        return hmac.compare_digest(auth, b"Bearer " + want) | hmac.compare_digest(xkey, want)


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ConnectionAbortedError
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)


async def _send_error(send, err: RouterError) -> None:
    body = err.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


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
                raise RouterError(401, "invalid or missing API key", "invalid_request_error",
                                  "invalid_api_key")
            try:
                payload = json.loads(body) if body else {}
            except ValueError as e:
                raise RouterError(400, f"request body is not valid JSON: {e}",
                                  "invalid_request_error", "invalid_json") from None
            if not isinstance(payload, dict):
                raise RouterError(400, "request body must be a JSON object",
                                  "invalid_request_error", "invalid_json")
            req = route_request(payload, headers, r.config)
            if req.model is not None and req.model not in r.known_models():
                if not r.known_models():
                    raise RouterError(503, "no backend is ready yet", "service_unavailable_error",
                                      "no_healthy_backend")
                raise RouterError(404, f"The model '{req.model}' does not exist",
                                  "invalid_request_error", "model_not_found", "model")
        except RouterError as e:
            r.metrics.requests.labels("none", str(e.status)).inc()
            await _send_error(send, e)
            return

        started = False

        async def tracked_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        work = asyncio.create_task(self._serve(scope, tracked_send, body, headers, req, t0))
        watch = asyncio.create_task(self._wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:             # the client left: abort the backend request
                r.metrics.client_disconnects.inc()
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            elif work.exception() is not None:
                log.error("request failed in the router", exc_info=work.exception())
                if not started:
                    r.metrics.requests.labels("none", "502").inc()
                    await _send_error(send, RouterError(502, f"router error: {work.exception()!r}",
                                                        "bad_gateway", "router_error"))
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
        if key or not self.router.config.forward_client_key:   # the client's key stays here by default
            drop |= {"authorization", "x-api-key"}
        out = [(k, v) for k, v in headers.items() if k not in drop]
        if key:
            out.append(("authorization", f"Bearer {key}"))
        out.append(("x-request-id", request_id))
        return out

    async def _serve(self, scope, send, body: bytes, headers: Headers, req: RouteRequest,
                     t0: float) -> None:
        r, cfg = self.router, self.router.config
        loop = asyncio.get_running_loop()
        timeout = r.request_timeout(req, headers)
        deadline = loop.time() + timeout
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        up_headers = self._upstream_headers(headers, request_id)
        path = scope["path"] + (("?" + scope["query_string"].decode()) if scope.get("query_string") else "")
        tried: set[int] = set()
        fallback: tuple | None = None   # the last retryable answer, given if nobody else can
        for attempt in range(1 + max(cfg.max_retries, 0)):
            last = attempt == cfg.max_retries
            try:
                backend = await r.acquire(req, tried, deadline)
            except RouterError as e:
                if fallback is not None:
                    await self._send_buffered(send, *fallback, request_id)
                else:
                    r.metrics.requests.labels("none", str(e.status)).inc()
                    await _send_error(send, e)
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
                    upstream, first = await self._open(
                        backend, path, scope["method"], body, up_headers, last)
                await self._relay(send, backend, upstream, first, req, deadline, request_id, t0)
                return
            except _Retry as e:
                r.metrics.retries.labels(backend.url, e.reason).inc()
                log.info("retrying %s: %s on %s", request_id, e.reason, backend.url)
                if e.response is not None:
                    fallback = e.response
                else:
                    fallback = (502, {"content-type": "application/json"},
                                error_json(f"backend {backend.url} failed: {e.reason}",
                                           "bad_gateway", "backend_error"), backend)
            except asyncio.TimeoutError:
                r.metrics.requests.labels(backend.url, "504").inc()
                what = "first byte" if req.stream else "response"
                await _send_error(send, RouterError(
                    504, f"backend {backend.url} sent no {what} within {budget:.1f}s",
                    "timeout_error", "backend_timeout"))
                return
            finally:
                if upstream is not None:
                    await upstream.aclose()
                r.release(backend)
        await self._send_buffered(send, *fallback, request_id)

    async def _open(self, backend: Backend, path: str, method: str, body: bytes,
                    headers: list[tuple[str, str]], last: bool):
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

    async def _relay(self, send, backend: Backend, upstream: UpstreamResponse, first: bytes,
                     req: RouteRequest, deadline: float, request_id: str, t0: float) -> None:
        r = self.router
        status = upstream.status_code
        out = [(k.lower(), v) for k, v in upstream.raw_headers
               if k.lower() not in _RESPONSE_DROP_B]
        out.append((b"x-llmserve-backend", backend.url.encode()))
        if not any(k == b"x-request-id" for k, _ in out):
            out.append((b"x-request-id", request_id.encode()))
        sse = any(k == b"content-type" and b"text/event-stream" in v for k, v in out)
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
                await send({"type": "http.response.body", "more_body": True, "body": b"data: " +
                            error_json("request timed out at the router", "timeout_error",
                                       "request_timeout") + b"\n\n"})
        except ConnectionLost as e:
            # Cut mid-stream: never replayed. Tell an SSE client in OpenAI's way.
            outcome = "stream_error"
            r.metrics.stream_errors.labels(backend.url).inc()
            r.health.report_failure(backend, e)
            log.warning("stream %s from %s cut: %s", request_id, backend.url, e)
            if sse:
                await send({"type": "http.response.body", "more_body": True, "body": b"data: " +
                            error_json(f"backend {backend.url} failed mid-stream", "bad_gateway",
                                       "backend_stream_error") + b"\n\n"})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        r.metrics.requests.labels(backend.url, outcome).inc()
        r.metrics.duration.labels(backend.url).observe(time.perf_counter() - t0)

    async def _send_buffered(self, send, status: int, headers: dict, data: bytes,
                             backend: Backend, request_id: str) -> None:
        out = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()
               if k.lower() not in _RESPONSE_DROP and k.lower() != "content-length"]
        out += [(b"content-length", str(len(data)).encode()),
                (b"x-llmserve-backend", backend.url.encode())]
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": data, "more_body": False})
        self.router.metrics.requests.labels(backend.url, str(status)).inc()


def build_app(router: Router) -> "RouterApp":
    @asynccontextmanager
    async def lifespan(app):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="llmserve router", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.router = router

    def check_key(request: Request) -> JSONResponse | None:
        if router.authorized(request.headers):
            return None
        return JSONResponse(status_code=401, content=json.loads(error_json(
            "invalid or missing API key", "invalid_request_error", "invalid_api_key")))

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
        return {"policy": router.policy.name, "queued": router.queued, "backends": [
            {"url": b.url, "healthy": b.healthy, "models": sorted(b.models),
             "outstanding": b.outstanding, "weight": b.weight, "source": b.source,
             "ejected_reason": b.ejected_reason,
             "prompt_tokens": [b.min_prompt_tokens, b.max_prompt_tokens],
             "running": b.running, "waiting": b.waiting, "kv_usage": b.kv_usage}
            for b in router.registry], "recent": list(router.recent_decisions)[::-1]}

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
                cards.setdefault(m, dict(b.model_cards.get(m) or
                                         {"id": m, "object": "model", "owned_by": "llmserve"}))
        return {"object": "list", "data": list(cards.values())}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request):
        if (denied := check_key(request)) is not None:
            return denied
        for b in router.healthy_backends():
            if model in b.models:
                return b.model_cards.get(model) or {"id": model, "object": "model",
                                                    "owned_by": "llmserve"}
        return JSONResponse(status_code=404, content=json.loads(error_json(
            f"The model '{model}' does not exist", "invalid_request_error", "model_not_found",
            "model")))

    return RouterApp(app, ProxyEndpoint(router))


class RouterApp:
    """The ASGI app: proxied POSTs go straight to the proxy (no middleware stack on the hot
    path: each streamed chunk would cross five wrappers); everything else, lifespan included,
    to the FastAPI app."""

    def __init__(self, app: FastAPI, proxy: ProxyEndpoint):
        self.app, self.proxy = app, proxy
        self.router = proxy.router

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] == "http" and scope["method"] == "POST"
                and (scope["path"] in PROXY_PATHS or scope["path"].startswith("/v1/"))):
            await self.proxy(scope, receive, send)
        else:
            await self.app(scope, receive, send)
