"""Schemathesis against the server's own /openapi.json (issue #8): every operation, positive and negative
examples, sent as JSON and as text/plain, with and without the API key. No 5xx, no hang, every 4xx in
OpenAI's error shape, and 2xx JSON answers conform to the documented response schema.

Generation lengths are clamped (max_tokens <= 4 when the example gives a valid one or none) and the
server runs with --max-model-len 256, so that the run fits CI's time budget; FUZZ_EXAMPLES sets the
examples per operation (default 12)."""
from __future__ import annotations

import json
import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

from tests.server_proc import ServerProcess

# Written against a shared machine that stayed in benchmark quiet mode: not yet run. Enable with
# LLMSERVE_RELIABILITY_TESTS=1 until they have been verified (see docs/reliability.md, "Status").
pytestmark = pytest.mark.skipif(os.environ.get("LLMSERVE_RELIABILITY_TESTS") != "1",
                                reason="issue #8 reliability tests: not yet verified; set LLMSERVE_RELIABILITY_TESTS=1")

KEY = "fuzz-key"
H = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "12"))
OPEN = {"/health", "/ready", "/version", "/metrics", "/stats", "/openapi.json", "/docs"}
SRV: dict = {}


@pytest.fixture(scope="module")
def api_schema():
    srv = ServerProcess("--api-key", KEY, "--max-model-len", "256", "--max-num-seqs", "32",
                        "--request-timeout", "120")
    try:
        srv.wait_ready()
        SRV["url"] = srv.url
        schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
        schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                        max_examples=EXAMPLES)
        yield schema
        assert srv.proc.poll() is None, "the server died during fuzzing"
        assert httpx.get(srv.url + "/ready", timeout=5).status_code == 200
    finally:
        srv.kill()


schema = schemathesis.pytest.from_fixture("api_schema")


def _clamp(body):
    """Keep generations short: a positive max_tokens above 4 becomes 4; none given becomes 4."""
    if isinstance(body, dict):
        for k in ("max_tokens", "max_completion_tokens"):
            v = body.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > 4:
                body[k] = 4
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 4


def _check_shape(resp: httpx.Response, label: str) -> None:
    assert resp.status_code < 500, f"{label}: {resp.status_code} {resp.text[:400]}"
    if 400 <= resp.status_code < 500:
        err = resp.json().get("error")
        assert isinstance(err, dict), f"{label}: 4xx not in OpenAI's shape: {resp.text[:300]}"
        assert isinstance(err.get("message"), str) and err["message"], label
        assert isinstance(err.get("type"), str) and "param" in err and "code" in err, label


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_openapi_operations(case):
    url = SRV["url"]
    if not isinstance(case.body, schemathesis.core.NotSet):
        _clamp(case.body)
    # with the key, as JSON: schemathesis' own checks plus ours
    resp = case.call(base_url=url, headers=H, timeout=150)
    _check_shape(resp, f"{case.method} {case.path} with key")
    checks = [not_a_server_error]
    if resp.status_code < 300 and resp.headers.get("content-type", "").startswith("application/json"):
        checks += [content_type_conformance, response_schema_conformance]
    case.validate_response(resp, checks=checks)
    # without the key: 401 for the API, the probes stay open
    resp = case.call(base_url=url, headers={}, timeout=150)
    _check_shape(resp, f"{case.method} {case.path} without key")
    if case.path not in OPEN:
        assert resp.status_code == 401, (case.path, resp.status_code)
    # the same body as text/plain (the other content type clients send)
    if case.method.upper() == "POST" and not isinstance(case.body, schemathesis.core.NotSet):
        try:
            raw = json.dumps(case.body).encode()
        except (TypeError, ValueError):
            raw = str(case.body).encode()
        r = httpx.post(url + case.formatted_path, content=raw, timeout=150,
                       headers={**H, "Content-Type": "text/plain"})
        _check_shape(r, f"POST {case.path} as text/plain")
