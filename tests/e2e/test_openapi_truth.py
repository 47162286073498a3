"""/openapi.json tells the truth (issue #55): every operation of a running `llmserve serve` (the Files and
Batches APIs on, an API key, a small body limit) is sent the requests that draw each kind of answer it has:
no key (401), no body, bad JSON, a wrong-typed body, an unknown model, an oversize body (413), and the valid
streamed and unstreamed requests of the routes that stream (SSE on the OpenAI and Anthropic routes, NDJSON
on Ollama's). Each answer's status must be declared for its operation, and its content type under that status;
no operation declares FastAPI's 422, which the server never sends. Deterministic and quick; the random
search over the same schema is tests/e2e/test_fuzz.py (in CI) and benchmarks/serving/fuzz_schemathesis.py."""

from __future__ import annotations

import httpx
import pytest

from llmserve.testing.launcher import ServerProcess

KEY = "truth-key"
H = {"Authorization": f"Bearer {KEY}"}
LIMIT = 65536
OPEN = {"/health", "/ready", "/version", "/metrics", "/stats"}
MSGS = [{"role": "user", "content": "hi"}]
# the valid requests of the routes that stream: (body, streamed?)
VALID = {
    "/v1/chat/completions": {"messages": MSGS, "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"model": "x", "messages": MSGS, "max_tokens": 2},
    "/api/chat": {"model": "x", "messages": MSGS, "options": {"num_predict": 2}},
    "/api/generate": {"model": "x", "prompt": "hi", "options": {"num_predict": 2}},
    "/api/pull": {"model": "x"},
}
UNKNOWN = {"model": "nope", "messages": MSGS, "prompt": "hi", "input": "hi", "max_tokens": 2, "name": "nope"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ("--api-key", KEY, "--served-model-name", "x", "--max-model-len", "256", "--max-request-body-bytes")
    with ServerProcess(*flags, str(LIMIT), "--batch-dir", str(tmp_path_factory.mktemp("batches"))) as srv:
        yield srv.wait_ready(headers={})


def _requests(path: str, method: str):
    """(label, httpx request kwargs) for one operation."""
    yield "no key", {}
    yield "no body", {"headers": H}
    if method in ("post", "delete"):
        yield "bad JSON", {"headers": {**H, "content-type": "application/json"}, "content": b'{"model": '}
        yield "a list", {"headers": H, "json": [1]}
        yield "empty object", {"headers": H, "json": {}}
        yield "unknown model", {"headers": H, "json": UNKNOWN}
        yield "oversize", {"headers": {**H, "content-type": "application/json"}, "content": b" " * (LIMIT + 10)}
    if method == "post" and path in VALID:
        for stream in (False, True):
            yield f"valid, stream {stream}", {"headers": H, "json": {**VALID[path], "stream": stream}}


def _undeclared(op: dict, r: httpx.Response) -> str | None:
    declared = op["responses"].get(str(r.status_code))
    if declared is None:
        return f"status {r.status_code} not declared ({sorted(op['responses'])}): {r.text[:200]}"
    ctype = r.headers.get("content-type", "").split(";")[0].strip()
    if r.content and ctype not in declared.get("content", {}):
        return f"{r.status_code} as {ctype} not declared ({sorted(declared.get('content', {}))})"
    return None


def test_every_answer_is_declared(server):
    schema = httpx.get(server.url + "/openapi.json", timeout=30).json()
    assert "422" not in str(
        {p: {m: sorted(o["responses"]) for m, o in ops.items()} for p, ops in schema["paths"].items()}
    )
    assert len(schema["paths"]) >= 30
    wrong, seen = [], set()
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for path, ops in schema["paths"].items():
            url = path.replace("{file_id}", "file-nope").replace("{batch_id}", "batch_nope").replace("{model}", "nope")
            for method, op in ops.items():
                for label, kwargs in _requests(path, method):
                    r = c.request(method.upper(), url, **kwargs)
                    r.read()
                    seen.add((path, r.status_code, r.headers.get("content-type", "").split(";")[0]))
                    why = _undeclared(op, r)
                    if why:
                        wrong.append(f"{method.upper()} {path} ({label}): {why}")
    assert not wrong, "\n".join(wrong)
    # the walk drew each kind of answer: the key check, bad input, unknown model, the body limit, both streams
    assert {("/v1/chat/completions", s) for s in (200, 400, 401, 404, 413)} <= {(p, s) for p, s, _ in seen}
    assert ("/v1/chat/completions", 200, "text/event-stream") in seen and (
        "/api/chat",
        200,
        "application/x-ndjson",
    ) in seen
    assert ("/api/show", 404, "application/json") in seen and ("/api/pull", 200, "application/x-ndjson") in seen
