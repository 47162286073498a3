"""The HTTP routes, thin: each checks readiness and the model name, prepares the engine runs
(prepare.py) and hands them to a serving.Generation with the API's rendering (rendering.py; the
Responses, Messages and embeddings APIs: openai_responses.py, anthropic_messages.py, embeddings.py)."""

from __future__ import annotations

import asyncio
import os
import time

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response

from llmserve import __version__, envs
from llmserve.engine.async_engine import AsyncEngine
from llmserve.server import anthropic_messages as A
from llmserve.server import embeddings as E
from llmserve.server import openai_responses as R
from llmserve.server import protocol as P
from llmserve.server import tools as tools_mod
from llmserve.server.errors import APIError, from_value_error
from llmserve.server.prepare import admit, chat_runs, compile_guided, encode_chat, fan_out, sampling_params
from llmserve.server.reasoning import ReasoningParser
from llmserve.server.rendering import ChatRendering, CompletionRendering
from llmserve.server.serving import Generation
from llmserve.server.state import ServerState

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
ERROR_RESPONSES = {
    400: {"model": P.ErrorResponse},
    401: {"model": P.ErrorResponse},
    404: {"model": P.ErrorResponse},
    413: {"model": P.ErrorResponse},
    429: {"model": P.ErrorResponse},
    503: {"model": P.ErrorResponse},
}
ANTHROPIC_ERROR_RESPONSES = {status: {"model": A.AnthropicErrorResponse} for status in ERROR_RESPONSES}


def engine_or_503(state: ServerState) -> AsyncEngine:
    if not state.ready:
        raise APIError(
            503,
            "the model is not ready yet" if state.engine is None else "the server is not ready",
            code="not_ready",
            headers={"Retry-After": "5"},
        )
    return state.engine


def check_model(state: ServerState, name: str | None) -> str:
    """The model a request names: the base model (also when it names none) or a loaded LoRA adapter."""
    if name and name not in state.model_names:
        if state.lora_name(name):
            return name
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {', '.join(state.served_names())}",
            param="model",
            code="model_not_found",
        )
    return state.model_names[0]


def add_routes(app: FastAPI, state: ServerState) -> None:
    settings = state.settings
    reasoning = ReasoningParser.from_name(
        settings.reasoning_parser, settings.reasoning_start_marker, settings.reasoning_end_marker
    )

    # -- probes and info ------------------------------------------------------------------------
    @app.get("/health", summary="Liveness: the process answers")
    async def health():
        return {"status": "ok"}

    @app.get(
        "/ready",
        summary="Readiness: model loaded and engine loop making progress",
        responses={503: {"model": P.ErrorResponse}},
    )
    async def ready():
        if state.ready:
            return {"status": "ready", "model": state.model_names[0]}
        return engine_or_503(state)

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

    @app.get("/v1/models", response_model=P.ModelList, responses=ERROR_RESPONSES)
    async def models():
        eng = engine_or_503(state)
        cards = [
            P.ModelCard(id=n, root=eng.engine.model_path, max_model_len=eng.engine.max_model_len)
            for n in state.model_names
        ]
        for a in state.lora.adapters() if state.lora is not None else ():
            cards.append(
                P.ModelCard(id=a.name, root=a.path, parent=state.model_names[0], max_model_len=eng.engine.max_model_len)
            )
        return P.ModelList(data=cards)

    if envs.LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING:
        add_lora_routes(app, state)

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
    @app.post("/tokenize", response_model=P.TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize(body: P.TokenizeRequest):
        eng = engine_or_503(state)
        check_model(state, body.model)
        tok = eng.tokenizer
        if body.messages is not None:
            ids = await asyncio.to_thread(encode_chat, tok, body.messages, body.add_generation_prompt, None)
        else:
            ids = await asyncio.to_thread(tok.encode, body.prompt, body.add_special_tokens)
        return P.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=eng.engine.max_model_len)

    @app.post("/detokenize", response_model=P.DetokenizeResponse, responses=ERROR_RESPONSES)
    async def detokenize(body: P.DetokenizeRequest):
        eng = engine_or_503(state)
        check_model(state, body.model)
        vocab = eng.engine.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise APIError(400, f"tokens: ids must be in [0, {vocab})", param="tokens")
        return P.DetokenizeResponse(prompt=eng.tokenizer.decode(body.tokens, skip_special_tokens=False))

    # -- generation -----------------------------------------------------------------------------
    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse, responses=ERROR_RESPONSES)
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        eng = engine_or_503(state)
        model = check_model(state, body.model)
        try:
            tool_plan = tools_mod.plan(body.tools, body.tool_choice)
        except ValueError as e:
            raise from_value_error(e) from e
        runs = await chat_runs(
            eng,
            settings,
            body,
            body.messages,
            body.max_completion_tokens or body.max_tokens,
            tool_plan,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            template_kwargs=body.chat_template_kwargs,
            add_generation_prompt=body.add_generation_prompt,
        )
        gen = Generation(
            state,
            eng,
            P.random_id("chatcmpl"),
            runs,
            body.priority,
            model,
            request,
            ChatRendering(eng.tokenizer, tool_plan, reasoning),
        )
        return await gen.response(body.stream, body.stream_options)

    @app.post("/v1/completions", response_model=P.CompletionResponse, responses=ERROR_RESPONSES)
    async def completions(body: P.CompletionRequest, request: Request):
        eng = engine_or_503(state)
        model = check_model(state, body.model)
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
            params = sampling_params(body, eng, len(ids), body.max_tokens, logprobs=body.logprobs)
            await compile_guided(eng, params)
            for j, p in enumerate(fan_out(params)):
                runs.append((pi * params.n + j, pi, ids, p))
        admit(eng, runs, settings)
        rid = P.random_id("cmpl")
        gen = Generation(
            state,
            eng,
            rid,
            runs,
            body.priority,
            model,
            request,
            CompletionRendering(eng.tokenizer, runs, echo=body.echo),
        )
        return await gen.response(body.stream, body.stream_options)

    @app.post(
        "/v1/responses",
        response_model=R.ResponseObject,
        responses=ERROR_RESPONSES,
        summary="OpenAI's Responses API (stateless)",
    )
    async def responses(body: R.ResponsesRequest, request: Request):
        eng = engine_or_503(state)
        model = check_model(state, body.model)
        R.check_stateless(body)
        try:
            messages = R.chat_messages(body)
            tool_plan = tools_mod.plan(*R.chat_tools(body.tools, body.tool_choice))
        except ValueError as e:
            raise from_value_error(e) from e
        runs = await chat_runs(
            eng,
            settings,
            body,
            messages,
            body.max_output_tokens,
            tool_plan,
            template_kwargs=body.chat_template_kwargs,
            prompt_param="input",
            max_tokens_param="max_output_tokens",
        )
        rendering = R.ResponsesRendering(eng.tokenizer, body, tool_plan, reasoning)
        gen = Generation(state, eng, rendering.rid, runs, body.priority, model, request, rendering)
        return await gen.response(body.stream)

    @app.post(
        "/v1/embeddings",
        response_model=E.EmbeddingResponse,
        responses=ERROR_RESPONSES,
        summary="Embeddings: the served model's pooled hidden states (--pooling)",
    )
    async def embeddings(body: E.EmbeddingRequest, request: Request):
        eng = engine_or_503(state)
        model = check_model(state, body.model)
        runs = await E.runs(eng, body, settings.pooling)
        admit(eng, runs, settings)
        gen = Generation(
            state,
            eng,
            P.random_id("embd"),
            runs,
            body.priority,
            model,
            request,
            E.EmbeddingRendering(body.encoding_format),
        )
        return await gen.response(False)

    # -- Anthropic's Messages API (errors in Anthropic's shape on these paths: app.py) --------------------
    def anthropic_chat(body: A._MessagesFields):
        try:
            return A.chat_messages(body), tools_mod.plan(*A.chat_tools(body.tools, body.tool_choice))
        except ValueError as e:
            raise from_value_error(e) from e

    @app.post(
        "/v1/messages",
        response_model=A.MessageObject,
        responses=ANTHROPIC_ERROR_RESPONSES,
        summary="Anthropic's Messages API",
    )
    async def messages(body: A.MessagesRequest, request: Request):
        eng = engine_or_503(state)
        model = check_model(state, body.model)
        msgs, tool_plan = anthropic_chat(body)
        runs = await chat_runs(
            eng, settings, body, msgs, body.max_tokens, tool_plan, template_kwargs=body.template_kwargs()
        )
        rendering = A.MessagesRendering(body, tool_plan, reasoning)
        gen = Generation(state, eng, rendering.mid, runs, body.priority, model, request, rendering)
        return await gen.response(body.stream)

    @app.post(
        "/v1/messages/count_tokens",
        response_model=A.CountTokensResponse,
        responses=ANTHROPIC_ERROR_RESPONSES,
        summary="Anthropic's token count of a Messages request",
    )
    async def count_tokens(body: A.CountTokensRequest):
        eng = engine_or_503(state)
        check_model(state, body.model)
        msgs, tool_plan = anthropic_chat(body)
        ids = await asyncio.to_thread(encode_chat, eng.tokenizer, msgs, True, body.template_kwargs(), tool_plan)
        return A.CountTokensResponse(input_tokens=len(ids))


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    """Runtime LoRA adapters, as vLLM's (only with LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING)."""

    def registry():
        engine_or_503(state)
        if state.lora is None:
            raise APIError(
                400,
                "LoRA adapters are not enabled on this server (start it with --enable-lora)",
                code="lora_not_enabled",
            )
        return state.lora

    @app.post(
        "/v1/load_lora_adapter",
        response_class=PlainTextResponse,
        responses=ERROR_RESPONSES,
        summary="Load a LoRA adapter (a PEFT folder) under a name",
    )
    async def load_lora_adapter(body: P.LoadLoRAAdapterRequest):
        lora = registry()
        try:
            await asyncio.to_thread(lora.load, body.lora_name, body.lora_path)
        except ValueError as e:
            raise from_value_error(e) from e
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post(
        "/v1/unload_lora_adapter",
        response_class=PlainTextResponse,
        responses=ERROR_RESPONSES,
        summary="Unload a LoRA adapter (requests running with it finish first)",
    )
    async def unload_lora_adapter(body: P.UnloadLoRAAdapterRequest):
        lora = registry()
        try:
            lora.unload(body.lora_name)
        except KeyError:
            raise APIError(
                404, f"the LoRA adapter {body.lora_name!r} is not loaded", param="lora_name", code="model_not_found"
            ) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
