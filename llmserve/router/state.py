"""The router's state: its config, the backends (registry, health, DNS discovery), the policy, and
the router queue (acquire a backend with room, or wait; release it after the answer). The HTTP side
is proxy.py (proxied requests) and routes.py (everything else)."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections import deque
from dataclasses import dataclass, field, fields

import httpx
from starlette.datastructures import Headers

from .discovery import DnsDiscovery, DnsSource, Registry, Resolver
from .errors import RouterError
from .health import HealthChecker
from .metrics import RouterMetrics
from .policies import Backend, Policy, RouteRequest, make_policy
from .upstream import UpstreamPool


@dataclass
class RouterConfig:
    policy: str = "cache_aware"
    max_retries: int = 2  # extra attempts on other backends, before the 1st byte
    connect_timeout: float = 5.0
    first_byte_timeout: float = 120.0  # streams: until the backend's first byte
    request_timeout: float | None = None  # fixed per-request limit; None: from the request's size
    timeout_base: float = 60.0  # computed limit = base + prompt_tokens * per_prompt
    timeout_per_prompt_token: float = 0.02  #                 + max_tokens * per_output
    timeout_per_output_token: float = 0.25
    default_max_tokens: int = 1024  # when the request gives no max_tokens
    max_outstanding: int = 64  # per backend; 0: unlimited (no router queue)
    max_queued: int = 256  # beyond this, 429 with Retry-After
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
    api_key: str | None = None  # the router's own key (clients must send it)
    backend_api_key: str | None = None  # sent to backends instead of the client's key
    forward_client_key: bool = False  # pass the client's Authorization/x-api-key through to backends
    dns_interval: float = 10.0
    backends: list[str] = field(default_factory=list)
    backend_dns: list[str] = field(default_factory=list)

    @classmethod
    def from_namespace(cls, ns) -> "RouterConfig":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


class Router:
    """Backends, policy, health and the queue; the HTTP side is `build_app`."""

    def __init__(self, config: RouterConfig, registry: Registry | None = None, dns_resolver: Resolver | None = None):
        self.config = cfg = config
        self.metrics = RouterMetrics()
        self.registry = registry or Registry()
        for url in cfg.backends:
            self.registry.add(Backend(url=url, source="static"))
        self.policy: Policy = make_policy(
            cfg.policy,
            use_metrics=cfg.scrape_metrics,
            power_of_two=cfg.power_of_two,
            cache_threshold=cfg.cache_threshold,
            balance_abs_threshold=cfg.balance_abs_threshold,
            balance_rel_threshold=cfg.balance_rel_threshold,
        )
        self.registry.on_removed(self._on_removed)
        self.registry.on_added(lambda b: self.metrics.healthy.labels(b.url).set(0))
        for b in self.registry:
            self.metrics.healthy.labels(b.url).set(0)
        self.dns = [
            DnsDiscovery(
                self.registry,
                DnsSource.parse(spec),
                cfg.dns_interval,
                resolver=dns_resolver,
                on_change=self._on_dns_change,
            )
            for spec in cfg.backend_dns
        ]
        self.client: httpx.AsyncClient | None = None  # health checks, metrics scraping
        self.upstream: UpstreamPool | None = None  # proxied requests
        self.health: HealthChecker | None = None
        self.queued = 0
        self.recent_decisions: deque[dict] = deque(maxlen=50)  # for the web page: where and why
        self._waiters: deque[asyncio.Future] = deque()
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle --
    async def start(self) -> None:
        cfg = self.config
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            timeout=httpx.Timeout(cfg.connect_timeout, read=None),
            follow_redirects=False,
        )
        self.upstream = UpstreamPool(connect_timeout=cfg.connect_timeout)
        headers = {"Authorization": f"Bearer {cfg.backend_api_key}"} if cfg.backend_api_key else {}
        self.health = HealthChecker(
            self.registry,
            self.client,
            self.metrics,
            interval=cfg.health_interval,
            timeout=cfg.health_timeout,
            unhealthy_threshold=cfg.unhealthy_threshold,
            healthy_threshold=cfg.healthy_threshold,
            scrape_metrics=cfg.scrape_metrics,
            headers=headers,
            on_change=self.wake_waiters,
        )
        for d in self.dns:
            await d.refresh()
        await self.health.check_all()  # ready at once when the backends already are
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
        if added and self.health is not None:  # check new addresses now, not in one interval
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
        return [b for b in self.registry if b.healthy and id(b) not in exclude and (model is None or model in b.models)]

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
                    raise RouterError(
                        503, f"no healthy backend{what}", "service_unavailable_error", "no_healthy_backend"
                    )
                free = [b for b in cands if not self.saturated(b)]
                if free:
                    break
                if queued_since is None:
                    if self.queued >= self.config.max_queued:
                        self.metrics.rejected.labels("queue_full").inc()
                        raise RouterError(
                            429,
                            "all backends are saturated and the router queue is full; retry later",
                            "rate_limit_error",
                            "router_queue_full",
                            headers={"Retry-After": "1"},
                        )
                    queued_since = time.perf_counter()
                    self.queued += 1
                    self.metrics.queued.set(self.queued)
                remaining = min(queued_since + self.config.queue_timeout - time.perf_counter(), deadline - loop.time())
                if remaining <= 0:
                    self.metrics.rejected.labels("queue_timeout").inc()
                    raise RouterError(
                        429,
                        "timed out waiting for a backend with room",
                        "rate_limit_error",
                        "router_queue_timeout",
                        headers={"Retry-After": "1"},
                    )
                fut = loop.create_future()
                self._waiters.append(fut)
                try:  # asyncio.wait, not wait_for: 3.11's drops a cancellation (client gone) that
                    await asyncio.wait({fut}, timeout=remaining)  # lands as a slot frees
                finally:
                    fut.cancel()  # a no-op once woken (every waiter is woken and looks again)
        finally:
            if queued_since is not None:
                self.queued -= 1
                self.metrics.queued.set(self.queued)
                self.metrics.queue_time.observe(time.perf_counter() - queued_since)
        decision = self.policy.choose(req, free)
        b = decision.backend
        self.policy.on_routed(req, b)
        self.metrics.decisions.labels(self.policy.name, decision.reason).inc()
        self.recent_decisions.append(
            {"time": time.time(), "backend": b.url, "reason": decision.reason, "model": req.model}
        )
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
        return (
            cfg.timeout_base
            + req.prompt_tokens * cfg.timeout_per_prompt_token
            + max_tokens * cfg.timeout_per_output_token
        )

    def authorized(self, headers: Headers) -> bool:
        key = self.config.api_key
        if not key:
            return True
        auth = headers.get("authorization", "").encode("latin-1", "replace")
        xkey = headers.get("x-api-key", "").encode("latin-1", "replace")
        want = key.encode()  # constant-time comparisons: no timing oracle on the key
        return hmac.compare_digest(auth, b"Bearer " + want) | hmac.compare_digest(xkey, want)
