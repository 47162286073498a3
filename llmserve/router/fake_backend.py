"""A fake OpenAI-compatible backend for router tests and the router-overhead benchmark.

It speaks the slice of the llmserve server API the router relies on (`/v1/chat/completions`,
`/v1/completions` with SSE streaming, `/v1/models`, `/health`, `/ready`, `/metrics`) and answers
with fake tokens ("tok0 tok1 ..."), so router behaviour can be tested in milliseconds with no
model. It also keeps a toy prefix cache (chained hashes of 16-character blocks, LRU) so that
cache-aware routing shows up in `llmserve:prefix_cache_hits_total`, and counts aborted requests
(`llmserve:request_success_total{finished_reason="abort"}`), as vLLM does.

Test hooks: `POST /_control` changes behaviour at run time (`ready`, `fail_next`: statuses to
answer the next requests with, `token_delay`, `first_byte_delay`); `GET /_stats` returns counters
and the last prompts seen.

    python -m llmserve.router.fake_backend --port 8001 --model fake-a --token-delay 0.01
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

BLOCK = 16


@dataclass
class FakeState:
    models: list[str]
    name: str = "fake"
    token_delay: float = 0.0
    first_byte_delay: float = 0.0
    prefill_per_char: float = 0.0      # seconds per uncached prompt character
    ready: bool = True
    cache_blocks: int = 4096
    fail_next: deque = field(default_factory=deque)
    api_key: str | None = None
    # counters
    requests: int = 0
    completed: int = 0
    aborted: int = 0
    running: int = 0
    queries: int = 0
    hits: int = 0
    prompts: deque = field(default_factory=lambda: deque(maxlen=1000))
    headers: deque = field(default_factory=lambda: deque(maxlen=100))
    cache: OrderedDict = field(default_factory=OrderedDict)

    def lookup_and_insert(self, text: str) -> int:
        """Toy prefix cache: returns the number of uncached characters."""
        h, hit, n = b"", 0, len(text) // BLOCK
        still = True
        for i in range(n):
            h = hashlib.blake2b(h + text[i * BLOCK:(i + 1) * BLOCK].encode(), digest_size=8).digest()
            if still and h in self.cache:
                hit += 1
                self.cache.move_to_end(h)
            else:
                still = False
                self.cache[h] = True
                if len(self.cache) > self.cache_blocks:
                    self.cache.popitem(last=False)
        self.queries += n * BLOCK
        self.hits += hit * BLOCK
        return len(text) - hit * BLOCK


def _prompt_text(body: dict) -> str:
    if "messages" in body:
        return "".join(f"<{m.get('role')}>{m.get('content')}\n" for m in body["messages"])
    p = body.get("prompt", "")
    return p if isinstance(p, str) else json.dumps(p)


def build_fake_app(state: FakeState) -> FastAPI:
    app = FastAPI()
    app.state.fake = state

    def err(status: int, message: str, type_: str, code: str | None = None):
        return JSONResponse(status_code=status, content={"error": {
            "message": message, "type": type_, "param": None, "code": code}})

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        return JSONResponse({"ready": state.ready}, status_code=200 if state.ready else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": state.name} for m in state.models]}

    @app.get("/metrics")
    async def metrics():
        kv = min(1.0, len(state.cache) / max(state.cache_blocks, 1))
        lines = [
            f"llmserve:num_requests_running {state.running}",
            "llmserve:num_requests_waiting 0",
            f"llmserve:kv_cache_usage_perc {kv}",
            f"llmserve:prefix_cache_queries_total {state.queries}",
            f"llmserve:prefix_cache_hits_total {state.hits}",
            f'llmserve:request_success_total{{finished_reason="length"}} {state.completed}',
            f'llmserve:request_success_total{{finished_reason="abort"}} {state.aborted}',
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.get("/_stats")
    async def stats():
        return {"pid": os.getpid(), "requests": state.requests, "completed": state.completed,
                "aborted": state.aborted, "running": state.running, "name": state.name,
                "prompts": list(state.prompts), "headers": list(state.headers),
                "prefix_cache_queries": state.queries, "prefix_cache_hits": state.hits}

    @app.post("/_control")
    async def control(request: Request):
        body = await request.json()
        for k in ("ready", "token_delay", "first_byte_delay", "prefill_per_char"):
            if k in body:
                setattr(state, k, body[k])
        if "fail_next" in body:
            state.fail_next.extend(body["fail_next"])
        return {"ok": True}

    async def generate(request: Request, chat: bool):
        body = await request.json()
        state.requests += 1
        state.headers.append({k: v for k, v in request.headers.items()})
        if state.api_key and request.headers.get("authorization") != f"Bearer {state.api_key}":
            return err(401, "bad key", "invalid_request_error", "invalid_api_key")
        if state.fail_next:
            status = state.fail_next.popleft()
            return err(status, f"injected {status}", "server_error")
        model = body.get("model") or state.models[0]
        if model not in state.models:
            return err(404, f"The model '{model}' does not exist", "invalid_request_error",
                       "model_not_found")
        prompt = _prompt_text(body)
        state.prompts.append(prompt)
        uncached = state.lookup_and_insert(prompt)
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 8)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:12]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        words = [f"tok{i}" for i in range(n)]
        usage = {"prompt_tokens": len(prompt) // 4, "completion_tokens": n,
                 "total_tokens": len(prompt) // 4 + n}
        state.running += 1

        async def produce():
            """Yields each word after its delay; counts aborts and completions."""
            done = False
            try:
                await asyncio.sleep(state.first_byte_delay + uncached * state.prefill_per_char)
                for i, w in enumerate(words):
                    if i and state.token_delay:
                        await asyncio.sleep(state.token_delay)
                    yield (" " if i else "") + w
                done = True
            finally:
                state.running -= 1
                if done:
                    state.completed += 1
                else:
                    state.aborted += 1

        if body.get("stream"):
            async def sse():
                def chunk(delta, finish=None):
                    choice = ({"index": 0, "delta": delta, "finish_reason": finish} if chat else
                              {"index": 0, "text": delta.get("content", ""), "finish_reason": finish,
                               "logprobs": None})
                    return "data: " + json.dumps({"id": rid, "object": obj + ".chunk" if chat else obj,
                                                  "created": created, "model": model,
                                                  "choices": [choice]}) + "\n\n"
                gen = produce()
                try:
                    first = True
                    async for piece in gen:
                        if first and chat:
                            yield chunk({"role": "assistant", "content": ""})
                        first = False
                        yield chunk({"content": piece})
                    yield chunk({}, "length")
                    yield "data: [DONE]\n\n"
                finally:
                    await gen.aclose()
            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"x-request-id": request.headers.get("x-request-id", rid)})

        async def collect():
            return [piece async for piece in produce()]

        task = asyncio.create_task(collect())
        while not task.done():               # a client that hangs up aborts the request
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return JSONResponse({}, status_code=499)
            await asyncio.wait({task}, timeout=0.05)
        text = "".join(task.result())
        choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "finish_reason": "length"} if chat else
                  {"index": 0, "text": text, "finish_reason": "length", "logprobs": None})
        return {"id": rid, "object": obj, "created": created, "model": model,
                "choices": [choice], "usage": usage}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    return app


# ----------------------------------------------------------------------------------------------
# helpers for tests: free ports, a uvicorn server in a thread
# ----------------------------------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """Runs an ASGI app with uvicorn in a background thread (startup and shutdown included)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None):
        self.host, self.port = host, port or free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port,
                                                    log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> "ServerThread":
        self.thread.start()
        t = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t > timeout:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


@contextmanager
def fake_backends(*models: str, host: str = "127.0.0.1", **kw):
    """Context manager: one fake backend per model name, each in its own thread."""
    servers = []
    try:
        for m in models:
            st = FakeState(models=[m], name=m, **kw)
            servers.append(ServerThread(build_fake_app(st), host=host).start())
            servers[-1].state = st
        yield servers
    finally:
        for s in servers:
            s.stop()


@contextmanager
def router_thread(dns_resolver=None, registry=None, **config):
    """Context manager: a Router (RouterConfig fields as keywords) served in a thread. The
    yielded ServerThread has `.router` for inspection."""
    from .app import Router, RouterConfig, build_app

    router = Router(RouterConfig(**config), registry=registry, dns_resolver=dns_resolver)
    server = ServerThread(build_app(router))
    server.router = router
    with server:
        yield server


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll `predicate` until it is true; False after `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


class Process:
    """A server subprocess for tests: started, polled until `ready_path` answers 200, and always
    killed (its whole process group) by `stop()` / the context manager."""

    def __init__(self, args: list[str], url: str, ready_path: str = "/ready",
                 log_path: str | None = None, env: dict | None = None):
        self.args, self.url, self.ready_path = args, url, ready_path
        self.log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        full_env = dict(os.environ, **(env or {}))
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (root, full_env.get("PYTHONPATH")) if p)   # this checkout's llmserve
        self.proc = subprocess.Popen([sys.executable, *args], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 60.0) -> "Process":
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.args} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.url}{self.ready_path} not ready after {timeout}s")

    def kill(self, sig=None) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig or signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                self.kill()
        if hasattr(self.log, "close"):
            self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="fake OpenAI backend for router tests")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--model", action="append", default=None)
    p.add_argument("--token-delay", type=float, default=0.0)
    p.add_argument("--first-byte-delay", type=float, default=0.0)
    p.add_argument("--prefill-per-char", type=float, default=0.0)
    p.add_argument("--api-key", default=None)
    a = p.parse_args(argv)
    models = a.model or ["fake"]
    st = FakeState(models=models, name=models[0], token_delay=a.token_delay,
                   first_byte_delay=a.first_byte_delay, prefill_per_char=a.prefill_per_char,
                   api_key=a.api_key)
    uvicorn.run(build_fake_app(st), host=a.host, port=a.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
