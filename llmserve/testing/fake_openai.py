"""A fake OpenAI-compatible server with known timings and injected failures, for tests, benchmarks
and demos of what talks to an OpenAI-style server (the bench client, the router). No model.

It speaks the slice of the llmserve server API that clients and the router rely on:
`/v1/chat/completions` and `/v1/completions` (plain and SSE streaming), `/v1/models`, `/health`,
`/ready`, `/metrics`, `/tokenize` and `/detokenize`.

Answers are words (`tok0 tok1 ...`) and `/tokenize` counts words, so re-tokenising an answer gives
its length exactly. Token i arrives `ttft + i * itl` seconds after the request (an absolute schedule,
so sleep overshoot does not add up); a stream's first event comes with the first token. A toy
prefix cache (chained hashes of 16-character blocks, LRU) makes cache-aware routing show in
`llmserve:prefix_cache_hits_total`, and each prompt character it misses adds `prefill_per_char` to
the TTFT. A request whose client goes away is counted as aborted
(`llmserve:request_success_total{finished_reason="abort"}`), as vLLM does.

Failures are injected by request number (arrival order since the last reset, from 0) in `errors`,
or for the next requests in turn in `fail_next`:
  503, 429, ... or "http_503"   that status with an OpenAI error body, before any stream
  cut                           the stream ends cleanly but without `data: [DONE]`
  abort                         the connection drops mid-stream
  error_event                   an OpenAI error object in the stream
  hang                          no answer at all (for client timeouts)

Test hooks: `POST /_control` with FakeConfig fields (JSON) changes them at run time (`fail_next`
adds to the queue); with `"reset": true` the config first goes back to the one the server started
with and the counters and request numbering restart, so one process can serve many tests.
`GET /_stats` returns the counters and the last prompts and request headers seen.

    python -m llmserve.testing.fake_openai --port 8001 --ttft 0.2 --itl 0.02
    python -m llmserve.testing.fake_openai --port 8002 --model fake-a --model fake-b --itl 0.01
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import hashlib
import json
import os
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field, fields

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from llmserve.bench.datasets import WordTokenizer
from llmserve.server.errors import APIError

BLOCK = 16  # characters per block of the toy prefix cache


@dataclass
class FakeConfig:
    """How the fake answers; `POST /_control` (or `FakeOpenAI.configure`) changes it at run time."""

    models: list[str] = field(default_factory=lambda: ["fake-model"])
    ttft: float = 0.0  # seconds to the first token
    itl: float = 0.0  # seconds between tokens
    prefill_per_char: float = 0.0  # more TTFT per prompt character the toy prefix cache misses
    tokens: int | None = None  # answer length; default: the request's max_tokens (16 when unset)
    send_usage: bool = True  # honour stream_options.include_usage
    errors: dict[int, str | int] = field(default_factory=dict)  # request number -> failure
    ping_every: int = 0  # a `: ping` comment line every k tokens (0: never)
    split_lines: bool = False  # send every event in two writes, cut mid-line
    word: str = "tok"  # token text prefix (non-ASCII is fine)
    metrics: bool = True  # serve /metrics (else 404)
    ready: bool = True  # /ready answers 200 (else 503)
    cache_blocks: int = 4096  # toy prefix cache size in blocks
    api_key: str | None = None  # completions need `Authorization: Bearer <api_key>`


_FIELDS = {f.name for f in fields(FakeConfig)}


def _status(kind: str | int | None) -> int | None:
    """An injected HTTP status (503 or "http_503"), or None for the other failure kinds."""
    if isinstance(kind, int):
        return kind
    if isinstance(kind, str) and kind.startswith("http_"):
        return int(kind[5:])
    return None


def _prompt_text(body: dict) -> str:
    if "messages" in body:
        return "".join(f"<{m.get('role')}>{m.get('content')}\n" for m in body["messages"])
    p = body.get("prompt", "")
    return p if isinstance(p, str) else json.dumps(p)


class FakeOpenAI:
    """The fake server: its FakeConfig `cfg`, counters, and `app` (ASGI) to serve with uvicorn."""

    def __init__(self, config: FakeConfig | None = None) -> None:
        self.start_config = copy.deepcopy(config or FakeConfig())
        self.tok = WordTokenizer()
        self.reset()
        self.app = Starlette(
            routes=[
                Route("/health", self._health),
                Route("/ready", self._ready),
                Route("/v1/models", self._models),
                Route("/metrics", self._metrics),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/tokenize", self._tokenize, methods=["POST"]),
                Route("/detokenize", self._detokenize, methods=["POST"]),
                Route("/_control", self._control, methods=["POST"]),
                Route("/_stats", self._stats),
            ]
        )

    # -- state ----------------------------------------------------------------------------------

    def reset(self, **changes) -> None:
        """Back to the start config (then `changes`); counters and request numbering to zero."""
        self.cfg = copy.deepcopy(self.start_config)
        self.fail_next: deque = deque()
        self.requests = self.completed = self.aborted = self.running = 0
        self.queries = self.hits = self.prompt_tokens = self.generated = 0
        self.prompts: deque = deque(maxlen=1000)
        self.headers: deque = deque(maxlen=100)
        self.cache: OrderedDict = OrderedDict()
        self.configure(**changes)

    def configure(self, **changes) -> None:
        """Set FakeConfig fields; `fail_next=[...]` adds failures for the next requests."""
        unknown = set(changes) - _FIELDS - {"fail_next"}
        if unknown:
            raise ValueError(f"unknown FakeConfig fields: {sorted(unknown)}")
        self.fail_next.extend(changes.pop("fail_next", ()))
        for name, value in changes.items():
            setattr(self.cfg, name, value)
        self.cfg.errors = {int(k): v for k, v in self.cfg.errors.items()}

    def lookup_and_insert(self, text: str) -> int:
        """Toy prefix cache: returns the number of uncached characters."""
        h, hit, n = b"", 0, len(text) // BLOCK
        still = True
        for i in range(n):
            h = hashlib.blake2b(h + text[i * BLOCK : (i + 1) * BLOCK].encode(), digest_size=8).digest()
            if still and h in self.cache:
                hit += 1
                self.cache.move_to_end(h)
            else:
                still = False
                self.cache[h] = True
                if len(self.cache) > self.cfg.cache_blocks:
                    self.cache.popitem(last=False)
        self.queries += n * BLOCK
        self.hits += hit * BLOCK
        return len(text) - hit * BLOCK

    # -- endpoints ------------------------------------------------------------------------------

    async def _health(self, request: Request):
        return JSONResponse({"status": "ok"})

    async def _ready(self, request: Request):
        return JSONResponse({"ready": self.cfg.ready}, status_code=200 if self.cfg.ready else 503)

    async def _models(self, request: Request):
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in self.cfg.models],
            }
        )

    async def _tokenize(self, request: Request):
        body = await request.json()
        ids = self.tok.encode_sync(body.get("prompt") or body.get("content") or "")
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": 4096})

    async def _detokenize(self, request: Request):
        body = await request.json()
        return JSONResponse({"prompt": self.tok.decode_sync(body["tokens"])})

    async def _metrics(self, request: Request):
        if not self.cfg.metrics:
            return PlainTextResponse("not found", 404)
        label = f'{{model_name="{self.cfg.models[0]}"}}'
        kv = min(1.0, len(self.cache) / max(self.cfg.cache_blocks, 1))
        lines = [
            "# TYPE llmserve:num_requests_running gauge",
            f"llmserve:num_requests_running{label} {self.running}",
            f"llmserve:num_requests_waiting{label} 0",
            f"llmserve:kv_cache_usage_perc {kv}",
            f"llmserve:prompt_tokens_total {self.prompt_tokens}",
            f"llmserve:generation_tokens_total {self.generated}",
            f"llmserve:prefix_cache_queries_total {self.queries}",
            f"llmserve:prefix_cache_hits_total {self.hits}",
            "llmserve:num_preemptions_total 0",
            f'llmserve:request_success_total{{finished_reason="length"}} {self.completed}',
            f'llmserve:request_success_total{{finished_reason="abort"}} {self.aborted}',
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def _control(self, request: Request):
        body = await request.json()
        try:
            if body.pop("reset", False):
                self.reset(**body)
            else:
                self.configure(**body)
        except (TypeError, ValueError) as e:
            return APIError(400, str(e)).response()
        return JSONResponse({"ok": True})

    async def _stats(self, request: Request):
        return JSONResponse(
            {
                "pid": os.getpid(),
                "requests": self.requests,
                "completed": self.completed,
                "aborted": self.aborted,
                "running": self.running,
                "models": self.cfg.models,
                "prompts": list(self.prompts),
                "headers": list(self.headers),
                "prefix_cache_queries": self.queries,
                "prefix_cache_hits": self.hits,
            }
        )

    async def _chat(self, request: Request):
        return await self._generate(request, chat=True)

    async def _completions(self, request: Request):
        return await self._generate(request, chat=False)

    # -- answers --------------------------------------------------------------------------------

    async def _generate(self, request: Request, chat: bool):
        t0 = time.perf_counter()
        body = await request.json()
        cfg = self.cfg
        number = self.requests
        self.requests += 1
        self.headers.append(dict(request.headers))
        if cfg.api_key and request.headers.get("authorization") != f"Bearer {cfg.api_key}":
            return APIError(401, "bad key", code="invalid_api_key").response()
        kind = self.fail_next.popleft() if self.fail_next else cfg.errors.get(number)
        status = _status(kind)
        if status is not None:
            return APIError(status, f"injected {status}").response()
        if kind == "hang":
            await asyncio.sleep(3600)
        model = body.get("model") or cfg.models[0]
        if model not in cfg.models:
            return APIError(
                404, f"The model '{model}' does not exist", param="model", code="model_not_found"
            ).response()
        prompt = _prompt_text(body)
        self.prompts.append(prompt)
        ttft = cfg.ttft + self.lookup_and_insert(prompt) * cfg.prefill_per_char
        n = (
            cfg.tokens
            if cfg.tokens is not None
            else int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        )
        n_prompt = len(self.tok.encode_sync(prompt))
        self.prompt_tokens += n_prompt
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:12]
        head = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        tokens = self._tokens(t0 + ttft, n)
        if body.get("stream"):
            send_usage = bool((body.get("stream_options") or {}).get("include_usage")) and cfg.send_usage
            return StreamingResponse(
                self._sse(tokens, head, chat, n, usage if send_usage else None, kind),
                media_type="text/event-stream",
                headers={"x-request-id": request.headers.get("x-request-id", rid)},
            )

        async def collect():
            return [piece async for piece in tokens]

        task = asyncio.create_task(collect())
        while not task.done():  # a client that hangs up aborts the request
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return JSONResponse({}, status_code=499)
            await asyncio.wait({task}, timeout=0.05)
        text = "".join(task.result())
        choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text, "logprobs": None}
        return JSONResponse({**head, "choices": [{"index": 0, **choice, "finish_reason": "length"}], "usage": usage})

    async def _tokens(self, first_at: float, n: int):
        """Token i's text at `first_at + i * itl`; counts the request completed, or aborted when
        it is left before the end."""
        self.running += 1
        done = False
        try:
            for i in range(n):
                await asyncio.sleep(max(0.0, first_at + i * self.cfg.itl - time.perf_counter()))
                self.generated += 1
                yield f"{self.cfg.word}{i}" if i == 0 else f" {self.cfg.word}{i}"
            done = True
        finally:
            self.running -= 1
            if done:
                self.completed += 1
            else:
                self.aborted += 1

    async def _sse(self, tokens, head: dict, chat: bool, n: int, usage: dict | None, kind):
        cfg = self.cfg

        def event(choice: dict | None, **extra) -> bytes:
            data = {
                **head,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "choices": [choice] if choice else [],
                **extra,
            }
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

        try:
            i = 0
            async for text in tokens:
                if kind == "abort" and i == n // 2:
                    raise ConnectionAbortedError("injected: connection dropped")
                if kind == "error_event" and i == n // 2:
                    yield APIError(500, "injected error").sse().encode()
                    return
                if chat and i == 0:  # role first, with empty content, as OpenAI and vLLM do
                    yield event({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
                finish = "length" if i == n - 1 else None
                choice = (
                    {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text, "logprobs": None}
                )
                data = event({**choice, "finish_reason": finish})
                if cfg.split_lines:
                    cut = len(data) // 2
                    yield data[:cut]
                    await asyncio.sleep(0.001)
                    yield data[cut:]
                else:
                    yield data
                i += 1
                if cfg.ping_every and i % cfg.ping_every == 0:
                    yield b": ping\n\n"
            if usage:
                yield event(None, usage=usage)
            if kind != "cut":
                yield b"data: [DONE]\n\n"
        finally:
            await tokens.aclose()


def control(url: str, reset: bool = False, **changes) -> None:
    """`POST /_control` to a running fake at `url`: FakeConfig fields (and `fail_next`); with
    `reset`, its start config, counters and request numbering come back first."""
    import httpx

    httpx.post(url + "/_control", json={"reset": reset, **changes}, timeout=5).raise_for_status()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--model", action="append", default=None, help="a model name (repeatable; default fake-model)")
    p.add_argument("--ttft", type=float, default=0.0, help="seconds to the first token")
    p.add_argument("--itl", type=float, default=0.0, help="seconds between tokens")
    p.add_argument(
        "--prefill-per-char", type=float, default=0.0, help="more TTFT per prompt character the toy prefix cache misses"
    )
    p.add_argument("--tokens", type=int, default=None, help="answer length (default: max_tokens)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--config", default=None, help="more FakeConfig fields as JSON")
    a = p.parse_args(argv)
    settings = {
        "ttft": a.ttft,
        "itl": a.itl,
        "prefill_per_char": a.prefill_per_char,
        "tokens": a.tokens,
        "api_key": a.api_key,
        **({"models": a.model} if a.model else {}),
        **json.loads(a.config or "{}"),
    }
    fake = FakeOpenAI(FakeConfig(**settings))

    import uvicorn

    print(f"fake OpenAI server on http://{a.host}:{a.port} (Ctrl-C to stop)", flush=True)
    uvicorn.run(fake.app, host=a.host, port=a.port, log_level="warning", access_log=False, timeout_graceful_shutdown=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
