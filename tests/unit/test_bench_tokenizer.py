"""`llmserve bench --tokenizer auto` reads each server's /tokenize in its own shape: vLLM's and llmserve's
(`prompt`), llama.cpp's (`content`; a body without it gets 200 and no tokens, which is not an answer)."""

from __future__ import annotations

import asyncio
import json

import httpx

from llmserve.bench.datasets import ServerTokenizer, pick_tokenizer


def _server(field: str):
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            text = body.get(field, "")  # llama-server: a missing `content` is an empty text
            return httpx.Response(200, json={"tokens": [len(w) for w in text.split()]})
        if request.url.path == "/detokenize":
            text = " ".join("x" * t for t in body["tokens"])
            return httpx.Response(200, json={"prompt" if field == "prompt" else "content": text})
        return httpx.Response(404)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://peer")


def _tokens(field: str) -> tuple[object, list[int]]:
    async def go():
        async with _server(field) as http:
            tok = await pick_tokenizer(http, "m")
            return tok, await tok.encode("three word text")

    return asyncio.run(go())


def test_llama_cpp_shape_is_found_past_an_empty_answer():
    tok, ids = _tokens("content")
    assert isinstance(tok, ServerTokenizer) and ids == [5, 4, 4]


def test_vllm_shape_is_taken_first():
    tok, ids = _tokens("prompt")
    assert isinstance(tok, ServerTokenizer) and tok._shape == 0 and ids == [5, 4, 4]
