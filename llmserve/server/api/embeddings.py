"""OpenAI's embeddings API: POST /v1/embeddings, the served model's pooled hidden states.

Each input (a string, a list of strings, token ids, or a list of token-id lists) becomes one pooling
request in the engine (SamplingParams.pooling): it is scheduled like any other request (the model thread,
the KV budget, chunked prefill, preemption), its prompt's final-normed hidden states are pooled as
--pooling says (`last` token, as vLLM pools decoder models, or `mean`) and normalized, and its KV blocks
are freed at once. The answer: `data[]` of `embedding` objects (floats, or base64 float32 little-endian
as OpenAI's client asks by default), usage in prompt tokens. `dimensions` other than the model's hidden
size is refused: the vectors are not trained for truncation.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Literal, Union

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, field_validator

from llmserve.engine.request import SamplingParams
from llmserve.server import protocol as P
from llmserve.server.errors import APIError
from llmserve.server.prepare import admit
from llmserve.server.rendering import Rendering
from llmserve.server.serving import Generation
from llmserve.server.state import State

router = APIRouter()

POOLING = ("last", "mean")
MAX_INPUTS = 2048  # as OpenAI's API


class EmbeddingRequest(P.APIModel):
    model: str | None = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)

    @field_validator("input")
    @classmethod
    def _input(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("must not be empty")
            if len(v) > MAX_INPUTS and not isinstance(v[0], int):
                raise ValueError(f"at most {MAX_INPUTS} inputs in one request")
        return v

    def inputs(self) -> list[Union[str, list[int]]]:
        v = self.input
        if isinstance(v, str) or (v and isinstance(v[0], int)):
            return [v]
        return list(v)


class EmbeddingResponse(BaseModel):
    """The documented shape of the answer (for /openapi.json)."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    model: str
    usage: dict[str, int]


async def runs(eng, body: EmbeddingRequest, pooling: str, truncate: bool = False) -> list:
    """One run (serving.Run) per input; an empty, too long or out-of-vocabulary input is a 400 naming it.
    `truncate` (Ollama's /api/embed): a too long input is cut to the context instead."""
    hidden = eng.engine.model_config.hidden_size
    if body.dimensions is not None and body.dimensions != hidden:
        raise APIError(
            400,
            f"dimensions: not supported: this model's embeddings have {hidden} dimensions (its "
            f"hidden size) and are not trained to be truncated; leave dimensions out",
            param="dimensions",
            code="unsupported_parameter",
        )
    vocab, max_len = eng.engine.model_config.vocab_size, eng.engine.max_model_len
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
    out = []
    inputs = body.inputs()
    for k, item in enumerate(inputs):
        where = "input" if len(inputs) == 1 else f"input[{k}]"
        ids = await asyncio.to_thread(eng.tokenizer.encode, item) if isinstance(item, str) else list(item)
        if not ids or (isinstance(item, str) and not item):
            raise APIError(400, f"{where}: must not be empty", param="input", code="invalid_value")
        if any(t < 0 or t >= vocab for t in ids):
            raise APIError(400, f"{where}: token ids must be in [0, {vocab})", param="input", code="invalid_value")
        if len(ids) >= max_len and truncate:
            ids = ids[: max_len - 1]
        elif len(ids) >= max_len:
            raise APIError(
                400,
                f"{where}: {len(ids)} tokens; this model's maximum context length is {max_len} "
                f"tokens ({len(ids) - max_len + 1} too many)",
                param="input",
                code="context_length_exceeded",
            )
        out.append((k, k, ids, params))
    return out


class EmbeddingRendering(Rendering):
    """The list of embedding objects (never streamed)."""

    def __init__(self, encoding_format: str = "float") -> None:
        self.encoding_format = encoding_format

    def _vector(self, v: list[float]):
        if self.encoding_format == "base64":
            return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
        return v

    def body(self, gen) -> dict:
        prompt = gen.counts()[0]
        data = [
            {"object": "embedding", "index": i, "embedding": self._vector(gen.finals[i].embedding)}
            for i in sorted(gen.finals)
        ]
        return {
            "object": "list",
            "data": data,
            "model": gen.model,
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
        }


@router.post(
    "/v1/embeddings",
    response_model=EmbeddingResponse,
    responses=P.ERROR_RESPONSES,
    summary="Embeddings: the served model's pooled hidden states (--pooling)",
)
async def embeddings(body: EmbeddingRequest, request: Request, state: State):
    eng = state.engine_or_503()
    model = state.check_model(body.model)
    embedding_runs = await runs(eng, body, state.settings.pooling)
    admit(eng, embedding_runs, state.settings)
    gen = Generation(
        state,
        eng,
        P.random_id("embd"),
        embedding_runs,
        body.priority,
        model,
        request,
        EmbeddingRendering(body.encoding_format),
    )
    return await gen.response(False)
