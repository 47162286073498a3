"""A fake OpenAI-compatible streaming server with known timings, for tests and demos.

Every answer's first token arrives `ttft` seconds after the request, and token i at
ttft + i x itl (an absolute schedule, so sleep overshoot does not add up). Tokens are words
(`tok0 tok1 ...`), and `/tokenize` counts words, so re-tokenising an answer gives N exactly.
Errors can be injected by request number (arrival order, from 0):
  http_500, http_429   an error status before the stream starts
  cut                  the stream ends cleanly but without `data: [DONE]`
  abort                the connection drops mid-stream
  error_event          an OpenAI-style error object in the stream
  hang                 no answer at all (for client timeouts)

`POST /_config` with FakeConfig fields (JSON) changes the behaviour and restarts the request
numbering, so one server process can serve many tests.

  python -m llmserve.bench.fakeserver --port 8001 --ttft 0.2 --itl 0.02
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from .datasets import WordTokenizer


@dataclass
class FakeConfig:
    ttft: float = 0.2  # seconds to the first token
    itl: float = 0.02  # seconds between tokens
    tokens: int | None = None  # answer length; default: the request's max_tokens
    send_usage: bool = True  # honour stream_options.include_usage
    errors: dict[int, str] = field(default_factory=dict)  # request number -> error kind
    ping_every: int = 0  # a ': ping' comment line every k tokens (0: never)
    split_lines: bool = False  # send every event in two writes, cut mid-line
    word: str = "tok"  # token text prefix (non-ASCII is fine)
    metrics: bool = True  # serve /metrics


class FakeOpenAIServer:
    """Starlette app + uvicorn in a daemon thread on 127.0.0.1; `with FakeOpenAIServer(...) as s`."""

    def __init__(self, config: FakeConfig | None = None, port: int = 0) -> None:
        self.set_config(config or FakeConfig())
        self.port = port
        self.running = 0
        self.generated = 0
        self.prompt_tokens = 0
        self.tok = WordTokenizer()
        self._server = None
        self._thread: threading.Thread | None = None
        routes = [Route("/v1/models", self.models), Route("/ready", self.ready),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/tokenize", self.tokenize, methods=["POST"]),
                  Route("/detokenize", self.detokenize, methods=["POST"]),
                  Route("/_config", self.configure, methods=["POST"]),
                  Route("/metrics", self.metrics)]
        self.app = Starlette(routes=routes)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> "FakeOpenAIServer":
        import uvicorn
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="critical", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                         daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=5)

    def __enter__(self) -> "FakeOpenAIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- endpoints ------------------------------------------------------------------------------

    async def configure(self, request: Request):
        self.set_config(FakeConfig(**await request.json()))
        return JSONResponse({"ok": True})

    def set_config(self, cfg: FakeConfig) -> None:
        cfg.errors = {int(k): v for k, v in cfg.errors.items()}
        self.cfg, self.requests = cfg, 0

    async def ready(self, request: Request):
        return PlainTextResponse("ok")

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def tokenize(self, request: Request):
        body = await request.json()
        ids = self.tok.encode_sync(body.get("prompt") or body.get("content") or "")
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": 4096})

    async def detokenize(self, request: Request):
        body = await request.json()
        return JSONResponse({"prompt": self.tok.decode_sync(body["tokens"])})

    async def metrics(self, request: Request):
        if not self.cfg.metrics:
            return PlainTextResponse("not found", 404)
        lines = ["# TYPE llmserve:num_requests_running gauge",
                 f"llmserve:num_requests_running{{model_name=\"fake-model\"}} {self.running}",
                 "llmserve:num_requests_waiting{model_name=\"fake-model\"} 0",
                 f"llmserve:kv_cache_usage_perc {min(1.0, self.running / 10):.3f}",
                 f"llmserve:prompt_tokens_total {self.prompt_tokens}",
                 f"llmserve:generation_tokens_total {self.generated}",
                 f"llmserve:prefix_cache_queries_total {self.prompt_tokens}",
                 f"llmserve:prefix_cache_hits_total {self.prompt_tokens // 2}",
                 "llmserve:num_preemptions_total 0"]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def chat(self, request: Request):
        body = await request.json()
        prompt = " ".join(str(m.get("content", "")) for m in body.get("messages", []))
        return await self._complete(body, prompt, chat=True)

    async def completions(self, request: Request):
        body = await request.json()
        return await self._complete(body, str(body.get("prompt", "")), chat=False)

    async def _complete(self, body: dict, prompt: str, chat: bool):
        t0 = time.perf_counter()
        number = self.requests
        self.requests += 1
        kind = self.cfg.errors.get(number)
        if kind in ("http_500", "http_429"):
            status = int(kind[5:])
            return JSONResponse({"error": {"message": "injected", "code": status}}, status)
        if kind == "hang":
            await asyncio.sleep(3600)
        n = self.cfg.tokens if self.cfg.tokens is not None else int(body.get("max_tokens") or 16)
        n_prompt = len(self.tok.encode_sync(prompt))
        usage = bool((body.get("stream_options") or {}).get("include_usage")) and self.cfg.send_usage
        if not body.get("stream"):
            await asyncio.sleep(self.cfg.ttft + (n - 1) * self.cfg.itl)
            text = " ".join(f"{self.cfg.word}{i}" for i in range(n))
            choice = ({"message": {"role": "assistant", "content": text}} if chat
                      else {"text": text})
            return JSONResponse({"choices": [{"index": 0, **choice, "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": n_prompt, "completion_tokens": n}})
        return StreamingResponse(self._stream(t0, n, n_prompt, chat, usage, kind),
                                 media_type="text/event-stream")

    async def _stream(self, t0: float, n: int, n_prompt: int, chat: bool, usage: bool,
                      kind: str | None):
        cfg = self.cfg
        self.running += 1
        self.prompt_tokens += n_prompt
        try:
            def event(choice: dict, **extra) -> bytes:
                data = {"id": "cmpl-fake", "object": "chat.completion.chunk" if chat
                        else "text_completion", "model": "fake-model",
                        "choices": [choice] if choice else [], **extra}
                return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

            if chat:  # role first, with empty content, as OpenAI and vLLM do
                yield event({"index": 0, "delta": {"role": "assistant", "content": ""}})
            for i in range(n):
                await asyncio.sleep(max(0.0, t0 + cfg.ttft + i * cfg.itl - time.perf_counter()))
                if kind == "abort" and i == n // 2:
                    raise ConnectionAbortedError("injected: connection dropped")
                if kind == "error_event" and i == n // 2:
                    yield event({}, error={"message": "injected error", "code": 500})
                    return
                text = f"{cfg.word}{i}" if i == 0 else f" {cfg.word}{i}"
                last = i == n - 1
                choice = ({"index": 0, "delta": {"content": text}} if chat
                          else {"index": 0, "text": text})
                choice["finish_reason"] = "length" if last else None
                data = event(choice)
                self.generated += 1
                if cfg.split_lines:
                    cut = len(data) // 2
                    yield data[:cut]
                    await asyncio.sleep(0.001)
                    yield data[cut:]
                else:
                    yield data
                if cfg.ping_every and (i + 1) % cfg.ping_every == 0:
                    yield b": ping\n\n"
            if usage:
                yield event({}, usage={"prompt_tokens": n_prompt, "completion_tokens": n,
                                       "total_tokens": n_prompt + n})
            if kind != "cut":
                yield b"data: [DONE]\n\n"
        finally:
            self.running -= 1


class FakeServerProcess:
    """The fake server in a child process: it shares no GIL with the client, so timings are steady.

    `with FakeServerProcess(FakeConfig(...)) as fake:` then `fake.url`, `fake.configure(...)`.
    """

    def __init__(self, config: FakeConfig | None = None, start_timeout: float = 30.0) -> None:
        self.cfg = config or FakeConfig()
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> "FakeServerProcess":
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmserve.bench.fakeserver", "--port", "0",
             "--config", json.dumps(asdict(self.cfg))],
            stdout=subprocess.PIPE, text=True, env=env, cwd=root)
        ready, _, _ = select.select([self.proc.stdout], [], [], self.start_timeout)
        line = self.proc.stdout.readline() if ready else ""
        if "http://" not in line:
            self.stop()
            raise RuntimeError(f"fake server did not start: {line!r}")
        self.url = line.split()[4]
        return self

    def configure(self, **fields) -> None:
        """Replace the whole config (unset fields take their defaults); restart numbering."""
        import httpx
        httpx.post(f"{self.url}/_config", json=fields, timeout=5).raise_for_status()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "FakeServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8001, help="0: any free port")
    p.add_argument("--ttft", type=float, default=0.2)
    p.add_argument("--itl", type=float, default=0.02)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--config", default=None, help="FakeConfig fields as JSON (overrides)")
    a = p.parse_args(argv)
    fields = {"ttft": a.ttft, "itl": a.itl, "tokens": a.tokens, **json.loads(a.config or "{}")}
    cfg = FakeConfig(**fields)
    server = FakeOpenAIServer(cfg, a.port).start()
    print(f"fake OpenAI server on {server.url} (Ctrl-C to stop)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
