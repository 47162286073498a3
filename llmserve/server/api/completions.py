"""OpenAI's text completions API: POST /v1/completions.

Each prompt (text or token ids; several in one request) is tokenized, n choices per prompt run as one
Generation, and CompletionRendering writes each choice in OpenAI's envelope (rendering.ChoicesRendering):
`text` (with `echo`, the prompt first), logprobs in the completions shape.
"""

from __future__ import annotations

import asyncio
from typing import Any, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, field_validator, model_validator

from llmserve.engine.request import RequestOutput
from llmserve.server import protocol as P
from llmserve.server.errors import APIError
from llmserve.server.prepare import admit, compile_guided, fan_out, sampling_params
from llmserve.server.rendering import ChoicesRendering, token_text
from llmserve.server.serving import Generation
from llmserve.server.state import State

router = APIRouter()


# -- protocol ------------------------------------------------------------------------------------------
class CompletionRequest(P.SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if len(v) == 0:
                raise ValueError("must not be empty")
            if len(v) > 64 and not isinstance(v[0], int):
                raise ValueError("at most 64 prompts in one request")
        return v

    @model_validator(mode="after")
    def _echo_logprobs(self):
        if self.echo and self.logprobs is not None:  # lm-eval's loglikelihood: must not read zeros
            raise ValueError("echo: with logprobs asks for the prompt's log-probabilities (not computed yet)")
        return self

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # one prompt of token ids
        return list(p)


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: P.UsageInfo


# -- the route -----------------------------------------------------------------------------------------
@router.post("/v1/completions", response_model=CompletionResponse, responses=P.ERROR_RESPONSES)
async def completions(body: CompletionRequest, request: Request, state: State):
    eng = state.engine_or_503()
    model = state.check_model(body.model)
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
    admit(eng, runs, state.settings)
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


# -- rendering -----------------------------------------------------------------------------------------
def completion_logprobs(tok, lps, offset: int = 0) -> dict | None:
    if lps is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        t = token_text(tok, lp.token_id)
        offsets.append(offset)
        offset += len(t)
        tokens.append(t)
        token_lps.append(lp.logprob)
        tops.append({token_text(tok, a.token_id): a.logprob for a in lp.top} if lp.top else None)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


class CompletionRendering(ChoicesRendering):
    """/v1/completions; with `echo`, each choice's text starts with its prompt. `runs` are the
    generation's (choice index, prompt index, prompt token ids, SamplingParams)."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, tokenizer, runs, echo: bool = False) -> None:
        super().__init__()
        self.tok, self.runs, self.echo = tokenizer, runs, echo

    def _prompt_text(self, index: int) -> str:
        ids = next(r[2] for r in self.runs if r[0] == index)
        return self.tok.decode(ids, skip_special_tokens=False)

    def choice(self, i: int, out: RequestOutput) -> dict:
        c = out.outputs[0]
        prefix = self._prompt_text(i) if self.echo else ""
        return {
            "index": i,
            "text": prefix + c.text,
            "logprobs": completion_logprobs(self.tok, c.logprobs, len(prefix)),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    def opening(self, i: int) -> list[dict]:
        if not self.echo:
            return []
        return [{"index": i, "text": self._prompt_text(i), "logprobs": None, "finish_reason": None}]

    def deltas(self, i: int, out: RequestOutput) -> list[dict]:
        c = out.outputs[0]
        if not c.delta_text and not out.finished:
            return []
        choice = {
            "index": i,
            "text": c.delta_text,
            "logprobs": completion_logprobs(self.tok, c.delta_logprobs),
            "finish_reason": c.finish_reason,
        }
        if out.finished:
            choice["stop_reason"] = c.stop_reason
        return [choice]
