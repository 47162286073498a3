"""OpenAI's text completions API: POST /v1/completions.

Each prompt (text or token ids; several in one request) is tokenized, n choices per prompt run as one
Generation, and CompletionRendering writes each choice in OpenAI's envelope (rendering.ChoicesRendering):
`text` (with `echo`, the prompt first), logprobs in the completions shape: with `echo`, the prompt's tokens
first (the engine's prompt logprobs, the first token's None), as lm-eval's loglikelihood reads them; `max_tokens:
0` with `echo` answers the prompt alone (one token is generated and dropped, as vLLM does; usage counts 0). vLLM's
`prompt_logprobs` field answers each choice's `prompt_logprobs` (rendering.vllm_prompt_logprobs).
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
from llmserve.server.rendering import ChoicesRendering, token_text, vllm_prompt_logprobs
from llmserve.server.serving import Generation
from llmserve.server.state import State

router = APIRouter()


# -- protocol ------------------------------------------------------------------------------------------
class CompletionRequest(P.SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: with echo only, the prompt alone
    logprobs: int | None = Field(default=None, ge=0)  # its most: --max-logprobs
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
    def _max_tokens(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 asks for no output: only with echo (the prompt and its logprobs)")
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
    echo_logprobs = body.logprobs if body.echo else None  # the prompt's logprobs, from the prefill
    max_tokens = 1 if body.max_tokens == 0 else body.max_tokens  # 0: one token, dropped
    for pi, ids in enumerate(encoded):
        params = sampling_params(body, eng, len(ids), max_tokens, logprobs=body.logprobs, prompt_logprobs=echo_logprobs)
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
        CompletionRendering(eng.tokenizer, runs, body),
    )
    return await gen.response(body.stream, body.stream_options)


# -- rendering -----------------------------------------------------------------------------------------
def completion_logprobs(tok, lps, offset: int = 0, prompt=None, top: int | None = None) -> dict | None:
    """OpenAI's legacy logprobs of tokens `lps`; with `prompt` (echo: the prompt's ids and the engine's prompt
    logprobs, the first None), the prompt's tokens first, each with its `top` best."""
    if lps is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []

    def add(token_id: int, logprob, alternatives) -> None:
        nonlocal offset
        t = token_text(tok, token_id)
        offsets.append(offset)
        offset += len(t)
        tokens.append(t)
        token_lps.append(logprob)
        tops.append({token_text(tok, a.token_id): a.logprob for a in alternatives} if alternatives else None)

    if prompt is not None:
        ids, plps = prompt
        for token_id, lp in zip(ids, plps or [None] * len(ids)):
            add(token_id, None if lp is None else lp.logprob, None if lp is None else lp.top[:top])
    for lp in lps:
        add(lp.token_id, lp.logprob, lp.top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


class CompletionRendering(ChoicesRendering):
    """/v1/completions; with `echo`, each choice's text (and its logprobs) starts with its prompt: in the
    stream, the first chunk. `runs` are the generation's (choice index, prompt index, prompt token ids,
    SamplingParams); `body` the request (its echo, logprobs, max_tokens and prompt_logprobs)."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, tokenizer, runs, body: CompletionRequest) -> None:
        super().__init__()
        self.tok, self.runs, self.req = tokenizer, runs, body  # (not `body`: Rendering.body is the answer)
        self.echo, self.no_output = body.echo, body.max_tokens == 0

    def _prompt_text(self, index: int) -> str:
        return self.tok.decode(self._prompt_ids(index), skip_special_tokens=False)

    def _prompt_ids(self, index: int) -> list[int]:
        return next(r[2] for r in self.runs if r[0] == index)

    def _prompt_part(self, i: int, out: RequestOutput) -> tuple[str, dict | None]:
        """With echo: the prompt's text and its logprobs (None without logprobs)."""
        text = self._prompt_text(i)
        if self.req.logprobs is None:
            return text, None
        prompt = (self._prompt_ids(i), out.prompt_logprobs)
        return text, completion_logprobs(self.tok, [], 0, prompt, self.req.logprobs)

    def _output(self, c, delta: bool) -> tuple[str, list | None]:
        if self.no_output:  # max_tokens 0: the generated token is dropped
            return "", [] if self.req.logprobs is not None else None
        return (c.delta_text, c.delta_logprobs) if delta else (c.text, c.logprobs)

    def completion_tokens(self, out: RequestOutput) -> int:
        return 0 if self.no_output else super().completion_tokens(out)  # max_tokens 0: nothing is shown

    def _extras(self, choice: dict, i: int, out: RequestOutput) -> dict:
        if self.req.prompt_logprobs is not None:  # vLLM's field
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self.tok, out.prompt_logprobs, self.req.prompt_logprobs)
        return choice

    def choice(self, i: int, out: RequestOutput) -> dict:
        c = out.outputs[0]
        text, lps = self._output(c, delta=False)
        prefix, plps = self._prompt_part(i, out) if self.echo else ("", None)
        offset = sum(len(t) for t in plps["tokens"]) if plps is not None else len(prefix)  # (the same, but tokens')
        logprobs = completion_logprobs(self.tok, lps, offset)
        if plps is not None and logprobs is not None:
            logprobs = {k: plps[k] + logprobs[k] for k in logprobs}
        choice = {
            "index": i,
            "text": prefix + text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        return self._extras(choice, i, out)

    def opening(self, i: int, out: RequestOutput) -> list[dict]:
        if not self.echo and self.req.prompt_logprobs is None:
            return []
        text, logprobs = self._prompt_part(i, out) if self.echo else ("", None)
        return [self._extras({"index": i, "text": text, "logprobs": logprobs, "finish_reason": None}, i, out)]

    def deltas(self, i: int, out: RequestOutput) -> list[dict]:
        c = out.outputs[0]
        text, lps = self._output(c, delta=True)
        if not text and not out.finished:
            return []
        choice = {
            "index": i,
            "text": text,
            "logprobs": completion_logprobs(self.tok, lps),
            "finish_reason": c.finish_reason,
        }
        if out.finished:
            choice["stop_reason"] = c.stop_reason
        return [choice]
