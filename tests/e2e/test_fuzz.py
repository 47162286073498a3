"""Schemathesis against the server's own /openapi.json (issue #8): every operation, positive and negative
examples, sent as JSON and as text/plain, with and without the API key. No 5xx, no hang, every 4xx in
OpenAI's error shape, every status and content type is declared for its operation (issue #55), and 2xx JSON
answers conform to the documented response schema.

Generation lengths are clamped (max_tokens <= 4 when the example gives a valid one or none) and the
server runs with --max-model-len 256, so that the run fits CI's time budget; FUZZ_EXAMPLES sets the
examples per operation and mode (default 12). The Responses, Messages, embeddings and Ollama APIs are fuzzed
too: 4xx answers on /v1/messages are checked for Anthropic's shape instead, on /api/* for Ollama's.

The cases are drawn with hypothesis from each operation's `as_strategy()` inside one plain test, not
through `schemathesis.pytest.from_fixture`: that lazy loader reaches into pytest internals
(`Item._nodeid`) that pytest 9 no longer has."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from llmserve.testing.fuzz import clamp_budget
from llmserve.testing.launcher import ServerProcess

KEY = "fuzz-key"
H = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "12"))
OPEN = {"/health", "/ready", "/version", "/metrics", "/stats", "/openapi.json", "/docs"}
API = {
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/files"),
    ("GET", "/v1/files"),
    ("GET", "/v1/files/{file_id}"),
    ("GET", "/v1/files/{file_id}/content"),
    ("DELETE", "/v1/files/{file_id}"),
    ("POST", "/v1/batches"),
    ("GET", "/v1/batches"),
    ("GET", "/v1/batches/{batch_id}"),
    ("POST", "/v1/batches/{batch_id}/cancel"),
}
# operations whose generated cases must include answered ones (embeddings' random token ids and strings are
# mostly refused, as they should be: their answers are covered by tests/e2e/test_embeddings.py)
GENERATING = ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "POST /v1/messages")
TIMEOUT = 150


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(
        *("--api-key", KEY, "--max-model-len", "256", "--max-num-seqs", "32", "--request-timeout", "120"),
        *("--batch-dir", str(tmp_path_factory.mktemp("batches"))),  # the Files and Batches APIs on
    )
    try:
        srv.wait_ready()
        yield srv
        assert srv.proc.poll() is None, "the server died during fuzzing"
        assert httpx.get(srv.url + "/ready", timeout=5).status_code == 200
    finally:
        srv.kill()


def _check_shape(resp, label: str, path: str = "") -> None:
    assert resp.status_code < 500, f"{label}: {resp.status_code} {resp.text[:400]}"
    if 400 <= resp.status_code < 500 and path.startswith("/v1/messages"):
        body = resp.json()
        assert body.get("type") == "error", f"{label}: 4xx not in Anthropic's shape: {resp.text[:300]}"
        assert isinstance(body["error"].get("type"), str) and body["error"].get("message"), label
    elif 400 <= resp.status_code < 500 and path.startswith("/api/"):  # Ollama's API: {"error": "message"}
        err = resp.json().get("error")
        assert isinstance(err, str) and err, f"{label}: 4xx not in Ollama's shape: {resp.text[:300]}"
    elif 400 <= resp.status_code < 500:
        err = resp.json().get("error")
        assert isinstance(err, dict), f"{label}: 4xx not in OpenAI's shape: {resp.text[:300]}"
        assert isinstance(err.get("message"), str) and err["message"], label
        assert isinstance(err.get("type"), str) and "param" in err and "code" in err, label


def _check_case(case, url: str, tally: dict) -> None:
    if not isinstance(case.body, schemathesis.core.NotSet):
        clamp_budget(case.body, case.path)
    # with the key, as JSON: schemathesis' own checks plus ours
    resp = case.call(base_url=url, headers=H, timeout=TIMEOUT)
    key = (f"{case.method.upper()} {case.path}", f"{resp.status_code // 100}xx")
    tally[key] = tally.get(key, 0) + 1
    _check_shape(resp, f"{case.method} {case.path} with key", case.path)
    # every status and content type declared (issue #55: 400 / 404 on /api/*, SSE and NDJSON streams)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance]
    ctype = resp.headers.get("content-type") or ""
    ctype = ctype[0] if isinstance(ctype, list) else ctype  # schemathesis' Response: lists of values
    if resp.status_code < 300 and ctype.startswith("application/json"):
        checks += [response_schema_conformance]
    case.validate_response(resp, checks=checks)
    # without the key: 401 for the API, the probes stay open
    resp = case.call(base_url=url, headers={}, timeout=TIMEOUT)
    _check_shape(resp, f"{case.method} {case.path} without key", case.path)
    case.validate_response(resp, checks=[status_code_conformance, content_type_conformance])
    if case.path not in OPEN:
        assert resp.status_code == 401, (case.path, resp.status_code)
    tally["calls"] = tally.get("calls", 0) + 2
    # the same body as text/plain (the other content type clients send)
    if case.method.upper() == "POST" and not isinstance(case.body, schemathesis.core.NotSet):
        try:
            raw = json.dumps(case.body).encode()
        except (TypeError, ValueError):
            raw = str(case.body).encode()
        r = httpx.post(
            url + case.formatted_path, content=raw, timeout=TIMEOUT, headers={**H, "Content-Type": "text/plain"}
        )
        _check_shape(r, f"POST {case.path} as text/plain", case.path)
        tally["calls"] += 1


def test_openapi_operations(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    found = {(op.method.upper(), op.path) for op in ops}
    assert API <= found, f"operations missing from /openapi.json: {API - found}"
    tally: dict = {}
    failures = []
    t0 = time.time()
    for op in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                derandomize=True,
                database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                _check_case(case, server.url, tally)

            try:
                run()
            except Unsatisfiable:
                # nothing to make invalid: an operation without parameters or body has no negative cases
                if mode is GenerationMode.POSITIVE or op.body or op.query:
                    failures.append(f"{op.method.upper()} {op.path} ({mode.value}): no cases generated")
            except Exception as e:  # noqa: BLE001 - every operation is tried; all failures reported
                failures.append(f"{op.method.upper()} {op.path} ({mode.value}): {e!r}"[:2000])
    print(
        f"\nfuzz: {len(ops)} operations, {tally.get('calls', 0)} calls in {time.time() - t0:.0f} s; "
        f"answers with the key: " + ", ".join(f"{k[0]} {k[1]}: {v}" for k, v in tally.items() if k != "calls")
    )
    assert not failures, "\n\n".join(failures)
    for label in GENERATING:  # valid and invalid cases both sent
        assert tally.get((label, "2xx")) and tally.get((label, "4xx")), (label, tally)
