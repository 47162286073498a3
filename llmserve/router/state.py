"""The router's state: the backends (registry, health, DNS discovery), the policy, and the router queue
(acquire a backend with room, or wait; release it after the answer). Its settings are config.py's RouterConfig;
the HTTP side is proxy.py (proxied requests) and routes.py (everything else)."""

from __future__ import annotations

import asyncio
import time
from collections import deque

import httpx
from starlette.datastructures import Headers

from llmserve.security import key_ok

from .config import RouterConfig
from .discovery import DnsDiscovery, DnsSource, Registry, Resolver
from .errors import RouterError
from .health import HealthChecker
from .metrics import RouterMetrics
from .policies import Backend, Policy, RouteRequest, make_policy
from .upstream import UpstreamPool


class Router:
    """Backends, policy, health and the queue; the HTTP side is `build_app`."""

    def __init__(self, config: RouterConfig, registry: Registry | None = None, dns_resolver: Resolver | None = None):
        self.config = cfg = config
        self.api_keys = cfg.api_keys()  # read once, at start-up
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

    @property
    def reads_kv_events(self) -> bool:
        return self.policy.name == "cache_aware" and self.config.kv_events_interval > 0

    async def prompt_token_ids(self, payload: dict, req: RouteRequest, path: str) -> list[int] | None:
        """The request's prompt as the backends tokenize it, asked of a backend that publishes KV events (POST
        /tokenize: a text prompt, or chat messages through its chat template); None where none publishes."""
        if not self.reads_kv_events or self.health is None:
            return None
        b = next((b for b in self.candidates(req.model) if b.kv_blocks is not None), None)
        if b is None:
            return None
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
            return prompt
        if path.endswith("/chat/completions") and isinstance(payload.get("messages"), list):
            body = {"model": req.model, "messages": payload["messages"]}
        elif path.endswith("/completions") and isinstance(prompt, str):
            body = {"model": req.model, "prompt": prompt}
        else:
            return None
        try:
            r = await self.client.post(
                b.url + "/tokenize", json=body, timeout=self.config.health_timeout, headers=self.health.headers
            )
            tokens = r.json()["tokens"] if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
        return tokens if isinstance(tokens, list) else None

    # -- lifecycle --
    async def start(self) -> None:
        cfg = self.config
        tls = cfg.backend_ssl_context()
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            timeout=httpx.Timeout(cfg.connect_timeout, read=None),
            follow_redirects=False,
            verify=tls,
        )
        self.upstream = UpstreamPool(connect_timeout=cfg.connect_timeout, ssl_context=tls)
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
        if self.reads_kv_events:
            self._tasks.append(asyncio.create_task(self.health.run_kv_events(cfg.kv_events_interval)))
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
        """Healthy backends serving `model`, not tried yet; those that have it loaded, when some have and others
        list it unloaded (`llmserve serve --models-dir`: a request elsewhere would wait for a load)."""
        out = [b for b in self.registry if b.healthy and id(b) not in exclude and (model is None or model in b.models)]
        if model is not None and len(out) > 1:
            loaded = [
                b for b in out if (b.model_cards.get(model) or {}).get("status", {}).get("value", "loaded") == "loaded"
            ]
            return loaded or out
        return out

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
        """The request carries one of the router's keys (or it has none)."""
        return not self.api_keys or key_ok(headers, self.api_keys)
