"""AsyncEngine: the engine on its own thread, bridged to asyncio.

The engine loop runs in a dedicated thread so that HTTP work never stalls generation (PyTorch drops
the GIL inside its kernels). Callers on the event loop submit requests and get an async iterator of
outputs; leaving the iterator early (a client disconnect) aborts the request in the engine at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from llmserve.config import EngineConfig
from llmserve.engine.engine import LLMEngine
from llmserve.engine.request import RequestOutput, SamplingParams
from llmserve.engine.scheduler import QueueFullError

log = logging.getLogger("llmserve.async_engine")


class EngineDeadError(RuntimeError):
    """The engine loop failed; the process should be restarted."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    sink: "_Sink"
    lora_request: object = None


@dataclass
class _Abort:
    request_id: str


class _Sink:
    """Delivers outputs from the engine thread to one request's asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._pending_adds = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.dead: BaseException | None = None
        self.last_progress = time.time()
        self.on_dead: Callable[[BaseException], None] | None = None
        # Called on the engine thread with the final output of each request aborted in the engine (a
        # client that went away, a timeout): nobody reads those from the sink, so metrics hook here.
        self.on_aborted: Callable[[RequestOutput], None] | None = None
        self._thread = threading.Thread(target=self._loop, name="llmserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(LLMEngine(config))

    # -- called from the event loop ------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def check_admission(self, runs) -> None:
        """Raise now (before a streaming response starts) what adding these runs would raise.
        `runs` are tuples ending in (prompt_token_ids, params)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead}")
        for *_, ids, params in runs:
            self.engine.validate_prompt(ids, params)
        limit = self.engine.config.max_queued_requests
        if limit is not None and self.engine.scheduler.num_queued_after(self._pending_adds + len(runs)) > limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests)")

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, priority: int = 0, lora_request=None
    ) -> AsyncIterator[RequestOutput]:
        """Yields an output each time the request makes progress; the last one has finished=True.
        Raises ValueError (bad input), QueueFullError (back-pressure) or EngineDeadError.
        `lora_request`: a loaded LoRA adapter's name (None: the base model)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead}")
        self.engine.validate_prompt(prompt_token_ids, params)
        limit = self.engine.config.max_queued_requests
        with self._lock:
            if limit is not None and self.engine.scheduler.num_queued_after(self._pending_adds + 1) > limit:
                raise QueueFullError(f"the waiting queue is full ({limit} requests)")
            if request_id in self._sinks:
                raise ValueError(f"request_id: {request_id!r} is already in the engine")
            self._pending_adds += 1
            sink = _Sink(asyncio.get_running_loop())
            self._sinks[request_id] = sink
        self._commands.put(_Add(request_id, prompt_token_ids, params, priority, time.time(), sink, lora_request))
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout)

    # -- the engine thread ---------------------------------------------------------------------
    def _handle(self, cmd) -> None:
        if isinstance(cmd, _Add):
            with self._lock:
                self._pending_adds -= 1
            if cmd.request_id not in self._sinks:  # aborted before it was added
                return
            try:
                self.engine.add_request(
                    cmd.prompt_token_ids,
                    cmd.params,
                    request_id=cmd.request_id,
                    priority=cmd.priority,
                    arrival_time=cmd.arrival_time,
                    lora_request=cmd.lora_request,
                )
            except (ValueError, QueueFullError) as e:
                self._sinks.pop(cmd.request_id, None)
                cmd.sink.put(e)
        elif isinstance(cmd, _Abort):
            sink = self._sinks.pop(cmd.request_id, None)
            out = self.engine.abort_request(cmd.request_id)
            if out is None:  # already finished, or never added
                return
            if sink is not None:
                sink.put(out)
            if self.on_aborted is not None:
                try:
                    self.on_aborted(out)
                except Exception:  # noqa: BLE001 - accounting must not stop the engine
                    log.exception("on_aborted hook failed")

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=1.0) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd is not None:
                self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.last_progress = time.time()
                self._drain(block=not self.engine.has_unfinished_requests())
                if self._stop.is_set():
                    break
                for out in self.engine.step():
                    sink = self._sinks.get(out.request_id)
                    if sink is not None:
                        if out.finished:
                            del self._sinks[out.request_id]
                        sink.put(out)
        except BaseException as e:  # noqa: BLE001 - the loop must report any failure
            log.exception("engine loop failed")
            self.dead = e
            err = EngineDeadError(f"the engine failed: {e!r}")
            for sink in list(self._sinks.values()):
                sink.put(err)
            self._sinks.clear()
            if self.on_dead is not None:
                self.on_dead(e)
