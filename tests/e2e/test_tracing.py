"""--otlp-traces-endpoint on a real `llmserve serve`: a tiny OTLP HTTP collector in this process receives the
spans (one "llm_request" per request, vLLM's gen_ai.* attributes), a request's `traceparent` makes its span a
child of the caller's (sent through `llmserve route`, which passes the header on), and the spans still queued
are exported when the server stops (the batch delay here is longer than the test, so they arrive only by the
shutdown flush)."""

from __future__ import annotations

import http.server
import threading

import httpx
import pytest

from llmserve.testing.launcher import ServerProcess, router_thread, wait_until

trace_service_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
pytest.importorskip("opentelemetry.sdk")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Collector:
    """POST /v1/traces (OTLP HTTP/protobuf) on a free port; `spans()`: every span received so far."""

    def __init__(self) -> None:
        self.requests: list = []
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path == "/v1/traces":
                    msg = trace_service_pb2.ExportTraceServiceRequest()
                    msg.ParseFromString(body)
                    collector.requests.append(msg)
                    self.send_response(200)
                    out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                else:
                    self.send_response(404)
                    out = b""
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def spans(self) -> list:
        return [s for r in list(self.requests) for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]

    def __enter__(self) -> Collector:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = [x.string_value for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)
    return out


def test_a_span_per_request_with_vllm_attributes_and_the_callers_parent():
    with Collector() as collector:
        srv = ServerProcess(
            *("--otlp-traces-endpoint", collector.url, "--served-model-name", "smol", "--num-threads", "1"),
            env={"OTEL_BSP_SCHEDULE_DELAY": "600000"},  # only the shutdown flush sends them
        )
        try:
            srv.wait_ready()
            prompt = "Count: one, two, three,"
            with router_thread(backends=[srv.url]) as router:  # the W3C header crosses the router
                r1 = httpx.post(
                    router.url + "/v1/completions",
                    json={"prompt": prompt, "max_tokens": 5, "temperature": 0.0, "top_p": 0.9},
                    headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
                    timeout=120,
                )
            r2 = httpx.post(
                srv.url + "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
                timeout=120,
            )
            assert r1.status_code == 200 and r2.status_code == 200
            assert collector.spans() == []  # still queued: the batch delay is long
            assert srv.terminate(timeout=60) is not None  # SIGTERM: a graceful stop flushes them
        finally:
            srv.kill()
        assert wait_until(lambda: len(collector.spans()) >= 2, timeout=10), open(srv.log_path).read()[-2000:]
    spans = collector.spans()
    assert len(spans) == 2 and {s.name for s in spans} == {"llm_request"}
    by_tokens = {attrs(s)["gen_ai.request.max_tokens"]: (s, attrs(s)) for s in spans}
    (s1, a1), (s2, a2) = by_tokens[5], by_tokens[3]
    u1 = r1.json()["usage"]
    assert a1["gen_ai.usage.prompt_tokens"] == u1["prompt_tokens"]
    assert a1["gen_ai.usage.completion_tokens"] == u1["completion_tokens"] == 5
    assert a2["gen_ai.usage.prompt_tokens"] == r2.json()["usage"]["prompt_tokens"]
    assert a1["gen_ai.response.model"] == a2["gen_ai.response.model"] == "smol"
    assert a1["gen_ai.request.temperature"] == 0.0 and a1["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a1["gen_ai.response.finish_reasons"] == ["length"]
    assert a1["gen_ai.request.id"] and a1["gen_ai.request.id"] != a2["gen_ai.request.id"]
    for a in (a1, a2):
        assert a["gen_ai.latency.time_in_queue"] >= 0
        assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"] < 120
        assert a["gen_ai.latency.time_in_model_prefill"] >= 0 and a["gen_ai.latency.time_in_model_decode"] >= 0
    # the caller's trace: same trace id, its span as the parent; the other request starts its own trace
    assert s1.trace_id.hex() == TRACE_ID and s1.parent_span_id.hex() == PARENT_ID
    assert s2.trace_id.hex() != TRACE_ID and not s2.parent_span_id
    assert s1.end_time_unix_nano - s1.start_time_unix_nano == pytest.approx(a1["gen_ai.latency.e2e"] * 1e9, rel=0.01)


def test_the_flag_without_opentelemetry_fails_at_start_up(tmp_path):
    """A Python path where the SDK cannot be imported (`opentelemetry` is a namespace package; fastapi imports
    its API): the server refuses to start, saying why."""
    (tmp_path / "opentelemetry" / "sdk").mkdir(parents=True)
    (tmp_path / "opentelemetry" / "sdk" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    with ServerProcess(
        "--otlp-traces-endpoint", "http://127.0.0.1:9/v1/traces", env={"PYTHONPATH": str(tmp_path)}
    ) as srv:
        assert srv.proc.wait(120) != 0
        assert "pip install 'llmserve[otlp]'" in srv.log()
