"""The bench's streaming client: one request out, one `RequestRecord` back.

The client speaks every generating API llmserve serves (`endpoint`): OpenAI's chat and text completions
(`choices` deltas, `[DONE]`), OpenAI's Responses API (response.output_text.delta ... response.completed)
and Anthropic's Messages API (content_block_delta ... message_stop), all streamed, and embeddings (one
JSON answer: its TTFT is its latency, it has no output tokens).

One request is one `RequestRecord`: when it was sent, when the first non-empty content arrived, the
gap before every later content chunk, when the stream finished, and the token counts the server's
usage chunk reported. `metrics.py` turns a list of records into the figures.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

from .sse import SSEEvent, SSEParser


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int  # prompt tokens as the bench's tokenizer counts the text (chat adds a template)
    output_len: int  # max_tokens asked for
    messages: list[dict] | None = None  # for chat: the whole conversation, else [user: prompt]
    arrival: float | None = None  # replay: seconds after the phase's start (a request log's timing)


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
        # several models ("a,b"): requests take them in turn (--models-dir servers, routers)
        self.models = [m.strip() for m in (model or "").split(",") if m.strip()]
        self.model = self.models[0] if self.models else None
        self.endpoint = endpoint
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.extra_body = extra_body or {}
        self.fixed_timeout = timeout
        self.timeout_per_token = timeout_per_token
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if endpoint == "messages":  # Anthropic's clients send the key as x-api-key
            headers.update({"anthropic-version": "2023-06-01", **({"x-api-key": api_key} if api_key else {})})
        # No client-side connection cap: a pool limit would queue requests here and inflate TTFT. An idle connection is
        # dropped after 2 s: llama-server (cpp-httplib) closes one after 5 s, httpx's own default, and a request sent
        # as the server closes it fails ("Server disconnected without sending a response").
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0)
        self.http = httpx.AsyncClient(base_url=self.root, headers=headers, limits=limits, timeout=httpx.Timeout(30.0))

    async def aclose(self) -> None:
        await self.http.aclose()

    async def resolve_model(self) -> str:
        if not self.model:
            r = await self.http.get("/v1/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
            self.models = [self.model]
        return self.model

    def timeout_for(self, req: BenchRequest) -> float:
        return self.fixed_timeout or auto_timeout(req, self.timeout_per_token)

    def body(self, req: BenchRequest, index: int = 0) -> tuple[str, dict]:
        messages = req.messages or [{"role": "user", "content": req.prompt}]
        body: dict = {"model": self.models[index % len(self.models)] if self.models else self.model}
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
        path, body = self.body(req, index)
        rec.start = time.perf_counter()
        try:
            try:
                await asyncio.wait_for(self._stream(path, body, rec, on_chunk), rec.timeout)
            except httpx.RemoteProtocolError as e:
                if not _stale_connection(e, rec):
                    raise
                # a kept-alive connection the server had closed (llama-server's, after each streamed answer): the
                # request never reached it; sent again on a new connection, within the same deadline
                left = rec.timeout - (time.perf_counter() - rec.start)
                await asyncio.wait_for(self._stream(path, body, rec, on_chunk), max(left, 0.001))
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


def _stale_connection(e: httpx.RemoteProtocolError, rec: RequestRecord) -> bool:
    """The server closed a kept-alive connection before this request's first byte of answer: nothing was sent back
    (no status line), so nothing ran; safe to send again once."""
    return "without sending a response" in str(e) and rec.chunks == 0 and rec.ttft is None and rec.error is None


def normalize_base_url(url: str) -> str:
    """`http://h:p`, `http://h:p/` and `http://h:p/v1` all name the same server root."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url
