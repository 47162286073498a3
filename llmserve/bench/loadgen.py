"""Load generation: the SSE parser, the streaming client and the load modes.

The client speaks every generating API llmserve serves (`endpoint`): OpenAI's chat and text completions
(`choices` deltas, `[DONE]`), OpenAI's Responses API (response.output_text.delta ... response.completed)
and Anthropic's Messages API (content_block_delta ... message_stop), all streamed, and embeddings (one
JSON answer: its TTFT is its latency, it has no output tokens).

One request is one `RequestRecord`: when it was sent, when the first non-empty content arrived, the
gap before every later content chunk, when the stream finished, and the token counts the server's
usage chunk reported. `metrics.py` turns a list of records into the figures.

Load modes (each `LoadPhase` is one of them):
  concurrency  closed loop: C workers, each sends its next request when the previous one finishes;
  rate         open loop: arrivals with gamma-distributed gaps (burstiness 1 = Poisson), or all at
               once when the rate is inf; optionally capped by max_concurrency;
  users        like locust: N users, each sends a request, waits a think time, and repeats.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Sequence

import httpx

# ---------------------------------------------------------------------------------------------
# Server-sent events


@dataclass
class SSEEvent:
    data: str
    event: str | None = None

    @property
    def done(self) -> bool:
        """The OpenAI stream's end marker, `data: [DONE]`."""
        return self.data.strip() == "[DONE]"

    def json(self):
        return json.loads(self.data)


class SSEParser:
    """Incremental parser for a `text/event-stream` body, fed raw bytes as they arrive.

    Reads may split a line anywhere, even inside a multi-byte UTF-8 character: bytes are buffered
    and only whole lines are decoded (a newline byte never occurs inside a UTF-8 sequence). Lines
    end with LF, CRLF or CR; lines starting with ':' are comments (keep-alive pings) and are counted
    in `comments`; a blank line ends an event; several `data:` lines join with a newline.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []
        self._event: str | None = None
        self.comments = 0

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self._buf += chunk
        events: list[SSEEvent] = []
        while True:
            cut = _line_end(self._buf)
            if cut is None:
                return events
            end, nxt = cut
            line = self._buf[:end].decode("utf-8", errors="replace")
            self._buf = self._buf[nxt:]
            ev = self._line(line)
            if ev is not None:
                events.append(ev)

    def close(self) -> list[SSEEvent]:
        """End of body: the last line and event count even without their terminators (lenient)."""
        events = []
        if self._buf:
            ev = self._line(self._buf.decode("utf-8", errors="replace").rstrip("\r"))
            self._buf = b""
            if ev is not None:
                events.append(ev)
        ev = self._line("")
        if ev is not None:
            events.append(ev)
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if line == "":
            if not self._data:
                self._event = None
                return None
            ev = SSEEvent("\n".join(self._data), self._event)
            self._data, self._event = [], None
            return ev
        if line.startswith(":"):
            self.comments += 1
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None  # id: and retry: do not matter here


def iter_sse(chunks: Iterable[bytes]) -> Iterator[SSEEvent]:
    """The events of a `text/event-stream` body given as byte chunks (e.g. httpx's `iter_bytes()`),
    each as soon as it is complete."""
    parser = SSEParser()
    for chunk in chunks:
        yield from parser.feed(chunk)
    yield from parser.close()


async def aiter_sse(chunks: AsyncIterable[bytes]) -> AsyncIterator[SSEEvent]:
    """`iter_sse` for an async byte stream (e.g. httpx's `aiter_bytes()`)."""
    parser = SSEParser()
    async for chunk in chunks:
        for ev in parser.feed(chunk):
            yield ev
    for ev in parser.close():
        yield ev


def _line_end(buf: bytes) -> tuple[int, int] | None:
    """(end of the first line, start of the next) or None while the first line is incomplete."""
    lf, cr = buf.find(b"\n"), buf.find(b"\r")
    if cr == -1 or (lf != -1 and lf < cr):
        return None if lf == -1 else (lf, lf + 1)
    if cr == len(buf) - 1:
        return None  # a CR at the end may be the first half of CRLF: wait for the next byte
    return (cr, cr + 2) if buf[cr + 1 : cr + 2] == b"\n" else (cr, cr + 1)


# ---------------------------------------------------------------------------------------------
# Requests and their records


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int  # prompt tokens as the bench's tokenizer counts the text (chat adds a template)
    output_len: int  # max_tokens asked for
    messages: list[dict] | None = None  # for chat: the whole conversation, else [user: prompt]


@dataclass
class RequestRecord:
    index: int
    prompt_len: int
    max_tokens: int
    timeout: float = 0.0
    start: float = 0.0  # perf_counter() when the request was sent
    end: float = 0.0  # perf_counter() when the response finished or failed
    ttft: float | None = None  # seconds to the first chunk with non-empty content
    itl: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    chunks: int = 0  # content chunks received
    last_chunk: float = 0.0  # perf_counter() of the latest content chunk
    text: str = ""
    output_tokens: int | None = None
    output_tokens_source: str = ""  # "usage" (server's usage chunk) or "tokenizer" (re-counted)
    prompt_tokens: int | None = None  # from the usage chunk
    finish_reason: str | None = None
    success: bool = False
    error: str | None = None  # kind: timeout, connect_error, http_429, incomplete_stream, ...
    error_detail: str = ""

    @property
    def e2e(self) -> float | None:
        return self.end - self.start if self.success else None


def auto_timeout(req: BenchRequest, per_token: float = 0.5, base: float = 60.0) -> float:
    """A request's deadline grows with its size: base + per_token x max_tokens + 2 ms x prompt tokens.

    A fixed 30 s timeout kills long answers under load; this one gives a 1,000-token answer
    ~9 minutes while still catching a server that hangs on a short one.
    """
    return base + per_token * req.output_len + 0.002 * req.prompt_len


ENDPOINTS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "embeddings": "/v1/embeddings",
}


class OpenAIClient:
    """Streams answers from an OpenAI-compatible (or Anthropic-compatible) server and times every content
    chunk; `endpoint` is a key of ENDPOINTS."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        endpoint: str = "chat",
        temperature: float | None = 0.0,
        ignore_eos: bool = False,
        extra_body: dict | None = None,
        timeout: float | None = None,
        timeout_per_token: float = 0.5,
    ) -> None:
        self.root = normalize_base_url(base_url)
        self.model = model
        self.endpoint = endpoint
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.extra_body = extra_body or {}
        self.fixed_timeout = timeout
        self.timeout_per_token = timeout_per_token
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if endpoint == "messages":  # Anthropic's clients send the key as x-api-key
            headers.update({"anthropic-version": "2023-06-01", **({"x-api-key": api_key} if api_key else {})})
        # No client-side connection cap: a pool limit would queue requests here and inflate TTFT.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(base_url=self.root, headers=headers, limits=limits, timeout=httpx.Timeout(30.0))

    async def aclose(self) -> None:
        await self.http.aclose()

    async def resolve_model(self) -> str:
        if not self.model:
            r = await self.http.get("/v1/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        return self.model

    def timeout_for(self, req: BenchRequest) -> float:
        return self.fixed_timeout or auto_timeout(req, self.timeout_per_token)

    def body(self, req: BenchRequest) -> tuple[str, dict]:
        messages = req.messages or [{"role": "user", "content": req.prompt}]
        body: dict = {"model": self.model}
        if self.endpoint == "embeddings":
            return ENDPOINTS["embeddings"], {**body, "input": req.prompt, **self.extra_body}
        body["stream"] = True
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint == "chat":
            body.update(messages=messages, max_tokens=req.output_len, stream_options={"include_usage": True})
        elif self.endpoint == "completions":
            body.update(prompt=req.prompt, max_tokens=req.output_len, stream_options={"include_usage": True})
        elif self.endpoint == "responses":
            body.update(input=messages, max_output_tokens=req.output_len)
        elif self.endpoint == "messages":
            system = "\n".join(m["content"] for m in messages if m.get("role") == "system")
            body.update(
                messages=[m for m in messages if m.get("role") != "system"],
                max_tokens=req.output_len,
                **({"system": system} if system else {}),
            )
        else:
            raise ValueError(f"unknown endpoint {self.endpoint!r}")
        body.update(self.extra_body)
        return ENDPOINTS[self.endpoint], body

    async def send(
        self, req: BenchRequest, index: int = 0, on_chunk: Callable[[], None] | None = None
    ) -> RequestRecord:
        """Send one streaming request; never raises for server or network failures."""
        rec = RequestRecord(
            index=index, prompt_len=req.prompt_len, max_tokens=req.output_len, timeout=self.timeout_for(req)
        )
        path, body = self.body(req)
        rec.start = time.perf_counter()
        try:
            await asyncio.wait_for(self._stream(path, body, rec, on_chunk), rec.timeout)
        except asyncio.TimeoutError:
            _fail(rec, "timeout", f"no complete answer within {rec.timeout:.1f} s")
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            _fail(rec, "connect_error", repr(e))
        except httpx.TimeoutException as e:
            _fail(rec, "timeout", repr(e))
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            _fail(rec, "incomplete_stream", repr(e))
        except httpx.HTTPError as e:
            _fail(rec, "http_error", repr(e))
        except Exception as e:  # a bug in the bench or a malformed answer: count it, keep going
            _fail(rec, "client_error", repr(e))
        rec.end = time.perf_counter()
        return rec

    async def _stream(self, path: str, body: dict, rec: RequestRecord, on_chunk: Callable[[], None] | None) -> None:
        if self.endpoint == "embeddings":
            return await self._embed(path, body, rec, on_chunk)
        async with self.http.stream("POST", path, json=body, timeout=httpx.Timeout(rec.timeout)) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode("utf-8", errors="replace")[:500]
                return _fail(rec, f"http_{resp.status_code}", detail)
            if "text/event-stream" not in resp.headers.get("content-type", "text/event-stream"):
                data = json.loads(await resp.aread())  # a server that ignored stream=true
                self._on_data(data, rec, time.perf_counter(), on_chunk)
                return self._finish(rec, done=True)
            parser, done = SSEParser(), False
            async for raw in resp.aiter_bytes():
                now = time.perf_counter()
                for ev in parser.feed(raw):
                    done = self._on_event(ev, rec, now, on_chunk) or done
                if rec.error:
                    return
            for ev in parser.close():
                done = self._on_event(ev, rec, time.perf_counter(), on_chunk) or done
            self._finish(rec, done)

    async def _embed(self, path: str, body: dict, rec: RequestRecord, on_chunk: Callable[[], None] | None) -> None:
        """One embeddings request: the whole answer is its first (and only) chunk."""
        resp = await self.http.post(path, json=body, timeout=httpx.Timeout(rec.timeout))
        if resp.status_code != 200:
            return _fail(rec, f"http_{resp.status_code}", resp.text[:500])
        data = resp.json()
        if not data.get("data"):
            return _fail(rec, "empty_response", "no embeddings in the answer")
        rec.ttft, rec.chunks, rec.finish_reason = time.perf_counter() - rec.start, 1, "embedding"
        rec.output_tokens, rec.output_tokens_source = 0, "usage"
        if (data.get("usage") or {}).get("prompt_tokens") is not None:
            rec.prompt_tokens = int(data["usage"]["prompt_tokens"])
        if on_chunk:
            on_chunk()
        rec.success = True

    def _on_event(self, ev: SSEEvent, rec: RequestRecord, now: float, on_chunk: Callable[[], None] | None) -> bool:
        """Handle one SSE event; True when it ends the stream (`[DONE]`, response.completed, message_stop)."""
        if ev.done:
            return True
        if rec.error:
            return False
        try:
            data = json.loads(ev.data)
        except json.JSONDecodeError:
            _fail(rec, "bad_response", ev.data[:200])
            return False
        if ev.event == "error" or "error" in data or data.get("type") == "response.failed":
            _fail(rec, "server_error", json.dumps(data.get("error", data))[:500])
            return False
        if self.endpoint in ("responses", "messages"):
            return self._on_typed_event(data, rec, now, on_chunk)
        self._on_data(data, rec, now, on_chunk)
        return False

    def _content(self, text: str, rec: RequestRecord, now: float, on_chunk: Callable[[], None] | None) -> None:
        if not text:
            return
        if rec.ttft is None:
            rec.ttft = now - rec.start
        else:
            rec.itl.append(now - rec.last_chunk)
        rec.last_chunk = now
        rec.chunks += 1
        rec.text += text
        if on_chunk:
            on_chunk()

    def _on_data(self, data: dict, rec: RequestRecord, now: float, on_chunk: Callable[[], None] | None) -> None:
        for choice in data.get("choices") or []:
            if self.endpoint == "chat":
                part = choice.get("delta") or choice.get("message") or {}
                text = (part.get("content") or "") + (part.get("reasoning_content") or "")
            else:
                text = choice.get("text") or ""
            self._content(text, rec, now, on_chunk)
            rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
        usage = data.get("usage")
        if usage:
            if usage.get("completion_tokens") is not None:
                rec.output_tokens = int(usage["completion_tokens"])
                rec.output_tokens_source = "usage"
            if usage.get("prompt_tokens") is not None:
                rec.prompt_tokens = int(usage["prompt_tokens"])

    def _on_typed_event(self, data: dict, rec: RequestRecord, now: float, on_chunk: Callable[[], None] | None) -> bool:
        """The Responses and Messages APIs' events: text deltas (reasoning and tool-call arguments count as
        content), usage at the end; True at the terminal event."""
        kind = data.get("type", "")
        if kind in (
            "response.output_text.delta",
            "response.reasoning_text.delta",
            "response.function_call_arguments.delta",
        ):
            self._content(data.get("delta") or "", rec, now, on_chunk)
        elif kind == "content_block_delta":
            d = data.get("delta") or {}
            self._content(d.get("text") or d.get("thinking") or d.get("partial_json") or "", rec, now, on_chunk)
        elif kind in ("response.completed", "response.incomplete"):
            resp = data.get("response") or {}
            usage = resp.get("usage") or {}
            self._usage(rec, usage.get("input_tokens"), usage.get("output_tokens"))
            rec.finish_reason = resp.get("status")
            return True
        elif kind in ("message_start", "message_delta"):
            usage = (data.get("message") or {}).get("usage") if kind == "message_start" else data.get("usage")
            usage = usage or {}
            prompt = usage.get("input_tokens")
            if prompt is not None:
                prompt += usage.get("cache_read_input_tokens") or 0
            self._usage(rec, prompt, usage.get("output_tokens") if kind == "message_delta" else None)
            rec.finish_reason = (data.get("delta") or {}).get("stop_reason") or rec.finish_reason
        elif kind == "message_stop":
            return True
        return False

    @staticmethod
    def _usage(rec: RequestRecord, prompt: int | None, output: int | None) -> None:
        if prompt is not None:
            rec.prompt_tokens = int(prompt)
        if output is not None:
            rec.output_tokens, rec.output_tokens_source = int(output), "usage"

    @staticmethod
    def _finish(rec: RequestRecord, done: bool) -> None:
        if rec.error:
            return
        if not done:
            _fail(
                rec,
                "incomplete_stream",
                "the stream ended without its final event ([DONE], response.completed, message_stop)",
            )
        elif rec.ttft is None:
            _fail(rec, "empty_response", "no content in the answer")
        else:
            rec.success = True


def _fail(rec: RequestRecord, kind: str, detail: str) -> None:
    if not rec.error:
        rec.error, rec.error_detail, rec.success = kind, detail, False


def normalize_base_url(url: str) -> str:
    """`http://h:p`, `http://h:p/` and `http://h:p/v1` all name the same server root."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


# ---------------------------------------------------------------------------------------------
# Load modes


@dataclass
class LoadPhase:
    mode: str  # "concurrency" | "rate" | "users"
    level: float  # concurrency, requests per second (inf = burst) or users
    num_requests: int | None = None  # stop after this many requests ...
    duration: float | None = None  # ... or after this many seconds (in-flight requests finish)
    burstiness: float = 1.0  # rate mode: gamma shape; 1 = Poisson, < 1 burstier, > 1 steadier
    max_concurrency: int | None = None  # rate mode: cap on requests in flight
    think_time: tuple[float, float] = (1.0, 3.0)  # users mode: seconds, uniform in [lo, hi]

    @property
    def name(self) -> str:
        level = "inf" if math.isinf(self.level) else f"{self.level:g}"
        return {"concurrency": f"concurrency={level}", "rate": f"rate={level}/s", "users": f"users={level}"}[self.mode]


@dataclass
class PhaseRun:
    phase: LoadPhase
    records: list[RequestRecord]
    start: float
    end: float

    @property
    def wall_time(self) -> float:
        return self.end - self.start


class _Budget:
    """Hands out request indices until the count or the deadline is reached."""

    def __init__(self, num_requests: int | None, duration: float | None) -> None:
        self.left = num_requests if num_requests is not None else math.inf
        self.deadline = time.perf_counter() + duration if duration else math.inf
        self.next = 0

    def take(self) -> int | None:
        if self.left <= 0 or time.perf_counter() >= self.deadline:
            return None
        self.left -= 1
        self.next += 1
        return self.next - 1


async def run_phase(
    client: OpenAIClient,
    phase: LoadPhase,
    requests: Sequence[BenchRequest],
    seed: int = 0,
    on_chunk: Callable[[], None] | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> PhaseRun:
    """Run one phase; `requests` is used in order and cycled if the phase needs more."""
    if not requests:
        raise ValueError("no requests to send")
    records: list[RequestRecord] = []

    async def one(i: int) -> None:
        rec = await client.send(requests[i % len(requests)], i, on_chunk)
        records.append(rec)
        if on_done:
            on_done(rec)

    start = time.perf_counter()
    budget = _Budget(phase.num_requests, phase.duration)
    if phase.mode == "concurrency":

        async def worker() -> None:
            while (i := budget.take()) is not None:
                await one(i)

        await asyncio.gather(*(worker() for _ in range(int(phase.level))))
    elif phase.mode == "users":
        rng = random.Random(seed)
        lo, hi = phase.think_time

        async def user() -> None:
            await asyncio.sleep(rng.uniform(0, hi))  # users arrive spread over one think time
            while (i := budget.take()) is not None:
                await one(i)
                await asyncio.sleep(rng.uniform(lo, hi))

        await asyncio.gather(*(user() for _ in range(int(phase.level))))
    elif phase.mode == "rate":
        gaps = _arrival_gaps(phase.level, phase.burstiness, seed)
        cap = asyncio.Semaphore(phase.max_concurrency) if phase.max_concurrency else None

        async def capped(i: int) -> None:
            if cap is None:
                return await one(i)
            async with cap:
                await one(i)

        tasks, due = [], time.perf_counter()
        while (i := budget.take()) is not None:
            tasks.append(asyncio.create_task(capped(i)))
            due += next(gaps)  # absolute schedule: sleep overshoot does not accumulate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
        await asyncio.gather(*tasks)
    else:
        raise ValueError(f"unknown load mode {phase.mode!r}")
    records.sort(key=lambda r: r.index)
    return PhaseRun(phase, records, start, time.perf_counter())


def _arrival_gaps(rate: float, burstiness: float, seed: int):
    """Seconds between arrivals: gamma(shape=burstiness, mean=1/rate), as `vllm bench serve`."""
    rng = random.Random(seed)
    while True:
        yield 0.0 if math.isinf(rate) else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
