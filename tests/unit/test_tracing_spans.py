"""llmserve/server/tracing.py: the span of a finished, an aborted and a failed request, built from the engine's
timings (no engine, no server: an in-memory exporter beside the OTLP one); the flag's variable."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from llmserve.engine.request import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams  # noqa: E402
from llmserve.serve_config import add_serve_arguments, serve_settings_from_args  # noqa: E402
from llmserve.server.tracing import RequestTracer  # noqa: E402


def output(rid, tokens, reason, metrics, error=None):
    comp = CompletionOutput(index=0, text="x", token_ids=list(range(tokens)), finish_reason=reason)
    return RequestOutput(rid, "p", [1, 2, 3], [comp], True, metrics=metrics, error=error)


@pytest.fixture()
def traced(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.5")  # the OTLP exporter gives up at once at shutdown
    tracer = RequestTracer("http://127.0.0.1:9/v1/traces")  # never reached: the spans are read in memory
    mem = InMemorySpanExporter()
    tracer.provider.add_span_processor(SimpleSpanProcessor(mem))
    yield tracer, mem
    tracer.provider.shutdown()


def test_finished_aborted_and_failed_requests(traced):
    tracer, mem = traced
    tp = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    tracer.begin("a-0", tp, SamplingParams(max_tokens=7, temperature=0.5, top_p=0.8), "m")
    tracer.finish(output("a-0", 7, "length", RequestMetrics(100.0, 100.5, 101.0, 102.0, 102.25)), 3)
    tracer.begin("b-0", None, SamplingParams(max_tokens=None), "m")  # aborted while queued: no token
    tracer.finish(output("b-0", 0, "abort", RequestMetrics(200.0, None, None, None, 201.0)), 3)
    tracer.finish(output("c-0", 0, "error", RequestMetrics(300.0, 300.1, None, None, 300.2), error="boom"), 3, "dflt")
    a, b, c = sorted(mem.get_finished_spans(), key=lambda s: s.start_time)
    assert a.name == b.name == c.name == "llm_request"
    aa = dict(a.attributes)
    assert aa["gen_ai.request.max_tokens"] == 7 and aa["gen_ai.request.temperature"] == 0.5
    assert aa["gen_ai.latency.time_in_queue"] == 0.5 and aa["gen_ai.latency.time_to_first_token"] == 1.0
    assert aa["gen_ai.latency.e2e"] == 2.25 and aa["gen_ai.latency.time_in_model_prefill"] == 0.5
    assert aa["gen_ai.latency.time_in_model_decode"] == 1.0 and aa["gen_ai.response.finish_reasons"] == ("length",)
    assert aa["gen_ai.usage.prompt_tokens"] == 3 and aa["gen_ai.usage.completion_tokens"] == 7
    assert (a.start_time, a.end_time) == (100_000_000_000, 102_250_000_000)
    assert format(a.context.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert format(a.parent.span_id, "016x") == "00f067aa0ba902b7"
    ba = dict(b.attributes)
    assert b.parent is None and ba["gen_ai.response.finish_reasons"] == ("abort",)
    assert "gen_ai.latency.time_to_first_token" not in ba and "gen_ai.request.max_tokens" not in ba
    assert ba["gen_ai.latency.e2e"] == 1.0
    assert c.status.status_code.name == "ERROR" and dict(c.attributes)["gen_ai.response.model"] == "dflt"
    assert tracer._pending == {}


def test_the_endpoint_falls_back_to_opentelemetrys_variable(monkeypatch):
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces")
    assert serve_settings_from_args(p.parse_args([])).otlp_traces_endpoint == "http://collector:4318/v1/traces"
    flag = ["--otlp-traces-endpoint", "http://other/v1/traces"]
    assert serve_settings_from_args(p.parse_args(flag)).otlp_traces_endpoint == "http://other/v1/traces"
