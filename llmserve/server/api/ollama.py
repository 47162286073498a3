"""Ollama's API on the same port: what Open WebUI, langchain-ollama, Continue and the `ollama` client speak.

    POST /api/chat, /api/generate   a chat / a prompt; NDJSON lines while it streams (`stream` defaults
                                    to true, as Ollama's), the last one `done` with the counts and durations
    POST /api/embed, /api/embeddings  vectors (the legacy route: one prompt, `embedding`)
    GET  /api/tags, /api/ps; POST /api/show; GET /api/version
    POST /api/pull                  success for the served model, else a clear error: there is no hub

Names are Ollama's `name:tag`: the served model is `NAME:latest` (NAME alone works too). `options` map onto
sampling (num_predict, temperature, top_k, top_p, min_p, stop, seed, num_ctx, repeat_penalty,
repeat_last_n, presence_penalty, frequency_penalty; others such as num_gpu or num_thread are ignored), over the
model's own parameters and Ollama's defaults (ollama_options.py: temperature 0.8, top_k 40, ...); `format` ("json" or a
JSON schema) is the structured-output path; `tools` are the chat API's (server/tool_parsers/), the calls come
back with `arguments` as an object; `images` (base64) go to a vision-language model as image parts; `think` sets
the template's enable_thinking and, with --reasoning-parser, the reasoning comes back in `thinking`; `logprobs`
(with `top_logprobs`) puts each generated token's logprob in the answer's `logprobs` (ollama_render.py). All of it
runs through the chat machinery (prepare.chat_runs, serving.Generation); errors are Ollama's `{"error": "..."}`.
`keep_alive` (seconds, a duration such as "5m", 0: unload once answered, -1: keep) sets how long the model
stays loaded once idle with --models-dir (server/models_dir.py), where /api/tags lists every model of the
folder, /api/ps the loaded ones with their `expires_at`, and /api/pull loads one; with --model, one model is
always loaded and keep_alive is checked and ignored.

This module holds the routes; the rest of Ollama's API sits beside it, a concept a file: ollama_protocol.py (the
request bodies), ollama_messages.py (messages, images and think in the chat API's terms), ollama_options.py
(options and format as sampling), ollama_render.py (the answers: NDJSON lines, vectors), ollama_models.py (model
names, keep_alive, what /api/tags, /api/show and /api/ps say of each model).
"""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError

import llmserve.server.api.embeddings as E
from llmserve import __version__
from llmserve.server import protocol as P
from llmserve.server.api.ollama_messages import chat_messages, template_kwargs, with_images
from llmserve.server.api.ollama_models import describe, entries, keep_alive, resolve, running, tagged
from llmserve.server.api.ollama_options import effective_parameters, parameters_text, sampling_fields, with_last_n
from llmserve.server.api.ollama_protocol import (
    ChatRequest,
    EmbedRequest,
    GenerateRequest,
    GeneratingRequest,
    LegacyEmbeddingsRequest,
    NameRequest,
)
from llmserve.server.api.ollama_render import NDJSON, OllamaEmbedRendering, OllamaRendering, now_rfc3339
from llmserve.server.errors import APIError, from_value_error
from llmserve.server.models_dir import LOAD_SECONDS
from llmserve.server.prepare import admit, chat_runs, compile_guided, fan_out, sampling_params
from llmserve.server.serving import Generation
from llmserve.server.state import ServerState, State


class _JSONBody(APIRoute):
    """Bodies are JSON whatever their content type: Ollama's clients and docs (`curl -d '{...}'`) send
    them without one, or as a form."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            if "json" not in request.headers.get("content-type", ""):
                headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
                request = Request(
                    {**request.scope, "headers": [*headers, (b"content-type", b"application/json")]}, request.receive
                )
            return await handler(request)

        return route


router = APIRouter(route_class=_JSONBody)


def _loaded(name: str, kind: str, keep: float | None) -> JSONResponse:
    """Ollama's answer to a request with nothing to generate: the model is loaded (or, keep_alive 0, unloaded)."""
    head = {"model": name, "created_at": now_rfc3339()}
    if kind == "chat":
        head["message"] = {"role": "assistant", "content": ""}
    else:
        head["response"] = ""
    return JSONResponse({**head, "done": True, "done_reason": "unload" if keep == 0 else "load"})


def _tokenizer(eng, body: GeneratingRequest):
    """The tokenizer that names the tokens of the answer's `logprobs`; None when they were not asked for."""
    return eng.tokenizer if body.logprobs else None


# -- the routes ----------------------------------------------------------------------------------------
@router.post("/api/chat", summary="Ollama: a chat (NDJSON while it streams)")
async def chat(body: ChatRequest, request: Request, state: State):
    eng = state.engine_or_503()
    model = resolve(state, body.model)
    keep = keep_alive(state, body.keep_alive)
    if not body.messages:
        return _loaded(body.model, "chat", keep)
    try:
        tool_plan = state.plan_tools(body.tools, None)
    except ValueError as e:
        raise from_value_error(e) from e
    s = sampling_fields(body, effective_parameters(eng.engine))
    runs = await chat_runs(
        eng,
        state.settings,
        s.fields,
        chat_messages(body.messages),
        s.predict,
        tool_plan,
        logprobs=body.logprob_count(),
        template_kwargs=template_kwargs(state, body, body.model),
        max_tokens_param="options.num_predict",
        context=s.ctx,
    )
    with_last_n(runs, s.last_n)
    reasoning = state.reasoning if body.think is not False else None
    rendering = OllamaRendering(
        "chat",
        body.model,
        reasoning,
        tool_plan,
        think=body.think is not False,
        tokenizer=_tokenizer(eng, body),
        load=request.scope.get(LOAD_SECONDS, 0.0),
    )
    gen = Generation(state, eng, P.random_id("ollama"), runs, 0, model, request, rendering)
    return await gen.response(body.stream)


@router.post("/api/generate", summary="Ollama: a completion of a prompt (NDJSON while it streams)")
async def generate(body: GenerateRequest, request: Request, state: State):
    eng = state.engine_or_503()
    model = resolve(state, body.model)
    if body.images and body.raw:
        raise APIError(400, "images: not supported with raw (a raw prompt has no place for them)", param="images")
    if body.suffix:
        raise APIError(400, "suffix: not supported (no fill-in-the-middle)", param="suffix")
    keep = keep_alive(state, body.keep_alive)
    if not body.prompt:
        return _loaded(body.model, "generate", keep)
    s = sampling_fields(body, effective_parameters(eng.engine))
    if body.raw:
        ids = await asyncio.to_thread(eng.tokenizer.encode, body.prompt)
        params = sampling_params(
            s.fields,
            eng,
            len(ids),
            s.predict,
            body.logprob_count(),
            prompt_param="prompt",
            max_tokens_param="options.num_predict",
            context=s.ctx,
        )
        await compile_guided(eng, params)
        runs = [(i, 0, ids, p) for i, p in enumerate(fan_out(params))]
        admit(eng, runs, state.settings)
    else:
        msgs = ([P.ChatMessage(role="system", content=body.system)] if body.system else []) + [
            P.ChatMessage(role="user", content=with_images(body.prompt, body.images, "images"))
        ]
        runs = await chat_runs(
            eng,
            state.settings,
            s.fields,
            msgs,
            s.predict,
            logprobs=body.logprob_count(),
            template_kwargs=template_kwargs(state, body, body.model),
            prompt_param="prompt",
            max_tokens_param="options.num_predict",
            context=s.ctx,
        )
    with_last_n(runs, s.last_n)
    reasoning = state.reasoning if body.think is not False and not body.raw else None
    rendering = OllamaRendering(
        "generate",
        body.model,
        reasoning,
        think=body.think is not False,
        tokenizer=_tokenizer(eng, body),
        load=request.scope.get(LOAD_SECONDS, 0.0),
    )
    gen = Generation(state, eng, P.random_id("ollama"), runs, 0, model, request, rendering)
    return await gen.response(body.stream)


async def _embed(
    state: ServerState, request: Request, name: str, inputs, legacy: bool, dimensions=None, truncate=False, keep=None
):
    eng = state.engine_or_503()
    model = resolve(state, name)
    keep_alive(state, keep)
    try:
        req = E.EmbeddingRequest(input=inputs, dimensions=dimensions)
    except ValidationError as e:
        raise APIError(400, f"input: {e.errors()[0].get('msg')}", param="input") from e
    runs = await E.runs(eng, req, state.settings.pooling, truncate)
    admit(eng, runs, state.settings)
    gen = Generation(state, eng, P.random_id("embd"), runs, 0, model, request, OllamaEmbedRendering(name, legacy))
    return await gen.response(False)


@router.post("/api/embed", summary="Ollama: embeddings of one input or several")
async def embed(body: EmbedRequest, request: Request, state: State):
    return await _embed(state, request, body.model, body.input, False, body.dimensions, body.truncate, body.keep_alive)


@router.post("/api/embeddings", summary="Ollama (legacy): the embedding of one prompt")
async def embeddings(body: LegacyEmbeddingsRequest, request: Request, state: State):
    return await _embed(state, request, body.model, body.prompt, True, keep=body.keep_alive)


@router.get("/api/tags", summary="Ollama: the models served")
async def tags(state: State):
    models = [
        {
            "name": n,
            "model": n,
            "modified_at": d["modified_at"],
            "size": d["size"],
            "digest": d["digest"],
            "details": d["details"],
        }
        for n, d in entries(state)
    ]
    return {"models": models}


@router.get("/api/ps", summary="Ollama: the models loaded")
async def ps(state: State):
    models = [
        {
            "name": n,
            "model": n,
            "size": d["size"],
            "digest": d["digest"],
            "details": d["details"],
            "expires_at": expires,
            "size_vram": d["size"] if engine.device.type == "cuda" else 0,
            "context_length": engine.max_model_len,
        }
        for n, d, engine, expires in running(state)
    ]
    return {"models": models}


@router.post("/api/show", summary="Ollama: a model's details")
async def show(body: NameRequest, state: State):
    eng = state.engine_or_503()
    resolve(state, body.which())
    d = describe(eng.engine)
    template = getattr(eng.tokenizer.hf, "chat_template", None)
    capabilities = ["completion", "tools"] + (["thinking"] if state.reasoning is not None else [])
    capabilities += ["vision"] if eng.engine.image_processing is not None else []
    return {
        "modelfile": f"FROM {eng.engine.model_path}\n",
        "parameters": parameters_text(effective_parameters(eng.engine)),
        "template": template if isinstance(template, str) else "",
        "details": d["details"],
        "model_info": d["model_info"],
        "capabilities": capabilities,
        "modified_at": d["modified_at"],
    }


@router.get("/api/version", summary="Ollama: the server's version")
async def version():
    return {"version": __version__}


@router.post("/api/pull", summary="Ollama: there is no hub; a served model answers success (--models-dir: loaded)")
async def pull(body: NameRequest, state: State):
    name = body.which()
    try:
        resolve(state, name)
    except APIError as e:
        raise APIError(  # (404 as for any model not here: a request's answer, not a server fault)
            404,
            f"model {name!r} not found, and pulling is not supported: this server has no model hub; it serves "
            f"{', '.join(tagged(n) for n in state.served_names())}",
        ) from e
    if body.stream:
        return StreamingResponse(iter([json.dumps({"status": "success"}) + "\n"]), media_type=NDJSON)
    return {"status": "success"}


@router.api_route("/api/{op}", methods=["POST", "DELETE"], include_in_schema=False)
async def unsupported(op: str):
    if op in ("create", "copy", "delete", "push", "blobs"):
        raise APIError(501, f"/api/{op} is not supported: this server's models are given at start-up")
    raise APIError(404, f"/api/{op}: no such endpoint")
