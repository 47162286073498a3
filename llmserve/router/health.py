"""Backend health: active checks, passive ejection, load from the backends' /metrics.

- Active: every `interval` seconds each backend's `/ready` is fetched. A backend that refuses the
  connection is ejected at once; one that fails `unhealthy_threshold` checks in a row (timeouts,
  5xx, 503 while loading) is ejected too. An ejected backend is admitted again after
  `healthy_threshold` good checks in a row. A good check also refreshes the backend's model list
  from `/v1/models` (unless the config declares its models). A new backend is admitted on its
  first good check.
- Passive: the proxy reports connection errors (`report_failure`); the backend is ejected at once
  and waits for the active checks to come back.
- Load: with `scrape_metrics`, `/metrics` is read on the same interval and
  `num_requests_running`, `num_requests_waiting` and `kv_cache_usage_perc` (llmserve: or vllm:
  prefix) land on the backend for the policies to use.
- KV events: with `kv_events_interval`, each healthy backend's GET /kv_events is read that often (the
  events after the last one read) and `Backend.kv_blocks` follows the blocks its cache holds; a backend
  that answers 404 publishes none (`kv_blocks` None), and cache_aware keeps its guessed tree for it.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable

import httpx

from llmserve.engine.kv_events import HASH_ALGO

from .discovery import Registry
from .metrics import RouterMetrics
from .policies import Backend

log = logging.getLogger("llmserve.router")

_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([^\s]+)")
_LOAD_METRICS = {
    "num_requests_running": "running",
    "num_requests_waiting": "waiting",
    "kv_cache_usage_perc": "kv_usage",
    "gpu_cache_usage_perc": "kv_usage",  # older vLLM name
}


def parse_load_metrics(text: str) -> dict[str, float]:
    """Sum running / waiting / KV usage over label sets from a Prometheus text page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _METRIC_LINE.match(line)
        if not m:
            continue
        name = m.group(1).split(":", 1)[-1]
        key = _LOAD_METRICS.get(name)
        if key is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if key == "kv_usage":
            out[key] = max(out.get(key, 0.0), value)
        else:
            out[key] = out.get(key, 0.0) + value
    return out


class HealthChecker:
    def __init__(
        self,
        registry: Registry,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        interval: float = 5.0,
        timeout: float = 2.0,
        unhealthy_threshold: int = 3,
        healthy_threshold: int = 1,
        scrape_metrics: bool = False,
        headers: dict[str, str] | None = None,
        on_change: Callable[[], None] | None = None,
    ):
        self.registry = registry
        self.client = client
        self.metrics = metrics
        self.interval = interval
        self.timeout = timeout
        self.unhealthy_threshold = unhealthy_threshold
        self.healthy_threshold = healthy_threshold
        self.scrape_metrics = scrape_metrics
        self.headers = headers or {}
        self.on_change = on_change or (lambda: None)
        self._checking: set[str] = set()

    # -- state changes --
    def eject(self, b: Backend, reason: str, kind: str) -> None:
        b.consecutive_successes = 0
        b.ejected_reason = reason
        if b.healthy:
            b.healthy = False
            self.metrics.ejections.labels(b.url, kind).inc()
            self.metrics.healthy.labels(b.url).set(0)
            log.warning("backend %s ejected (%s): %s", b.url, kind, reason)
            self.on_change()

    def admit(self, b: Backend) -> None:
        b.ejected_reason = None
        if not b.healthy:
            b.healthy = True
            self.metrics.healthy.labels(b.url).set(1)
            if b.ever_healthy:
                self.metrics.readmissions.labels(b.url).inc()
                log.info("backend %s re-admitted", b.url)
            else:
                log.info("backend %s admitted", b.url)
            b.ever_healthy = True
            self.on_change()

    def report_failure(self, b: Backend, error: Exception | str) -> None:
        """Passive ejection: the proxy could not reach the backend."""
        b.consecutive_failures += 1
        self.eject(b, f"connection error: {error}", "passive")

    # -- active checks --
    async def check(self, b: Backend) -> bool:
        if b.url in self._checking:  # a slow check still running: do not pile up
            return b.healthy
        self._checking.add(b.url)
        try:
            return await self._check(b)
        finally:
            self._checking.discard(b.url)

    async def _check(self, b: Backend) -> bool:
        was_new = b.ejected_reason == "not checked yet"
        try:
            r = await self.client.get(b.url + "/ready", timeout=self.timeout, headers=self.headers)
            ok = r.status_code == 200
            why = f"/ready answered {r.status_code}"
            if ok and not b.models_declared:
                ok, why = await self._refresh_models(b)
            if ok and self.scrape_metrics:
                await self._scrape(b)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            b.consecutive_failures += 1
            self.eject(b, f"unreachable: {e!r}", "active")
            return False
        except httpx.HTTPError as e:
            ok, why = False, repr(e)
        if ok:
            b.consecutive_failures = 0
            b.consecutive_successes += 1
            if not b.healthy and (
                not b.ever_healthy  # first admission: at once
                or b.consecutive_successes >= self.healthy_threshold
            ):
                self.admit(b)
            return True
        b.consecutive_failures += 1
        b.consecutive_successes = 0
        if was_new or not b.healthy or b.consecutive_failures >= self.unhealthy_threshold:
            self.eject(b, why, "active")
        return b.healthy

    async def _refresh_models(self, b: Backend) -> tuple[bool, str]:
        r = await self.client.get(b.url + "/v1/models", timeout=self.timeout, headers=self.headers)
        if r.status_code != 200:
            return False, f"/v1/models answered {r.status_code}"
        try:
            cards = {m["id"]: m for m in r.json().get("data", [])}
        except (ValueError, KeyError, TypeError, AttributeError):
            return False, "/v1/models: bad JSON"
        # a model that failed to load there (--models-dir: a broken file) is not routed to it
        served = {m for m, c in cards.items() if (c.get("status") or {}).get("value") != "failed"}
        b.models, b.model_cards = served, cards
        return True, ""

    async def _scrape(self, b: Backend) -> None:
        try:
            r = await self.client.get(b.url + "/metrics", timeout=self.timeout, headers=self.headers)
        except httpx.HTTPError:
            return
        if r.status_code != 200:
            return
        load = parse_load_metrics(r.text)
        b.running = load.get("running")
        b.waiting = load.get("waiting")
        b.kv_usage = load.get("kv_usage")
        for kind in ("running", "waiting", "kv_usage"):
            if load.get(kind) is not None:
                self.metrics.backend_load.labels(b.url, kind).set(load[kind])

    async def check_all(self) -> None:
        backends = list(self.registry)
        if backends:
            await asyncio.gather(*(self.check(b) for b in backends))

    async def pull_kv_events(self, b: Backend) -> None:
        for _ in range(2):
            try:
                r = await self.client.get(
                    b.url + "/kv_events", params={"after": b.kv_events_seq}, timeout=self.timeout, headers=self.headers
                )
            except httpx.HTTPError:
                return
            if r.status_code == 404:  # publishes no events
                b.kv_blocks, b.kv_events_seq = None, -1
                return
            if r.status_code != 200:
                return
            try:
                body = r.json()
                if not body["reset"] and body.get("instance") != b.kv_events_instance:
                    b.kv_events_seq = -1  # another process answers now (a restart): read its snapshot
                    continue
                apply_kv_events(b, body)
            except (ValueError, KeyError, TypeError, AttributeError):
                b.kv_blocks, b.kv_events_seq = None, -1
            return

    async def run_kv_events(self, interval: float) -> None:
        while True:
            backends = [b for b in self.registry if b.healthy]
            try:
                await asyncio.gather(*(self.pull_kv_events(b) for b in backends))
            except Exception:  # never let the loop die
                log.exception("KV events round failed")
            await asyncio.sleep(interval)

    async def run(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # never let the loop die
                log.exception("health check round failed")
            await asyncio.sleep(self.interval)


def apply_kv_events(b: Backend, body: dict) -> None:
    """Bring `b.kv_blocks` up to date with a GET /kv_events answer (llmserve/server/api/kv_events.py)."""
    if body.get("hash") != HASH_ALGO:  # names this router cannot compute
        b.kv_blocks, b.kv_events_seq = None, -1
        return
    blocks = set() if body["reset"] or b.kv_blocks is None else b.kv_blocks
    for ev in body["events"]:
        kind = ev["type"]
        if kind == "AllBlocksCleared":
            blocks.clear()
        elif kind == "BlockStored":
            blocks.update(ev["block_hashes"])
        elif kind == "BlockRemoved":
            blocks.difference_update(ev["block_hashes"])
    b.kv_blocks, b.kv_events_seq = blocks, int(body["seq"])
    b.kv_block_size, b.kv_events_instance = int(body["block_size"]), body.get("instance")
