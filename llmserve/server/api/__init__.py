"""The server's APIs, one module each: its FastAPI `router`, its protocol (pydantic) models and its
rendering (how an engine output becomes the API's JSON body or SSE events, rendering.Rendering).

    chat.py         POST /v1/chat/completions
    completions.py  POST /v1/completions
    responses.py    POST /v1/responses (OpenAI's Responses API, stateless)
    messages.py     POST /v1/messages, /v1/messages/count_tokens (Anthropic's Messages API)
    embeddings.py   POST /v1/embeddings
    tokenize.py     POST /tokenize, /detokenize
    ollama.py       Ollama's API: /api/chat, /api/generate, /api/embed, /api/tags, /api/show, /api/ps, ...
                    (the routes; its bodies, messages, options, answers and model descriptions in
                    ollama_protocol.py, ollama_messages.py, ollama_options.py, ollama_render.py, ollama_models.py)
    models.py       GET /v1/models
    files.py        /v1/files: OpenAI's Files API, for batch input and output files (--batch-dir)
    batches.py      /v1/batches: OpenAI's Batches API, run in the background (batch_store.py, batch.py)
    lora.py         POST /v1/load_lora_adapter, /v1/unload_lora_adapter (runtime LoRA adapters)
    health.py       GET /health, /ready, /version
    metrics.py      GET /metrics, /stats
    kv_events.py    GET /kv_events (the KV cache's block stored / removed events, --kv-events-config)
    web.py          GET / (the web page) and /static/

What they share is one level up, in llmserve/server/: protocol.py (the common request pieces, errors'
shape), prepare.py (a body -> engine runs), serving.py (Generation: the one serving loop), rendering.py
(the Rendering interface, OpenAI's choices envelope), state.py (ServerState: the `State` a route gets),
errors.py. A module's optional `enabled(state)` says whether its routes are offered. A new API: one module
here, one entry in APIS, one e2e test file (docs/contributing.md).
"""

from __future__ import annotations

from fastapi import FastAPI

from llmserve.server.api import (
    batches,
    chat,
    completions,
    embeddings,
    files,
    health,
    kv_events,
    lora,
    messages,
    metrics,
    models,
    ollama,
    responses,
    tokenize,
    web,
)
from llmserve.server.state import ServerState

# in the order their routes are matched and listed in /openapi.json
APIS = (
    health,
    metrics,
    kv_events,
    models,
    lora,
    web,
    tokenize,
    chat,
    completions,
    responses,
    embeddings,
    messages,
    ollama,
    files,
    batches,
)


def include_apis(app: FastAPI, state: ServerState) -> list:
    """Include the enabled APIs' routers; their routes (for server/openapi.py)."""
    routes = []
    for api in APIS:
        enabled = getattr(api, "enabled", None)
        if enabled is None or enabled(state):
            app.include_router(api.router)
            routes += api.router.routes
    return routes
