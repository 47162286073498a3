"""`llmserve serve --models-dir DIR`: several models behind one HTTP server, each its own ServerState (its own
engine, KV budget, scheduler and metrics), loaded on first request and unloaded when idle.

    ModelPool     the models of DIR (llmserve/serve_config.py scans it) and their slots; the `State` a route
                  gets is the slot's ServerState of the model its body names (`state_for`), loaded first if
                  need be (requests for a model that is loading wait, bounded by --request-timeout; the others
                  keep serving); at most --models-max resident (the least recently used idle one unloaded
                  first, never one with requests in flight); --model-idle-timeout and Ollama's keep_alive
                  unload idle ones (the engine shut down, gc, malloc_trim: the process's RSS falls)
    InFlight      the middleware that counts each model's requests in flight until their last byte is sent

A model that fails to load (a truncated GGUF, an unknown architecture) is listed as failed with its error and
never stops the others; one that does not fit in the memory available now is refused with a 503 and stays
"not loaded" (it may fit later).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import replace

from llmserve.config import EngineConfig
from llmserve.model.loader.build import DoesNotFit
from llmserve.serve_config import ModelEntry, ServerSettings, scan_models_dir
from llmserve.server.errors import APIError
from llmserve.server.state import ServerState

log = logging.getLogger("llmserve.server")

NOT_LOADED, LOADING, LOADED, UNLOADING, FAILED = "not loaded", "loading", "loaded", "unloading", "failed"
HELD = "llmserve.models_held"  # the scope key of the slots a request holds (InFlight releases them)
LOAD_SECONDS = "llmserve.load_seconds"  # the scope key of the seconds a request waited for its model's load
FOREVER = float("inf")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value) -> float | None:
    """Ollama's keep_alive: seconds (a number), a Go duration ("5m", "1h30m", "300ms"), negative: forever
    (FOREVER), None: the server's default. A ValueError naming the field otherwise."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise ValueError(f"keep_alive: not a duration: {value!r}")
    if isinstance(value, (int, float)):
        return FOREVER if value < 0 else float(value)
    s = str(value).strip()
    try:
        return parse_keep_alive(float(s))
    except ValueError:
        pass
    sign = -1 if s.startswith("-") else 1
    body = s.lstrip("+-")
    parts = _DURATION.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body:
        raise ValueError(f'keep_alive: not a duration: {value!r} (seconds, or such as "5m", "1h", "30s", -1)')
    seconds = sum(float(n) * _UNIT[u] for n, u in parts)
    return FOREVER if sign < 0 else seconds


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class Slot:
    """One model of DIR: its entry, state, error, ServerState (kept across loads: its metrics count on) and
    requests in flight."""

    def __init__(self, entry: ModelEntry, state: ServerState) -> None:
        self.entry, self.state = entry, state
        self.name = entry.name
        self.status = NOT_LOADED
        self.error: str | None = None
        self.in_flight = 0
        self.last_used = 0.0
        self.loaded_at = 0.0
        self.keep_alive: float | None = None  # the last request's keep_alive (None: --model-idle-timeout)
        self.loading: asyncio.Future | None = None
        self.footprint = 0  # bytes the process's RSS grew by at the model's last load
        state.slot = self

    def expires_at(self, default: float) -> float:
        """When an idle model is unloaded (time.time()); FOREVER: never."""
        ttl = default if self.keep_alive is None else self.keep_alive
        if ttl == FOREVER or (self.keep_alive is None and not ttl):
            return FOREVER
        return self.last_used + ttl

    def card(self) -> dict:
        eng = self.state.engine
        return {
            "id": self.name,
            "root": self.entry.path,
            "max_model_len": eng.engine.max_model_len if eng is not None and self.status == LOADED else None,
            "status": {"value": self.status, **({"error": self.error} if self.error else {})},
        }


class ModelPool:
    """The models of --models-dir and their slots (see the module's docstring)."""

    def __init__(self, front: ServerState) -> None:
        settings = front.settings
        self.front, self.settings = front, settings
        self.max_resident = settings.models.models_max
        self.idle_timeout = settings.models.model_idle_timeout
        self.folder = settings.models.models_dir
        self.slots: dict[str, Slot] = {}
        for entry in scan_models_dir(self.folder, EngineConfig.field_names()):
            self.slots[entry.name] = Slot(entry, ServerState(self._settings_of(entry)))
        if not self.slots:
            log.warning("--models-dir %s holds no model (GGUF files, folders with a config.json)", self.folder)
        self._adapters = {
            a.split("=")[0]: s for s in self.slots.values() for a in s.entry.engine.get("lora_modules") or ()
        }
        front.model_names = list(self.slots)
        self._reaper: asyncio.Task | None = None

    def _settings_of(self, entry: ModelEntry) -> ServerSettings:
        base = self.settings
        engine = replace(base.engine, model=entry.path, served_model_name=[entry.name], **entry.engine)
        return replace(base, engine=engine, batch_dir=None, **entry.server)

    # -- start, stop ------------------------------------------------------------------------------
    def start(self) -> None:
        """The check of every GGUF file's header (a broken one is listed as failed at once) and the idle
        reaper; call from the event loop."""
        loop = asyncio.get_running_loop()
        for slot in self.slots.values():
            if slot.entry.path.endswith(".gguf"):
                loop.run_in_executor(None, self._probe, slot)
        self._reaper = loop.create_task(self._reap())

    def _probe(self, slot: Slot) -> None:
        from llmserve.model.loader.gguf import open_gguf

        try:
            reader = open_gguf(slot.entry.path)
            del reader
        except Exception as e:  # noqa: BLE001 - the file is broken: listed as failed, the others serve on
            self._failed(slot, e)

    def _failed(self, slot: Slot, e: BaseException) -> None:
        slot.status, slot.error = FAILED, f"{type(e).__name__}: {e}"
        log.error("model %s (%s) failed: %s", slot.name, slot.entry.path, slot.error)

    def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for slot in self.slots.values():
            slot.state.draining = True
            if slot.state.engine is not None:
                slot.state.engine.shutdown()

    # -- the State of a request -------------------------------------------------------------------
    def resolve(self, name: str | None) -> Slot:
        """The slot a request's `model` names (Ollama's `:latest` tag optional; a LoRA adapter's name: its base
        model's); None: the most recently used loaded model, else the first; unknown: a 404."""
        if not name:
            loaded = [s for s in self.slots.values() if s.status == LOADED]
            if loaded:
                return max(loaded, key=lambda s: s.last_used)
            if self.slots:
                return next(iter(self.slots.values()))
        else:
            for n in (name, name.removesuffix(":latest")):
                if n in self.slots:
                    return self.slots[n]
                if n in self._adapters:
                    return self._adapters[n]
            for s in self.slots.values():
                if s.state.lora_name(name):
                    return s
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {', '.join(self.slots) or 'no model'} "
            f"(from --models-dir {self.folder})",
            param="model",
            code="model_not_found",
        )

    async def state_for(self, request) -> ServerState:
        """The ServerState for `request`: the front one for reads (GET: listings, metrics, the page); for a
        POST, that of the model its JSON body names (`model`, or Ollama's older `name`), loaded and held in
        flight until its response is sent."""
        if request.method != "POST":
            return self.front
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            body = None
        name = None
        if isinstance(body, dict):
            name = body.get("model") or body.get("name")
        if name is not None and not isinstance(name, str):
            return self.front  # the body's validation answers
        if request.url.path.startswith("/v1/files") or request.url.path.startswith("/v1/batches"):
            return self.front
        slot = self.resolve(name)
        slot.keep_alive = None  # each request sets how long its model stays once idle (Ollama's keep_alive or none)
        held = request.scope.get(HELD)
        if held is not None:  # (InFlight releases it)
            slot.in_flight += 1
            held.append(slot)
        if slot.status != LOADED:
            t0 = time.perf_counter()
            await self.ensure_loaded(slot)
            request.scope[LOAD_SECONDS] = time.perf_counter() - t0
        else:
            await self.ensure_loaded(slot)
        return slot.state

    def release(self, slot: Slot) -> None:
        slot.in_flight -= 1
        slot.last_used = time.time()

    # -- loading and unloading --------------------------------------------------------------------
    async def ensure_loaded(self, slot: Slot) -> None:
        if slot.status == LOADED and slot.state.engine is not None:
            slot.last_used = time.time()
            return
        if slot.status == FAILED:
            raise APIError(503, f"the model {slot.name!r} failed to load: {slot.error}", code="model_load_failed")
        if slot.loading is None:
            slot.loading = asyncio.get_running_loop().create_task(self._load(slot))
        timeout = self.settings.request_timeout
        try:
            await asyncio.wait_for(asyncio.shield(slot.loading), timeout)
        except asyncio.TimeoutError:
            raise APIError(
                503,
                f"the model {slot.name!r} is still loading after {timeout:g} s (--request-timeout); retry",
                code="model_loading",
                headers={"Retry-After": "5"},
            ) from None

    async def _load(self, slot: Slot) -> None:
        try:
            while slot.status == UNLOADING:
                await asyncio.sleep(0.02)
            await self._make_room(slot)
            slot.status, slot.error = LOADING, None
            slot.state.load_error = None
            t0 = time.perf_counter()
            log.info("loading model %s from %s", slot.name, slot.entry.path)
            while True:
                rss = _rss()
                await asyncio.to_thread(slot.state.load)
                err = slot.state.load_error
                if err is None:
                    slot.status, slot.loaded_at, slot.last_used = LOADED, time.time(), time.time()
                    slot.footprint = max(0, _rss() - rss)
                    log.info("model %s loaded in %.2f s", slot.name, time.perf_counter() - t0)
                    return
                too_big = isinstance(err, DoesNotFit)
                idle = [s for s in self.slots.values() if s.status == LOADED and s.in_flight == 0]
                # the memory check refused it: idle models make room first (the least recently used), when
                # what they took at their load covers the shortfall
                if not (too_big and idle and sum(s.footprint for s in idle) >= err.needed - err.available):
                    break
                await self.unload(min(idle, key=lambda s: s.last_used), f"memory for {slot.name}")
                slot.state.load_error = None
            if too_big:
                slot.status, slot.error = NOT_LOADED, str(err)
                raise APIError(503, f"the model {slot.name!r} cannot load now: {err}", code="insufficient_memory")
            self._failed(slot, err)
            raise APIError(503, f"the model {slot.name!r} failed to load: {slot.error}", code="model_load_failed")
        finally:
            slot.loading = None

    async def _make_room(self, slot: Slot) -> None:
        """Unload least recently used idle models until `slot` fits under --models-max; wait (the caller's
        timeout bounds it) while every resident one has requests in flight."""
        while True:
            resident = [s for s in self.slots.values() if s is not slot and s.status in (LOADED, LOADING, UNLOADING)]
            if len(resident) < self.max_resident:
                return
            idle = [s for s in resident if s.status == LOADED and s.in_flight == 0]
            if idle:
                await self.unload(min(idle, key=lambda s: s.last_used), "least recently used")
            else:
                await asyncio.sleep(0.05)

    async def unload(self, slot: Slot, why: str) -> None:
        st = slot.state
        if st.engine is None:
            return
        slot.status = UNLOADING
        log.info("unloading model %s (%s)", slot.name, why)
        try:
            await asyncio.to_thread(st.unload)
        finally:
            slot.status, slot.keep_alive = NOT_LOADED, None

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = time.time()
            for slot in list(self.slots.values()):
                if slot.status == LOADED and slot.in_flight == 0 and slot.expires_at(self.idle_timeout) <= now:
                    try:
                        await self.unload(slot, "idle")
                    except Exception:  # noqa: BLE001 - the reaper goes on
                        log.exception("could not unload %s", slot.name)

    # -- what the listings show -------------------------------------------------------------------
    def loaded(self) -> list[Slot]:
        return [s for s in self.slots.values() if s.status == LOADED and s.state.engine is not None]

    def render_metrics(self) -> bytes:
        from llmserve.server.metrics import render_merged

        return render_merged([s.state.metrics for s in self.slots.values() if s.state.metrics is not None])


class InFlight:
    """ASGI middleware: the slots a request's `State` held (ModelPool.state_for) are released once its
    response is sent (a stream's last byte included), so that no model is unloaded under a request."""

    def __init__(self, app, pool: ModelPool) -> None:
        self.app, self.pool = app, pool

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held = scope[HELD] = []
        try:
            await self.app(scope, receive, send)
        finally:
            for slot in held:
                self.pool.release(slot)
