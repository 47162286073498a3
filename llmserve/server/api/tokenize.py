"""The tokenizer's API (vLLM's): POST /tokenize (a prompt, or chat messages as the chat template renders
them) and POST /detokenize.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from pydantic import BaseModel, model_validator

from llmserve.server import protocol as P
from llmserve.server.errors import APIError
from llmserve.server.prepare import chat_images, encode_chat
from llmserve.server.state import State

router = APIRouter()


class TokenizeRequest(P.APIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[P.ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(P.APIModel):
    model: str | None = None
    tokens: list[int]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post("/tokenize", response_model=TokenizeResponse, responses=P.ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, state: State):
    eng = state.engine_or_503()
    state.check_model(body.model)
    tok = eng.tokenizer
    if body.messages is not None:
        images = await chat_images(eng, state.settings, body.messages)  # (its image tokens are counted)
        ids = await asyncio.to_thread(encode_chat, tok, body.messages, body.add_generation_prompt, None, None, images)
        ids = list(ids)
    else:
        ids = await asyncio.to_thread(tok.encode, body.prompt, body.add_special_tokens)
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=eng.engine.max_model_len)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=P.ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, state: State):
    eng = state.engine_or_503()
    state.check_model(body.model)
    vocab = eng.engine.model_config.vocab_size
    if any(t < 0 or t >= vocab for t in body.tokens):
        raise APIError(400, f"tokens: ids must be in [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=eng.tokenizer.decode(body.tokens, skip_special_tokens=False))
