"""Ollama's API (/api/...) through a real `llmserve serve` on the bundled model, on the wire with httpx (the
`ollama` client and langchain-ollama: test_ollama_client.py): tags, show, ps, version, chat plain and streamed
(NDJSON), generate (templated and raw), embed and the legacy embeddings, format json and a JSON schema,
options, pull, bodies without a content type, and errors in Ollama's shape. Greedy text through /api/chat
equals /v1/chat/completions'."""

from __future__ import annotations

import base64
import io
import json

import httpx
import jsonschema
import pytest
from PIL import Image

NAME = "smol"
Q = [{"role": "user", "content": "Write a long story about a cat."}]
# greedy, without Ollama's default repeat penalty (1.1 over the last 64 tokens): the OpenAI routes' greedy answer
GREEDY = {"temperature": 0, "num_predict": 12, "repeat_penalty": 1.0}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(ollama_server):
    return ollama_server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _ndjson(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in r.text.splitlines() if line]


def test_tags_show_ps_version(http):
    tags = http.get("/api/tags").json()["models"]
    assert [m["name"] for m in tags] == [f"{NAME}:latest"] and tags[0]["model"] == f"{NAME}:latest"
    assert tags[0]["size"] > 0 and len(tags[0]["digest"]) == 64
    assert tags[0]["details"]["family"] and tags[0]["details"]["parameter_size"].endswith("M")
    for name in (NAME, f"{NAME}:latest"):
        show = http.post("/api/show", json={"model": name}).json()
        assert "completion" in show["capabilities"] and show["template"]
        assert show["model_info"]["general.parameter_count"] > 1e8
    ps = http.get("/api/ps").json()["models"]
    assert ps[0]["name"] == f"{NAME}:latest" and ps[0]["context_length"] == 512
    assert http.get("/api/version").json()["version"]


def test_chat_greedy_equals_openai_chat(http):
    r = http.post("/api/chat", json={"model": f"{NAME}:latest", "messages": Q, "stream": False, "options": GREEDY})
    body = r.json()
    assert r.status_code == 200 and body["done"] is True and body["message"]["role"] == "assistant"
    assert body["model"] == f"{NAME}:latest" and body["created_at"].endswith("Z")
    assert body["eval_count"] == 12 and body["done_reason"] == "length" and body["prompt_eval_count"] > 5
    assert body["total_duration"] >= body["eval_duration"] > 0
    oa = http.post(
        "/v1/chat/completions", json={"model": NAME, "messages": Q, "temperature": 0, "max_tokens": 12}
    ).json()
    assert body["message"]["content"] == oa["choices"][0]["message"]["content"]
    assert body["prompt_eval_count"] == oa["usage"]["prompt_tokens"]
    # streamed (the default): the same text in NDJSON lines, the last one done
    lines = _ndjson(http.post("/api/chat", json={"model": NAME, "messages": Q, "options": GREEDY}))
    assert [ln["done"] for ln in lines] == [False] * (len(lines) - 1) + [True] and len(lines) > 2
    assert "".join(ln["message"]["content"] for ln in lines) == body["message"]["content"]
    assert lines[-1]["eval_count"] == 12 and lines[-1]["done_reason"] == "length"


def test_generate_plain_streamed_and_raw(http):
    req = {"model": NAME, "prompt": "Write a long story about a cat.", "options": GREEDY}
    body = http.post("/api/generate", json={**req, "stream": False}).json()
    chat = http.post("/api/chat", json={"model": NAME, "messages": Q, "stream": False, "options": GREEDY}).json()
    assert body["response"] == chat["message"]["content"] and body["done"] and body["context"]
    lines = _ndjson(http.post("/api/generate", json=req))
    assert "".join(ln["response"] for ln in lines) == body["response"] and lines[-1]["done"]
    raw = http.post(
        "/api/generate", json={**req, "prompt": "The capital of France is", "raw": True, "stream": False}
    ).json()
    assert raw["done"] and raw["eval_count"] == 12 and raw["response"]
    stop = http.post(
        "/api/generate", json={**req, "stream": False, "options": {**GREEDY, "num_predict": 60, "stop": ["."]}}
    ).json()
    assert "." not in stop["response"] and stop["done_reason"] == "stop"
    # an empty prompt: the model is loaded
    assert http.post("/api/generate", json={"model": NAME}).json()["done_reason"] == "load"


def test_format_json_and_schema(http):
    msgs = [{"role": "user", "content": "Give a person as JSON."}]
    body = http.post(
        "/api/chat",
        json={"model": NAME, "messages": msgs, "stream": False, "format": PERSON, "options": {"temperature": 0}},
    ).json()
    jsonschema.validate(json.loads(body["message"]["content"]), PERSON)
    body = http.post(
        "/api/generate",
        json={
            "model": NAME,
            "prompt": "A JSON object:",
            "stream": False,
            "format": "json",
            "options": GREEDY | {"num_predict": 40},
        },
    ).json()
    assert body["response"].lstrip().startswith("{")


def test_embed_and_legacy_embeddings(http):
    body = http.post("/api/embed", json={"model": NAME, "input": ["Paris is in France.", "def f(): pass"]}).json()
    assert len(body["embeddings"]) == 2 and body["prompt_eval_count"] > 4 and body["model"] == NAME
    assert abs(sum(x * x for x in body["embeddings"][0]) - 1) < 1e-3
    one = http.post("/api/embed", json={"model": NAME, "input": "Paris is in France."}).json()["embeddings"]
    legacy = http.post("/api/embeddings", json={"model": NAME, "prompt": "Paris is in France."}).json()["embedding"]
    assert len(one) == 1 and len(legacy) == len(one[0])
    assert max(abs(a - b) for a, b in zip(one[0], legacy)) < 1e-4


def test_errors_in_ollamas_shape(http):
    r = http.post("/api/chat", json={"model": "nope:latest", "messages": Q})
    assert r.status_code == 404 and isinstance(r.json()["error"], str) and "nope" in r.json()["error"]
    r = http.post("/api/show", json={"model": "nope"})
    assert r.status_code == 404 and set(r.json()) == {"error"}
    r = http.post("/api/chat", json={"model": NAME, "messages": [{"role": "user"}], "options": {"temperature": -1}})
    assert r.status_code == 400 and "options.temperature" in r.json()["error"]
    r = http.post("/api/chat", json={"model": NAME, "messages": Q, "think": True})
    assert r.status_code == 400 and "thinking" in r.json()["error"]
    png = io.BytesIO()
    Image.new("RGB", (2, 2)).save(png, format="PNG")
    picture = base64.b64encode(png.getvalue()).decode()
    for path, body in (
        ("/api/chat", {"messages": [{"role": "user", "content": "What is it?", "images": [picture]}]}),
        ("/api/generate", {"prompt": "What is it?", "images": [picture]}),
    ):  # an image to a text-only model (images to a vision-language model: tests/e2e/test_vision_server.py)
        r = http.post(path, json={"model": NAME, "stream": False, **body})
        assert r.status_code == 400 and set(r.json()) == {"error"} and "text-only" in r.json()["error"], r.text
    r = http.post("/api/pull", json={"model": "llama3.2"})
    assert r.status_code == 404 and "hub" in r.json()["error"]
    assert http.post("/api/pull", json={"model": NAME, "stream": False}).json() == {"status": "success"}
    # `curl -d` sends a form content type: the body is read as JSON all the same
    r = http.post(
        "/api/generate",
        content=json.dumps({"model": NAME, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}}),
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 200 and r.json()["eval_count"] == 2


def test_through_the_router(server, http):
    from llmserve.testing.launcher import router_thread, wait_until

    direct = http.post("/api/chat", json={"model": NAME, "messages": Q, "stream": False, "options": GREEDY}).json()
    with router_thread(backends=[server.url], health_interval=0.2) as r, httpx.Client(base_url=r.url, timeout=120) as c:
        wait_until(lambda: NAME in r.router.known_models(), timeout=20)
        lines = _ndjson(c.post("/api/chat", json={"model": f"{NAME}:latest", "messages": Q, "options": GREEDY}))
        assert "".join(ln["message"]["content"] for ln in lines) == direct["message"]["content"]
        assert lines[-1]["done"] and lines[-1]["eval_count"] == direct["eval_count"]
        emb = c.post("/api/embed", json={"model": NAME, "input": "Paris"}).json()
        assert len(emb["embeddings"]) == 1
        r404 = c.post("/api/chat", json={"model": "nope:latest", "messages": Q})
        assert r404.status_code == 404 and set(r404.json()) == {"error"}
