"""The router's state: its config, the backends (registry, health, DNS discovery), the policy, and
the router queue (acquire a backend with room, or wait; release it after the answer). The HTTP side
is proxy.py (proxied requests) and routes.py (everything else)."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from dataclasses import dataclass, field

import httpx
from starlette.datastructures import Headers

from llmserve.flags import flag
from llmserve.security import api_key_field, api_key_file_field, key_ok, resolve_api_keys, ssl_field

from .discovery import DnsDiscovery, DnsSource, Registry, Resolver
from .errors import RouterError
from .health import HealthChecker
from .metrics import RouterMetrics
from .policies import POLICIES, Backend, Policy, RouteRequest, make_policy
from .upstream import UpstreamPool

DEFAULT_POLICY = "cache_aware"
TIMEOUTS = "retries, timeouts, back-pressure"


@dataclass
class RouterConfig:
    """`llmserve route`'s settings: each field's metadata makes its flag (llmserve/flags.py's `flag`), in
    field order and in its --help group."""

    # -- backends
    backends: list[str] = field(
        default_factory=list,
        metadata=flag(
            "a backend server (repeat for several)", name="--backend", action="append", metavar="URL", group="backends"
        ),
    )
    config: str | None = field(  # the fleet file (discovery.load_config), read by the CLI
        default=None,
        metadata=flag(
            "YAML file listing backends with models, weights, prompt-length ranges (see docs/router.md)",
            metavar="YAML",
        ),
    )
    backend_dns: list[str] = field(
        default_factory=list,
        metadata=flag(
            "discover backends from every address of a DNS "
            "name (e.g. a Kubernetes headless Service), re-resolved every --dns-interval",
            action="append",
            metavar="NAME:PORT",
        ),
    )
    dns_interval: float = field(default=10.0, metadata=flag(None, metavar="S"))
    # -- listening (the CLI's: uvicorn's)
    host: str = field(default="127.0.0.1", metadata=flag(None, group="listening"))
    port: int = field(default=8080, metadata=flag(None))
    ssl_keyfile: str | None = ssl_field("ssl_keyfile")  # TLS (llmserve/security.py): uvicorn's ssl_* settings
    ssl_certfile: str | None = ssl_field("ssl_certfile")
    ssl_ca_certs: str | None = ssl_field("ssl_ca_certs")
    ssl_cert_reqs: int = ssl_field("ssl_cert_reqs")
    api_key: str | list[str] | None = api_key_field(  # the router's own keys (clients must send one)
        "clients must send this key (Bearer, or x-api-key); several keys: any one is accepted"
    )
    api_key_file: str | None = api_key_file_field()
    backend_api_key: str | None = field(  # sent to backends instead of the client's key
        default=None, metadata=flag("key sent to backends (default: none; the client's key is not passed on)")
    )
    forward_client_key: bool = field(  # pass the client's Authorization/x-api-key through to backends
        default=False,
        metadata=flag(
            "pass the client's Authorization / x-api-key through to backends (off by default; --backend-api-key wins)",
            action="store_true",
        ),
    )
    backend_ca_certs: str | None = field(  # https:// backends are verified against this (else the system's CAs)
        default=None,
        metadata=flag(
            "CA certificates (PEM) to verify https:// backends with (default: the system's trusted CAs)",
            metavar="FILE",
        ),
    )
    log_level: str = field(default="info", metadata=flag(None))
    # -- routing (policies/)
    policy: str = field(
        default=DEFAULT_POLICY,
        metadata=flag(  # None: the fleet file's policy, else the default (the CLI's build_router)
            f"routing policy (default {DEFAULT_POLICY})", choices=tuple(sorted(POLICIES)), default=None, group="routing"
        ),
    )
    power_of_two: bool = field(
        default=False,
        metadata=flag("least_outstanding: pick the better of two random backends", action="store_true"),
    )
    cache_threshold: float = field(
        default=0.5, metadata=flag("cache_aware: minimum matched prefix fraction to follow the cache")
    )
    balance_abs_threshold: float = field(
        default=32, metadata=flag("cache_aware: load gap (requests) beyond which balance wins ...")
    )
    balance_rel_threshold: float = field(default=1.5, metadata=flag("... when also max load > min load * this"))
    session_header: str = field(
        default="x-session-id", metadata=flag("session: header with the session key (else the body's `user`)")
    )
    chars_per_token: float = field(default=4.0, metadata=flag("prompt length estimate for length buckets and timeouts"))
    kv_events_interval: float = field(
        default=1.0,
        metadata=flag(
            "cache_aware: seconds between reads of each backend's GET /kv_events (its real KV cache; "
            "backends without it keep the guessed prefix tree); 0: off",
            metavar="S",
        ),
    )
    scrape_metrics: bool = field(
        default=False,
        metadata=flag(
            "read running/waiting/KV usage from each backend's /metrics and use it "
            "in least_outstanding and cache_aware",
            action="store_true",
        ),
    )
    # -- health (health.py)
    health_interval: float = field(default=5.0, metadata=flag(None, metavar="S", group="health"))
    health_timeout: float = field(default=2.0, metadata=flag(None, metavar="S"))
    unhealthy_threshold: int = field(
        default=3, metadata=flag("failed checks in a row that eject a backend (refused connections: 1)")
    )
    healthy_threshold: int = field(default=1, metadata=flag("good checks in a row that re-admit an ejected backend"))
    # -- retries, timeouts, back-pressure (proxy.py, and the router queue below)
    max_retries: int = field(  # extra attempts on other backends, before the 1st byte
        default=2, metadata=flag("attempts on other backends for failures before the first byte", group=TIMEOUTS)
    )
    connect_timeout: float = field(default=5.0, metadata=flag(None, metavar="S"))
    first_byte_timeout: float = field(  # streams: until the backend's first byte
        default=120.0, metadata=flag("streams: limit until the backend's first byte", metavar="S")
    )
    request_timeout: float | None = field(  # fixed per-request limit; None: from the request's size
        default=None,
        metadata=flag(
            "fixed per-request limit (default: computed from prompt length and "
            "max_tokens; clients may send X-Request-Timeout)",
            metavar="S",
        ),
    )
    # the computed limit: base + prompt_tokens * per_prompt + max_tokens * per_output
    timeout_base: float = field(default=60.0, metadata=flag(None, metavar="S"))
    timeout_per_prompt_token: float = field(default=0.02, metadata=flag(None))
    timeout_per_output_token: float = field(default=0.25, metadata=flag(None))
    default_max_tokens: int = field(
        default=1024, metadata=flag("max_tokens assumed for the timeout when a request gives none")
    )
    max_outstanding: int = field(  # per backend; 0: unlimited (no router queue)
        default=64, metadata=flag("in-flight requests per backend before it counts as saturated (0: no limit)")
    )
    max_queued: int = field(  # beyond this, 429 with Retry-After
        default=256,
        metadata=flag(
            "requests that may wait at the router when all backends are saturated; beyond, 429 with Retry-After"
        ),
    )
    queue_timeout: float = field(default=60.0, metadata=flag(None, metavar="S"))

    def api_keys(self) -> tuple[str, ...]:
        """The keys clients may send (--api-key's and --api-key-file's); empty: none needed. Reads the file."""
        return resolve_api_keys(self.api_key, self.api_key_file)

    def backend_ssl_context(self) -> ssl.SSLContext:
        """How https:// backends are verified: against --backend-ca-certs, else the system's CAs."""
        return ssl.create_default_context(cafile=self.backend_ca_certs or None)


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
