"""The one serving loop, for every generating API (chat and text completions, Responses, Messages): one
HTTP request's engine requests (n choices, or several prompts) run on the engine and merged into one
stream, with keep-alive pings, the request timeout, abort when the client goes away, usage counts,
metrics and the request log line. The answer is a JSON body or SSE events; what they look like is the
rendering's (rendering.Rendering; each API's in its module under api/).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmserve.engine.async_engine import AsyncEngine, EngineDeadError
from llmserve.engine.request import RequestOutput, SamplingParams
from llmserve.engine.scheduler import QueueFullError
from llmserve.server import protocol as P
from llmserve.server.errors import APIError, from_value_error
from llmserve.server.state import ServerSettings, ServerState

log = logging.getLogger("llmserve.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# a run: (choice index, prompt index, prompt token ids, SamplingParams), one engine request each
Run = tuple[int, int, list[int], SamplingParams]


class Generation:
    """One HTTP request's engine requests, merged into one stream; `rendering` is a rendering.Rendering
    (chat, completions, responses, messages)."""

    def __init__(
        self,
        state: ServerState,
        eng: AsyncEngine,
        rid: str,
        runs: list[Run],
        priority: int,
        model: str,
        request: Request | None,
        rendering,
    ) -> None:
        self.state, self.eng, self.rid, self.runs = state, eng, rid, runs
        self.priority, self.model, self.request, self.rendering = priority, model, request, rendering
        self.created = int(time.time())
        self.arrival = time.time()
        self.s = state.settings
        self.finals: dict[int, RequestOutput] = {}
        self.latest: dict[int, RequestOutput] = {}  # each choice's newest output (continuous usage stats)
        self.stream_options: P.StreamOptions | None = None
        self.lora = state.lora_name(model)  # the LoRA adapter the request names as its model, or None

    def _deadline(self) -> float | None:
        t = self.s.request_timeout
        return self.arrival + t if t else None

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput] | None]:
        """(choice index, output) as they come, merged over runs; None is a keep-alive tick.
        Raises APIError for failures before or during generation."""
        queue: asyncio.Queue = asyncio.Queue()

        tracer = self.state.tracer

        async def run(index: int, ids: list[int], params: SamplingParams) -> None:
            times: list[float] = []
            rid = f"{self.rid}-{index}"
            if tracer is not None:  # the span is made when the request finishes (state.record_finished)
                tracer.begin(rid, self.request.headers if self.request is not None else None, params, self.model)
            if self.state.request_log is not None:
                self.state.request_log.write(self.eng.tokenizer, self.model, ids, params.max_tokens, self.arrival)
            try:
                async for out in self.eng.generate(ids, params, rid, self.priority, self.lora):
                    if out.outputs[0].delta_token_ids:
                        times.append(time.time())
                        if self.state.metrics is not None:
                            self.state.metrics.tokens_streamed += len(out.outputs[0].delta_token_ids)
                    await queue.put((index, out))
                    if out.finished:
                        self._record(out, ids, times)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                if tracer is not None and not isinstance(e, asyncio.CancelledError):
                    tracer.forget(rid)  # refused or failed outside the engine (a cancelled one ends as an abort)
                await queue.put((index, e))

        # Start every run; the first failure to add (bad input, full queue) fails the whole request.
        tasks = [asyncio.create_task(run(i, ids, p)) for i, _, ids, p in self.runs]
        pending = len(tasks)
        deadline = self._deadline()
        # One getter lives across ticks; asyncio.wait, not wait_for: on Python 3.11 wait_for drops a
        # cancellation (client gone) that lands as an item arrives, and the request would run on.
        getter: asyncio.Task | None = None
        try:
            while pending:
                timeout = self.s.sse_ping_interval or None
                if deadline is not None:
                    left = deadline - time.time()
                    if left <= 0:
                        raise APIError(
                            504,
                            f"the request took longer than the server's request timeout "
                            f"of {self.s.request_timeout:g} s",
                            code="request_timeout",
                        )
                    timeout = left if timeout is None else min(timeout, left)
                getter = getter or asyncio.ensure_future(queue.get())
                if not (await asyncio.wait({getter}, timeout=timeout))[0]:
                    if self.s.sse_ping_interval:
                        yield None
                    continue
                index, item = getter.result()
                getter = None
                if isinstance(item, BaseException):
                    raise to_api_error(item, self.s)
                if item.finished and item.error:
                    raise APIError(500, f"the request failed in the engine: {item.error}", code="engine_error")
                self.latest[index] = item
                if item.finished:
                    pending -= 1
                    self.finals[index] = item
                yield index, item
        finally:
            if getter is not None:
                getter.cancel()
            for t in tasks:
                if not t.done():
                    t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    def _record(self, out: RequestOutput, ids: list[int], times: list[float]) -> None:
        self.state.record_finished(out, len(ids), times, out.metrics.arrival_time if out.metrics else self.arrival)

    def counts(self) -> tuple[int, int, int]:
        """(prompt, completion, cached prompt) tokens so far: each prompt once, however many choices."""
        firsts = {}  # prompt index -> (choice index of its first run, prompt length)
        for i, pi, ids, _ in self.runs:
            firsts.setdefault(pi, (i, len(ids)))
        prompt = sum(n for _, n in firsts.values())
        completion = sum(self.rendering.completion_tokens(o) for o in self.latest.values())
        cached = sum(self.latest[i].num_cached_tokens for i, _ in firsts.values() if i in self.latest)
        return prompt, completion, cached

    def usage(self) -> dict:
        """OpenAI's usage object."""
        prompt, completion, cached = self.counts()
        return P.UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details={"cached_tokens": cached},
        ).model_dump(exclude_none=True)

    async def _collect(self) -> None:
        """Non-streaming: run to the end, aborting if the client goes away."""

        async def consume():
            async for _ in self.events():
                pass

        work = asyncio.create_task(consume())
        gone = asyncio.create_task(_wait_disconnect(self.request))
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                work.result()
                return
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            raise APIError(499, "client disconnected", code="client_closed_request")
        finally:
            gone.cancel()

    async def response(self, stream: bool, stream_options: P.StreamOptions | None = None) -> Response:
        """The answer: SSE when the request streams, else one JSON body once every choice is done."""
        if stream:
            self.stream_options = stream_options
            media_type = getattr(self.rendering, "media_type", "text/event-stream")  # Ollama's: NDJSON
            return StreamingResponse(self.sse(), media_type=media_type, headers=SSE_HEADERS)
        await self._collect()
        return JSONResponse(self.rendering.body(self))

    async def sse(self) -> AsyncIterator[str]:
        """The answer as server-sent events (or NDJSON lines: the rendering's `media_type`), as the rendering
        writes them: its opening events, events for each output, pings while waiting (with
        --sse-ping-interval), its closing events, or its error events."""
        r = self.rendering
        try:
            for event in r.stream_open(self):
                yield event
            async for ev in self.events():
                if ev is None:
                    yield r.ping()
                    continue
                for event in r.stream_output(self, *ev):
                    yield event
            closing = r.stream_close(self)
        except APIError as e:
            closing = r.stream_error(self, e)
        for event in closing:
            yield event


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def to_api_error(e: BaseException, s: ServerSettings) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(
            429,
            f"the server is at capacity: {e}; retry later",
            code="queue_full",
            headers={"Retry-After": str(s.retry_after_seconds)},
        )
    if isinstance(e, ValueError):
        return from_value_error(e)
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_dead")
    log.error("request failed: %r", e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")
