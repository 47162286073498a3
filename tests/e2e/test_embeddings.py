"""POST /v1/embeddings through a real `llmserve serve --pooling mean` and the official openai client: string,
list and token-id inputs, floats and base64 (the client's default), usage, `dimensions` refused, errors in
OpenAI's shape, embeddings running next to chat generation with every KV block back afterwards. (The vectors
themselves are checked against transformers in tests/integration/test_pooling.py.)"""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import numpy as np
import openai
import pytest

from llmserve.testing.launcher import ServerProcess

KEY = "embeddings-key"
H = {"Authorization": f"Bearer {KEY}"}
TEXTS = ["The capital of France is Paris.", "Paris is the capital city of France.", "def add(a, b): return a + b"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(
        "--num-threads",
        "1",
        "--served-model-name",
        "x",
        "--api-key",
        KEY,
        "--pooling",
        "mean",
        "--max-model-len",
        "512",
    ) as srv:
        yield srv.wait_ready()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _tokens(server, text: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": text}, headers=H).json()["tokens"]


def test_inputs_formats_and_usage(server, client):
    r = client.embeddings.create(model="x", input=TEXTS)  # the client asks for base64 and decodes it
    assert r.object == "list" and r.model == "x" and [d.index for d in r.data] == [0, 1, 2]
    vecs = np.array([d.embedding for d in r.data])
    assert vecs.shape == (3, 576)  # SmolLM2-135M's hidden size
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    ids = [_tokens(server, t) for t in TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(i) for i in ids)
    floats = client.embeddings.create(model="x", input=TEXTS[0], encoding_format="float")
    assert np.allclose(floats.data[0].embedding, vecs[0], atol=1e-6)
    by_ids = client.embeddings.create(model="x", input=ids[1], encoding_format="float")
    assert np.allclose(by_ids.data[0].embedding, vecs[1], atol=1e-6)
    many = client.embeddings.create(model="x", input=[ids[2], ids[0]], encoding_format="float")
    assert np.allclose([d.embedding for d in many.data], vecs[[2, 0]], atol=1e-6)
    cos = vecs @ vecs.T
    assert cos[0, 1] > cos[0, 2]  # the paraphrase is closer than the code
    same = client.embeddings.create(model="x", input=TEXTS[0], dimensions=576, encoding_format="float")
    assert np.allclose(same.data[0].embedding, vecs[0], atol=1e-6)


def test_errors_in_openai_shape(server, client):
    def check(exc, status: int, param: str | None):
        assert exc.status_code == status
        err = exc.response.json()["error"]
        assert err["message"] and err["type"] and err["param"] == param, err

    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="x", input="hi", dimensions=64)
    check(e.value, 400, "dimensions")
    assert "576" in e.value.response.json()["error"]["message"]
    for bad in ("", [], ["ok", ""], [10**9], "word " * 600):
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model="x", input=bad)
        check(e.value, 400, "input")
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="text-embedding-3-small", input="hi")
    check(e.value, 404, "model")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).embeddings.create(
            model="x", input="hi"
        )
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "hi", "encoding_format": "int8"}, headers=H)
    assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format"


def test_embeddings_next_to_generation_and_blocks_come_back(server, client):
    def chat():
        return client.chat.completions.create(
            model="x",
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": "Count to ten."}],
        )

    def embed(k):
        return client.embeddings.create(model="x", input=[f"{t} ({k})" for t in TEXTS], encoding_format="float")

    with cf.ThreadPoolExecutor(8) as pool:
        chats = [pool.submit(chat) for _ in range(2)]
        embeds = [pool.submit(embed, k) for k in range(6)]
        assert all(len(f.result().data) == 3 for f in embeds)
        assert all(f.result().usage.completion_tokens == 24 for f in chats)
    m = server.metrics(H)
    assert m["llmserve:kv_cache_usage_perc"] == 0.0 and m["llmserve:num_requests_running"] == 0.0
