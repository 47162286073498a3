"""Where backends come from: a static list of URLs, a YAML file, or a DNS name.

The `Registry` is the router's one set of backends. Each source owns the backends it added;
`Registry.sync(source, urls)` makes a source's set equal to `urls`: new URLs join (unhealthy until
their first health check passes), vanished ones leave the routing set at once. A request already
running on a backend that leaves keeps its `Backend` object and finishes normally.

YAML file (`llmserve route --config fleet.yaml`):

    policy: cache_aware            # optional; the command line wins when given
    backends:
      - url: http://10.0.0.1:8000
        models: [smollm2]          # optional: otherwise read from the backend's /v1/models
        weight: 2                  # optional: load is divided by weight
        prompt_tokens: [0, 2048]   # optional: for the `length` policy (also min/max_prompt_tokens)
        max_outstanding: 64        # optional: saturation point for back-pressure
      - url: http://10.0.0.2:8000
    dns:                           # optional: backends from a name with several A records
      - name: llmserve-headless.default.svc.cluster.local
        port: 8000
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from .policies import Backend

log = logging.getLogger("llmserve.router")

Resolver = Callable[[str, int], "Awaitable[list[str]] | list[str]"]


def normalize_url(url: str) -> str:
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


class Registry:
    """The set of backends, keyed by URL, with the source that added each."""

    def __init__(self):
        self.backends: dict[str, Backend] = {}
        self._on_added: list[Callable[[Backend], None]] = []
        self._on_removed: list[Callable[[Backend], None]] = []

    def on_added(self, fn: Callable[[Backend], None]) -> None:
        self._on_added.append(fn)

    def on_removed(self, fn: Callable[[Backend], None]) -> None:
        self._on_removed.append(fn)

    def __iter__(self):
        return iter(list(self.backends.values()))

    def __len__(self) -> int:
        return len(self.backends)

    def get(self, url: str) -> Backend | None:
        return self.backends.get(normalize_url(url))

    def add(self, backend: Backend) -> Backend:
        backend.url = normalize_url(backend.url)
        if backend.url in self.backends:
            return self.backends[backend.url]
        self.backends[backend.url] = backend
        log.info("backend added: %s (%s)", backend.url, backend.source)
        for fn in self._on_added:
            fn(backend)
        return backend

    def remove(self, url: str) -> Backend | None:
        backend = self.backends.pop(normalize_url(url), None)
        if backend is not None:
            log.info("backend removed: %s (%s)", backend.url, backend.source)
            backend.healthy = False
            backend.ejected_reason = "removed"
            for fn in self._on_removed:
                fn(backend)
        return backend

    def sync(
        self, source: str, urls: Iterable[str], template: Callable[[str], Backend] | None = None
    ) -> tuple[list[str], list[str]]:
        """Make the backends owned by `source` exactly `urls`. Returns (added, removed) URLs."""
        want = {normalize_url(u) for u in urls}
        have = {u for u, b in self.backends.items() if b.source == source}
        added, removed = sorted(want - have), sorted(have - want)
        for u in removed:
            self.remove(u)
        for u in added:
            b = template(u) if template else Backend(url=u)
            b.url, b.source = u, source
            self.add(b)
        return added, removed


# ----------------------------------------------------------------------------------------------
# YAML
# ----------------------------------------------------------------------------------------------


@dataclass
class DnsSource:
    name: str
    port: int
    scheme: str = "http"

    @classmethod
    def parse(cls, spec: str) -> "DnsSource":
        """`NAME:PORT` or `http://NAME:PORT`."""
        scheme = "http"
        if "://" in spec:
            scheme, spec = spec.split("://", 1)
        name, _, port = spec.rstrip("/").rpartition(":")
        if not name or not port.isdigit():
            raise ValueError(f"--backend-dns wants NAME:PORT, got {spec!r}")
        return cls(name=name, port=int(port), scheme=scheme)


@dataclass
class FleetConfig:
    backends: list[Backend] = field(default_factory=list)
    dns: list[DnsSource] = field(default_factory=list)
    settings: dict = field(default_factory=dict)  # other top-level keys (policy, ...)


def backend_from_dict(d: dict | str, source: str = "yaml") -> Backend:
    if isinstance(d, str):
        return Backend(url=normalize_url(d), source=source)
    if "url" not in d:
        raise ValueError(f"backend entry without url: {d!r}")
    models = d.get("models") or ([d["model"]] if d.get("model") else [])
    lo, hi = d.get("min_prompt_tokens", 0), d.get("max_prompt_tokens")
    if "prompt_tokens" in d:
        lo, hi = d["prompt_tokens"]
    return Backend(
        url=normalize_url(d["url"]),
        models=set(models),
        models_declared=bool(models),
        weight=float(d.get("weight", 1.0)),
        min_prompt_tokens=int(lo or 0),
        max_prompt_tokens=None if hi is None else int(hi),
        max_outstanding=d.get("max_outstanding"),
        source=source,
    )


def load_config(path: str) -> FleetConfig:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if isinstance(data, list):  # a bare list of backends
        data = {"backends": data}
    cfg = FleetConfig()
    for entry in data.pop("backends", []) or []:
        cfg.backends.append(backend_from_dict(entry))
    for entry in data.pop("dns", []) or []:
        if isinstance(entry, str):
            cfg.dns.append(DnsSource.parse(entry))
        else:
            cfg.dns.append(DnsSource(name=entry["name"], port=int(entry["port"]), scheme=entry.get("scheme", "http")))
    cfg.settings = data
    return cfg


# ----------------------------------------------------------------------------------------------
# DNS
# ----------------------------------------------------------------------------------------------


async def system_resolver(name: str, port: int) -> list[str]:
    """All IPv4/IPv6 addresses of `name`, as the system resolver returns them (a Kubernetes
    headless Service answers with one A record per ready pod)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


class DnsDiscovery:
    """Re-resolves a name every `interval` seconds and syncs the registry with its addresses.

    The resolver is injectable (`resolver(name, port) -> list of addresses`, sync or async), so
    tests can point a name at 127.0.0.2, 127.0.0.3, ... without touching /etc/hosts. A failed
    lookup keeps the current set (a DNS blip must not empty the fleet)."""

    def __init__(
        self,
        registry: Registry,
        source: DnsSource,
        interval: float = 10.0,
        resolver: Resolver | None = None,
        template: Callable[[str], Backend] | None = None,
        on_change: Callable[[list[str], list[str]], None] | None = None,
    ):
        self.registry = registry
        self.source = source
        self.interval = interval
        self.resolver = resolver or system_resolver
        self.template = template
        self.on_change = on_change
        self.tag = f"dns:{source.name}:{source.port}"

    def url_for(self, address: str) -> str:
        host = f"[{address}]" if ":" in address else address
        return f"{self.source.scheme}://{host}:{self.source.port}"

    async def refresh(self) -> tuple[list[str], list[str]]:
        try:
            result = self.resolver(self.source.name, self.source.port)
            if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                result = await result
            addresses = list(result)
        except (OSError, asyncio.TimeoutError) as e:
            log.warning(
                "DNS lookup of %s failed (%s); keeping %d backends",
                self.source.name,
                e,
                sum(1 for b in self.registry if b.source == self.tag),
            )
            return [], []
        added, removed = self.registry.sync(self.tag, [self.url_for(a) for a in addresses], self.template)
        if (added or removed) and self.on_change:
            self.on_change(added, removed)
        return added, removed

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval)
