"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncEngine.

The server never sees a block or a tensor: it validates, renders chat templates, tokenizes, hands
token ids and SamplingParams to the engine, and turns the engine's outputs into OpenAI's JSON and SSE.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmserve import __version__, envs
from llmserve.config import EngineConfig
from llmserve.engine.async_engine import AsyncEngine, EngineDeadError
from llmserve.engine.request import RequestOutput, SamplingParams
from llmserve.engine.scheduler import QueueFullError
from llmserve.server import protocol as P
from llmserve.server import tools as tools_mod
from llmserve.server.errors import APIError, from_validation_errors, from_value_error
from llmserve.server.metrics import ServerMetrics

log = logging.getLogger("llmserve.server")
req_log = logging.getLogger("llmserve.requests")

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")


@dataclass
class ServerSettings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    api_key: str | None = None
    protect_metrics: bool = False           # /metrics, /health, /ready and /version need the key too
    allowed_origins: list[str] = field(default_factory=list)
    request_timeout: float | None = None    # seconds; past it a request is aborted
    max_request_body_bytes: int = 4 * 1024 * 1024
    read_timeout: float = 30.0              # seconds for a request's headers, and again for its body
    sse_ping_interval: float = 10.0
    ready_stall_seconds: float = 120.0      # /ready fails if the engine loop made no progress this long
    log_prompts: bool = False
    retry_after_seconds: int = 1


class ServerState:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.engine: AsyncEngine | None = None
        self.load_error: BaseException | None = None
        self.metrics: ServerMetrics | None = None
        self.model_names: list[str] = []
        self.draining = False
        self.on_fatal = None   # set by the CLI: called when the process should exit non-zero

    @property
    def ready(self) -> bool:
        e = self.engine
        if e is None or e.dead is not None or self.draining:
            return False
        return time.time() - e.last_progress < self.settings.ready_stall_seconds

    def load(self) -> None:
        try:
            engine = AsyncEngine.from_config(self.settings.engine)
        except BaseException as e:  # noqa: BLE001 - reported, and the process exits non-zero
            log.error("model failed to load: %s", e)
            self.load_error = e
            if self.on_fatal:
                self.on_fatal(e)
            return
        name = engine.engine.served_model_name
        self.model_names = [name]
        self.metrics = ServerMetrics(name, lambda: engine.engine.stats())
        engine.on_dead = self._engine_died
        engine.on_aborted = self._request_aborted
        if envs.LLMSERVE_FAULT_INJECTION:
            _install_fault_injection(engine)
        self.engine = engine
        log.info("ready: serving %s", name)

    def _request_aborted(self, out: RequestOutput) -> None:
        """A request aborted in the engine (its client went away, or it timed out): counted in
        request_success_total{finished_reason="abort"} as vLLM does, and logged like any other."""
        arrival = out.metrics.arrival_time if out.metrics else time.time()
        _record_finished(self, out, len(out.prompt_token_ids), [], arrival)

    def _engine_died(self, e: BaseException) -> None:
        log.error("engine loop died (%r): exiting so that a supervisor restarts the server", e)
        if self.on_fatal:
            self.on_fatal(e)


# -- fault injection: a test facility, off unless LLMSERVE_FAULT_INJECTION=1 -------------------
FAULT_REQUEST_MARKER = "LLMSERVE-INJECT-REQUEST-FAULT"   # fails that request alone (a 500)
FAULT_LOOP_MARKER = "LLMSERVE-INJECT-LOOP-FAULT"         # kills the engine loop (the process exits 1)


class InjectedLoopFault(BaseException):
    """Not an Exception, so the engine's per-request isolation does not catch it: the loop dies."""


def _install_fault_injection(engine: AsyncEngine) -> None:
    log.warning("LLMSERVE_FAULT_INJECTION=1: prompts containing %s fail, prompts containing %s kill "
                "the engine loop (a test facility; never set this in production)",
                FAULT_REQUEST_MARKER, FAULT_LOOP_MARKER)
    tok, seen = engine.tokenizer, {}

    def hook(r) -> None:
        kind = seen.get(r.request_id)
        if kind is None:
            text = tok.decode(r.prompt_token_ids, skip_special_tokens=False)
            kind = seen[r.request_id] = ("loop" if FAULT_LOOP_MARKER in text else
                                         "request" if FAULT_REQUEST_MARKER in text else "")
            if len(seen) > 100_000:
                seen.clear()
        if kind == "request" and r.num_output_tokens >= 1:
            raise RuntimeError("injected fault in one request's processing")
        if kind == "loop":
            raise InjectedLoopFault("injected fault in the engine loop")

    engine.engine.fault_hook = hook


# -- middleware: body size limit and API key (pure ASGI, so streaming stays unbuffered) ---------
class _BodyRefused(StarletteHTTPException):
    """Too large or too slow. An HTTPException, so that FastAPI's body parsing re-raises it as is."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.status, error.message)
        self.error = error


def _too_large_error(limit: int) -> APIError:
    return APIError(413, f"request body is larger than the limit of {limit} bytes (--max-request-body-bytes)",
                    code="request_too_large", headers={"Connection": "close"})


def _too_slow_error(timeout: float) -> APIError:
    return APIError(408, f"the request body did not arrive within {timeout:g} s (--read-timeout)",
                    code="request_timeout", headers={"Connection": "close"})


OPEN_PATHS = ("/health", "/ready", "/version", "/metrics", "/stats", "/openapi.json", "/docs", "/")


def _key_ok(header: str | None, key: str) -> bool:
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[7:].strip().encode(), key.encode())


class GuardMiddleware:
    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        s = self.state.settings
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        if s.api_key and scope.get("method") != "OPTIONS":
            open_path = (path in OPEN_PATHS or path.startswith("/static/")) and not (
                s.protect_metrics and path in ("/health", "/ready", "/version", "/metrics", "/stats"))
            if not open_path and not _key_ok(headers.get("authorization"), s.api_key):
                err = APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")
                return await err.response()(scope, receive, send)
        limit = s.max_request_body_bytes
        try:
            declared = int(headers.get("content-length", "0") or 0)
        except ValueError:
            declared = 0
        if declared > limit:
            return await self._too_large(scope, receive, send, limit)
        seen = 0
        started = False
        body_done = False
        read_timeout = s.read_timeout
        deadline = None

        async def limited_receive():
            nonlocal seen, body_done, deadline
            if body_done or not read_timeout:
                msg = await receive()
            else:   # the whole body must arrive within read_timeout of the first read (slow bodies)
                loop = asyncio.get_running_loop()
                deadline = deadline or loop.time() + read_timeout
                try:
                    msg = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    raise _BodyRefused(_too_slow_error(read_timeout)) from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if not msg.get("more_body"):
                    body_done = True
                if seen > limit:
                    raise _BodyRefused(_too_large_error(limit))
            return msg

        async def tracking_send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyRefused as e:
            if not started:
                await e.error.response()(scope, receive, send)

    @staticmethod
    async def _too_large(scope, receive, send, limit):
        await _too_large_error(limit).response()(scope, receive, send)


# -- helpers -----------------------------------------------------------------------------------
def _now() -> int:
    return int(time.time())


def _token_text(tok, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def _chat_logprobs(tok, lps) -> dict | None:
    if lps is None:
        return None
    content = []
    for lp in lps:
        t = _token_text(tok, lp.token_id)
        content.append({
            "token": t, "logprob": lp.logprob, "bytes": list(t.encode("utf-8")),
            "top_logprobs": [{"token": (x := _token_text(tok, a.token_id)), "logprob": a.logprob,
                              "bytes": list(x.encode("utf-8"))} for a in lp.top],
        })
    return {"content": content}


def _completion_logprobs(tok, lps, offset: int = 0) -> dict | None:
    if lps is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        t = _token_text(tok, lp.token_id)
        offsets.append(offset)
        offset += len(t)
        tokens.append(t)
        token_lps.append(lp.logprob)
        tops.append({_token_text(tok, a.token_id): a.logprob for a in lp.top} if lp.top else None)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


# -- the app -----------------------------------------------------------------------------------
def build_app(settings: ServerSettings, load_in_background: bool = True) -> FastAPI:
    state = ServerState(settings)
    app = FastAPI(title="llmserve", version=__version__,
                  description="OpenAI-compatible LLM server (chat and text completions, SSE streaming).")
    app.state.llm = state

    if settings.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    app.add_middleware(GuardMiddleware, state=state)

    @app.on_event("startup")
    async def _startup():
        if load_in_background:
            threading.Thread(target=state.load, name="llmserve-load", daemon=True).start()
        else:
            state.load()

    @app.on_event("shutdown")
    async def _shutdown():
        state.draining = True
        if state.engine is not None:
            state.engine.shutdown()

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        if state.metrics is not None and exc.status != 404:
            state.metrics.error(str(exc.status))
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, exc: RequestValidationError):
        return from_validation_errors(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        if isinstance(exc, _BodyRefused):
            return exc.error.response()
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}").response()

    def engine_or_503() -> AsyncEngine:
        if not state.ready:
            raise APIError(503, "the model is not ready yet" if state.engine is None else
                           "the server is not ready", code="not_ready", headers={"Retry-After": "5"})
        return state.engine

    def check_model(name: str | None) -> str:
        if name and name not in state.model_names:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{', '.join(state.model_names)}", param="model", code="model_not_found")
        return state.model_names[0]

    errs = {400: {"model": P.ErrorResponse}, 401: {"model": P.ErrorResponse},
            404: {"model": P.ErrorResponse}, 413: {"model": P.ErrorResponse},
            429: {"model": P.ErrorResponse}, 503: {"model": P.ErrorResponse}}

    # -- probes and info ------------------------------------------------------------------------
    @app.get("/health", summary="Liveness: the process answers")
    async def health():
        return {"status": "ok"}

    @app.get("/ready", summary="Readiness: model loaded and engine loop making progress",
             responses={503: {"model": P.ErrorResponse}})
    async def ready():
        if state.ready:
            return {"status": "ready", "model": state.model_names[0]}
        return engine_or_503()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
    async def metrics():
        if state.metrics is None:
            return PlainTextResponse("", media_type="text/plain; version=0.0.4")
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats", summary="JSON snapshot for the web page: engine state, recent TTFT/ITL percentiles")
    async def stats():
        if state.metrics is None:
            return {"time": time.time(), "ready": False}
        return {"ready": state.ready, **state.metrics.stats()}

    @app.get("/v1/models", response_model=P.ModelList, responses=errs)
    async def models():
        eng = engine_or_503()
        return P.ModelList(data=[P.ModelCard(id=n, root=eng.engine.model_path, max_model_len=eng.engine.max_model_len)
                                 for n in state.model_names])

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index():
        page = os.path.join(STATIC_DIR, "index.html")
        if os.path.exists(page):
            with open(page, encoding="utf-8") as f:
                return HTMLResponse(f.read())
        return HTMLResponse("<h1>llmserve</h1><p>OpenAI-compatible API at /v1</p>")

    if os.path.isdir(STATIC_DIR):
        from fastapi.staticfiles import StaticFiles
        app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    # -- tokenizer ------------------------------------------------------------------------------
    @app.post("/tokenize", response_model=P.TokenizeResponse, responses=errs)
    async def tokenize(body: P.TokenizeRequest):
        eng = engine_or_503()
        check_model(body.model)
        tok = eng.tokenizer
        if body.messages is not None:
            ids = await asyncio.to_thread(_encode_chat, tok, body.messages, body.add_generation_prompt, None)
        else:
            ids = await asyncio.to_thread(tok.encode, body.prompt, body.add_special_tokens)
        return P.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=eng.engine.max_model_len)

    @app.post("/detokenize", response_model=P.DetokenizeResponse, responses=errs)
    async def detokenize(body: P.DetokenizeRequest):
        eng = engine_or_503()
        check_model(body.model)
        vocab = eng.engine.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise APIError(400, f"tokens: ids must be in [0, {vocab})", param="tokens")
        return P.DetokenizeResponse(prompt=eng.tokenizer.decode(body.tokens, skip_special_tokens=False))

    # -- generation -----------------------------------------------------------------------------
    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse, responses=errs)
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        eng = engine_or_503()
        model = check_model(body.model)
        try:
            tool_plan = tools_mod.plan(body.tools, body.tool_choice)
        except ValueError as e:
            raise from_value_error(e) from e
        ids = await asyncio.to_thread(_encode_chat, eng.tokenizer, body.messages,
                                      body.add_generation_prompt, body.chat_template_kwargs, tool_plan)
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = _sampling_params(body, eng, len(ids), max_tokens,
                                  logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                                  tool_plan=tool_plan)
        await _compile_guided(eng, params)
        rid = P.random_id("chatcmpl")
        runs = [(i, 0, ids, p) for i, p in enumerate(_fan_out(params))]
        _admit(eng, runs, settings)
        stream = _Generation(state, eng, rid, runs, body.priority, "chat", model, request)
        stream.tool_plan = tool_plan if tool_plan is not None and tool_plan.parse else None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream.chat_sse(include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await stream.chat_json()

    @app.post("/v1/completions", response_model=P.CompletionResponse, responses=errs)
    async def completions(body: P.CompletionRequest, request: Request):
        eng = engine_or_503()
        model = check_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix: not supported", param="suffix")
        tok = eng.tokenizer
        prompts = body.prompts()
        encoded = []
        for p in prompts:
            if isinstance(p, str):
                encoded.append(await asyncio.to_thread(tok.encode, p))
            else:
                encoded.append(list(p))
        runs = []
        for pi, ids in enumerate(encoded):
            params = _sampling_params(body, eng, len(ids), body.max_tokens, logprobs=body.logprobs)
            await _compile_guided(eng, params)
            for j, p in enumerate(_fan_out(params)):
                runs.append((pi * params.n + j, pi, ids, p))
        _admit(eng, runs, settings)
        rid = P.random_id("cmpl")
        gen = _Generation(state, eng, rid, runs, body.priority, "completion", model, request, echo=body.echo)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(gen.completion_sse(include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await gen.completion_json()

    return app


def _encode_chat(tok, messages: list[P.ChatMessage], add_generation_prompt: bool, kwargs,
                 tool_plan=None) -> list[int]:
    msgs = []
    specials = _special_strings(tok)
    for m in messages:
        for text in (m.text(), m.name or ""):
            hit = next((sp for sp in specials if sp in text), None)
            if hit is not None:   # rendered text is tokenized with special tokens parsed: refuse injection
                raise APIError(400, f"messages: content must not contain the special token {hit!r}",
                               param="messages", code="invalid_value")
        d = {"role": m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        msgs.append(d)
    native = tools_mod.template_supports_tools(tok)
    if tool_plan is not None or any(m.get("tool_calls") for m in msgs):
        msgs, tools = tools_mod.render_messages(msgs, tool_plan, native)
        if tools:
            kwargs = dict(kwargs or {}, tools=tools)
    try:
        return tok.encode_chat(msgs, add_generation_prompt=add_generation_prompt, **(kwargs or {}))
    except ValueError as e:
        raise from_value_error(e) from e
    except Exception as e:  # noqa: BLE001 - a template that raises is the request's fault
        raise APIError(400, f"messages: the chat template could not render them: {e}", param="messages") from e


def _special_strings(tok) -> tuple[str, ...]:
    """The special-token strings the chat template is built of ('<|im_start|>', ...; and bos/eos), which
    message content must not hold: the rendered chat is tokenized with special tokens parsed, so they
    would forge turns (a chat template injection)."""
    cached = getattr(tok, "_llmserve_specials", None)
    if cached is None:
        hf = tok.hf
        names = set(getattr(hf, "all_special_tokens", []) or [])
        for t in (getattr(hf, "added_tokens_decoder", None) or {}).values():
            if getattr(t, "special", False):
                names.add(str(t.content if hasattr(t, "content") else t))
        try:   # only those the chat template itself uses (turn markers) and bos/eos: "<filename>" stays text
            sample = tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                                              {"role": "assistant", "content": "a"}], add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - no template: no chat requests either
            sample = ""
        keep = {getattr(hf, "eos_token", None), getattr(hf, "bos_token", None)}
        cached = tuple(sorted((n for n in names if n and (n in sample or n in keep)), key=len, reverse=True))
        tok._llmserve_specials = cached
    return cached


async def _compile_guided(eng: AsyncEngine, params: SamplingParams) -> None:
    """Compile (and cache) the grammar in a worker thread, so the engine loop never waits on it and
    a bad schema is a 400 before the request is admitted."""
    if params.guided:
        try:
            await asyncio.to_thread(eng.engine.guided.compile, params)
        except ValueError as e:
            raise from_value_error(e) from e


def _sampling_params(body, eng: AsyncEngine, prompt_len: int, max_tokens: int | None,
                     logprobs: int | None, tool_plan=None) -> SamplingParams:
    max_len = eng.engine.max_model_len
    if prompt_len == 0:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    if prompt_len >= max_len:
        raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, your "
                            f"prompt has {prompt_len} tokens ({prompt_len - max_len + 1} too many, leaving "
                            f"room for at least one output token). Please shorten the prompt.",
                       param="messages" if hasattr(body, "messages") else "prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = max_len - prompt_len
    elif prompt_len + max_tokens > max_len:
        raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, you "
                            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                            f"{max_tokens} in the completion): {prompt_len + max_tokens - max_len} too many. "
                            f"Please reduce the prompt or max_tokens.",
                       param="max_tokens", code="context_length_exceeded")
    try:
        guided = tools_mod.guided_kwargs(body, tool_plan)
        return SamplingParams(
            n=body.n, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
            min_p=body.min_p or 0.0, presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            seed=body.seed, max_tokens=max_tokens, min_tokens=min(body.min_tokens, max_tokens),
            stop=body.stop, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
            logprobs=logprobs, skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output, **guided)
    except ValueError as e:
        raise from_value_error(e) from e


def _admit(eng: AsyncEngine, runs, settings: ServerSettings) -> None:
    try:
        eng.check_admission(runs)
    except (ValueError, QueueFullError, EngineDeadError) as e:
        raise _to_api_error(e, settings) from e


def _fan_out(params: SamplingParams) -> list[SamplingParams]:
    if params.n == 1:
        return [params]
    return [params.clone(n=1, seed=None if params.seed is None else params.seed + j) for j in range(params.n)]


def _record_finished(state: ServerState, out: RequestOutput, num_prompt_tokens: int, times: list[float],
                     arrival: float) -> None:
    """Metrics and the request log line for one finished engine request (aborted ones included)."""
    m = state.metrics
    if m is not None:
        m.token_times(arrival, times)
        m.finished(out, num_prompt_tokens)
    met = out.metrics
    comp = out.outputs[0]
    fields = {
        "request_id": out.request_id, "prompt_tokens": num_prompt_tokens, "output_tokens": len(comp.token_ids),
        "cached_tokens": out.num_cached_tokens,
        "queue_time": round((met.first_scheduled_time or met.arrival_time) - met.arrival_time, 4) if met else None,
        "ttft": round(times[0] - met.arrival_time, 4) if met and times else None,
        "total_time": round((met.finished_time or time.time()) - met.arrival_time, 4) if met else None,
        "finish_reason": comp.finish_reason, "preemptions": met.num_preemptions if met else 0,
    }
    if state.settings.log_prompts:
        fields["prompt"] = out.prompt
        fields["completion"] = comp.text
    req_log.info(json.dumps(fields))


class _Generation:
    """One HTTP request's engine requests (n choices, or several prompts), merged into one stream."""

    def __init__(self, state: ServerState, eng: AsyncEngine, rid: str, runs, priority: int, kind: str,
                 model: str, request: Request, echo: bool = False) -> None:
        self.state, self.eng, self.rid, self.runs = state, eng, rid, runs
        self.priority, self.kind, self.model, self.request, self.echo = priority, kind, model, request, echo
        self.created = _now()
        self.arrival = time.time()
        self.s = state.settings
        self.tool_plan = None   # a tools.ToolPlan when the output is parsed for tool calls
        self.finals: dict[int, RequestOutput] = {}

    def _deadline(self) -> float | None:
        t = self.s.request_timeout
        return self.arrival + t if t else None

    async def _events(self) -> AsyncIterator[tuple[int, RequestOutput] | None]:
        """(choice index, output) as they come, merged over runs; None is a keep-alive tick.
        Raises APIError for failures before or during generation."""
        queue: asyncio.Queue = asyncio.Queue()

        async def run(index: int, ids: list[int], params: SamplingParams) -> None:
            times: list[float] = []
            try:
                async for out in self.eng.generate(ids, params, f"{self.rid}-{index}", self.priority):
                    if out.outputs[0].delta_token_ids:
                        times.append(time.time())
                        if self.state.metrics is not None:
                            self.state.metrics.tokens_streamed += len(out.outputs[0].delta_token_ids)
                    await queue.put((index, out))
                    if out.finished:
                        self._record(out, ids, times)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
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
                timeout = self.s.sse_ping_interval
                if deadline is not None:
                    left = deadline - time.time()
                    if left <= 0:
                        raise APIError(504, f"the request took longer than the server's request timeout "
                                            f"of {self.s.request_timeout:g} s", code="request_timeout")
                    timeout = min(timeout, left)
                getter = getter or asyncio.ensure_future(queue.get())
                if not (await asyncio.wait({getter}, timeout=timeout))[0]:
                    yield None
                    continue
                index, item = getter.result()
                getter = None
                if isinstance(item, BaseException):
                    raise _to_api_error(item, self.s)
                if item.finished and item.error:
                    raise APIError(500, f"the request failed in the engine: {item.error}", code="engine_error")
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
        _record_finished(self.state, out, len(ids), times, out.metrics.arrival_time if out.metrics else self.arrival)

    def _usage(self) -> P.UsageInfo:
        firsts = {}   # prompt index -> (choice index of its first run, prompt length)
        for i, pi, ids, _ in self.runs:
            firsts.setdefault(pi, (i, len(ids)))
        prompt = sum(n for _, n in firsts.values())
        completion = sum(len(o.outputs[0].token_ids) for o in self.finals.values())
        cached = sum(self.finals[i].num_cached_tokens for i, _ in firsts.values() if i in self.finals)
        return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                           prompt_tokens_details={"cached_tokens": cached})

    async def _collect(self) -> None:
        """Non-streaming: run to the end, aborting if the client goes away."""
        async def consume():
            async for _ in self._events():
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

    # -- chat -----------------------------------------------------------------------------------
    async def chat_json(self) -> JSONResponse:
        await self._collect()
        tok = self.eng.tokenizer
        choices = []
        for i in sorted(self.finals):
            c = self.finals[i].outputs[0]
            message, finish = {"role": "assistant", "content": c.text}, c.finish_reason
            if self.tool_plan is not None:
                content, calls = tools_mod.parse(c.text, self.tool_plan)
                message = {"role": "assistant", "content": content}
                if calls:
                    message["tool_calls"] = calls
                    finish = "tool_calls" if finish == "stop" else finish
            choices.append({"index": i, "message": message,
                            "logprobs": _chat_logprobs(tok, c.logprobs), "finish_reason": finish,
                            "stop_reason": c.stop_reason})
        return JSONResponse({"id": self.rid, "object": "chat.completion", "created": self.created,
                             "model": self.model, "choices": choices,
                             "usage": self._usage().model_dump(exclude_none=True)})

    def _chunk(self, obj: str, choices: list, usage=None) -> str:
        d = {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            d["usage"] = usage
        return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"

    async def chat_sse(self, include_usage: bool) -> AsyncIterator[str]:
        tok = self.eng.tokenizer
        started: set[int] = set()
        try:
            for i, _, _, _ in self.runs:
                started.add(i)
                yield self._chunk("chat.completion.chunk", [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                             "logprobs": None, "finish_reason": None}])
            async for ev in self._events():
                if ev is None:
                    yield ": ping\n\n"
                    continue
                i, out = ev
                c = out.outputs[0]
                if self.tool_plan is not None:
                    # tool calls: the text is held back and parsed when the choice finishes
                    if not out.finished:
                        continue
                    for chunk in self._tool_chunks(i, c):
                        yield chunk
                    continue
                if not c.delta_text and not out.finished and not (c.delta_logprobs and c.delta_text):
                    continue
                choice = {"index": i, "delta": {"content": c.delta_text} if c.delta_text else {},
                          "logprobs": _chat_logprobs(tok, c.delta_logprobs), "finish_reason": c.finish_reason}
                if out.finished:
                    choice["stop_reason"] = c.stop_reason
                yield self._chunk("chat.completion.chunk", [choice])
            if include_usage:
                yield self._chunk("chat.completion.chunk", [], self._usage().model_dump(exclude_none=True))
        except APIError as e:
            yield e.sse()
        yield "data: [DONE]\n\n"

    def _tool_chunks(self, i: int, c) -> list[str]:
        content, calls = tools_mod.parse(c.text, self.tool_plan)
        obj = "chat.completion.chunk"
        out = []
        if content:
            out.append(self._chunk(obj, [{"index": i, "delta": {"content": content}, "logprobs": None,
                                          "finish_reason": None}]))
        for d in tools_mod.stream_deltas(calls):
            out.append(self._chunk(obj, [{"index": i, "delta": {"tool_calls": [d]}, "logprobs": None,
                                          "finish_reason": None}]))
        finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        out.append(self._chunk(obj, [{"index": i, "delta": {}, "logprobs": None, "finish_reason": finish,
                                      "stop_reason": c.stop_reason}]))
        return out

    # -- completions ----------------------------------------------------------------------------
    def _prompt_text(self, index: int) -> str:
        ids = next(r[2] for r in self.runs if r[0] == index)
        return self.eng.tokenizer.decode(ids, skip_special_tokens=False)

    async def completion_json(self) -> JSONResponse:
        await self._collect()
        tok = self.eng.tokenizer
        choices = []
        for i in sorted(self.finals):
            c = self.finals[i].outputs[0]
            prefix = self._prompt_text(i) if self.echo else ""
            choices.append({"index": i, "text": prefix + c.text,
                            "logprobs": _completion_logprobs(tok, c.logprobs, len(prefix)),
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return JSONResponse({"id": self.rid, "object": "text_completion", "created": self.created,
                             "model": self.model, "choices": choices,
                             "usage": self._usage().model_dump(exclude_none=True)})

    async def completion_sse(self, include_usage: bool) -> AsyncIterator[str]:
        tok = self.eng.tokenizer
        try:
            if self.echo:
                for i, _, _, _ in self.runs:
                    yield self._chunk("text_completion", [{"index": i, "text": self._prompt_text(i),
                                                           "logprobs": None, "finish_reason": None}])
            async for ev in self._events():
                if ev is None:
                    yield ": ping\n\n"
                    continue
                i, out = ev
                c = out.outputs[0]
                if not c.delta_text and not out.finished:
                    continue
                choice = {"index": i, "text": c.delta_text,
                          "logprobs": _completion_logprobs(tok, c.delta_logprobs), "finish_reason": c.finish_reason}
                if out.finished:
                    choice["stop_reason"] = c.stop_reason
                yield self._chunk("text_completion", [choice])
            if include_usage:
                yield self._chunk("text_completion", [], self._usage().model_dump(exclude_none=True))
        except APIError as e:
            yield e.sse()
        yield "data: [DONE]\n\n"


def _to_api_error(e: BaseException, s: ServerSettings) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(429, f"the server is at capacity: {e}; retry later", code="queue_full",
                        headers={"Retry-After": str(s.retry_after_seconds)})
    if isinstance(e, ValueError):
        return from_value_error(e)
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_dead")
    log.error("request failed: %r", e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")
