"""OpenTelemetry traces of requests (--otlp-traces-endpoint, as vLLM's): one span per engine request, named
"llm_request" with vLLM's gen_ai.* attributes, exported over OTLP HTTP/protobuf by a BatchSpanProcessor (its
own thread; OTEL_BSP_SCHEDULE_DELAY and the other OTEL_BSP_* variables apply).

The span is built when the request finishes (finished, aborted or failed), from the timings the engine
records on every request anyway (arrival, first scheduled, first and last token, finished:
engine/request.py's RequestMetrics), with its start and end set to those times: nothing runs on the
engine's loop per step. A request's W3C `traceparent` (and `tracestate`) header makes the span its child.

opentelemetry is optional (`pip install 'llmserve[otlp]'`); without it the flag fails at start-up.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from llmserve.engine.request import RequestOutput, SamplingParams

log = logging.getLogger("llmserve.tracing")

SPAN_NAME = "llm_request"
MAX_PENDING = 100_000  # requests begun and not yet finished; beyond, the oldest are forgotten


class SpanAttributes:
    """vLLM's names (vllm/tracing.py), from OpenTelemetry's gen_ai semantic conventions."""

    REQUEST_ID = "gen_ai.request.id"
    RESPONSE_MODEL = "gen_ai.response.model"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_N = "gen_ai.request.n"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    FINISH_REASONS = "gen_ai.response.finish_reasons"
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_E2E = "gen_ai.latency.e2e"
    LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    # llmserve's own
    CACHED_TOKENS = "llmserve.usage.cached_tokens"
    PREEMPTIONS = "llmserve.num_preemptions"


INSTALL_HINT = (
    "--otlp-traces-endpoint needs OpenTelemetry: pip install 'llmserve[otlp]' "
    "(opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)"
)


class RequestTracer:
    """Spans of finished requests, exported to an OTLP HTTP endpoint. `begin` (the HTTP side, as a request
    is handed to the engine) keeps the request's trace context and parameters; `finish` (when it ends,
    on the event loop or, for aborts, the engine thread) makes the span."""

    def __init__(self, endpoint: str, service_name: str = "llmserve") -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind, Status, StatusCode
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise ValueError(f"{INSTALL_HINT} ({e})") from None
        self.endpoint = endpoint
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("llmserve")
        self._propagator = TraceContextTextMapPropagator()
        self._kind, self._status, self._error = SpanKind.SERVER, Status, StatusCode.ERROR
        self._pending: dict[str, tuple] = {}  # engine request id -> (context, params, model)
        log.info("tracing: spans to %s", endpoint)

    def begin(self, request_id: str, headers: Mapping[str, str] | None, params: SamplingParams, model: str) -> None:
        ctx = self._propagator.extract(headers) if headers is not None and "traceparent" in headers else None
        if len(self._pending) >= MAX_PENDING:  # requests that never reached the engine (refused at admission)
            self._pending.pop(next(iter(self._pending)), None)
        self._pending[request_id] = (ctx, params, model)

    def forget(self, request_id: str) -> None:
        """A request that failed before the engine took it: no span."""
        self._pending.pop(request_id, None)

    def finish(self, out: RequestOutput, num_prompt_tokens: int, default_model: str | None = None) -> None:
        ctx, params, model = self._pending.pop(out.request_id, (None, None, default_model))
        met, comp = out.metrics, out.outputs[0]
        if met is None:
            return
        A = SpanAttributes
        end = met.finished_time or met.last_token_time or met.arrival_time
        attrs: dict = {
            A.REQUEST_ID: out.request_id,
            A.USAGE_PROMPT_TOKENS: num_prompt_tokens,
            A.USAGE_COMPLETION_TOKENS: len(comp.token_ids),
            A.USAGE_NUM_SEQUENCES: 1,
            A.FINISH_REASONS: [str(comp.finish_reason or ("error" if out.error else "abort"))],
            A.LATENCY_E2E: end - met.arrival_time,
            A.CACHED_TOKENS: out.num_cached_tokens,
            A.PREEMPTIONS: met.num_preemptions,
        }
        if model:
            attrs[A.RESPONSE_MODEL] = model
        if params is not None:
            attrs[A.REQUEST_TEMPERATURE] = params.temperature
            attrs[A.REQUEST_TOP_P] = params.top_p
            attrs[A.REQUEST_N] = params.n
            if params.max_tokens is not None:
                attrs[A.REQUEST_MAX_TOKENS] = params.max_tokens
        if met.first_scheduled_time is not None:
            attrs[A.LATENCY_TIME_IN_QUEUE] = met.first_scheduled_time - met.arrival_time
        if met.first_token_time is not None:
            attrs[A.LATENCY_TIME_TO_FIRST_TOKEN] = met.first_token_time - met.arrival_time
            if met.first_scheduled_time is not None:
                attrs[A.LATENCY_TIME_IN_MODEL_PREFILL] = met.first_token_time - met.first_scheduled_time
                attrs[A.LATENCY_TIME_IN_MODEL_INFERENCE] = end - met.first_scheduled_time
            attrs[A.LATENCY_TIME_IN_MODEL_DECODE] = (met.last_token_time or met.first_token_time) - met.first_token_time
        span = self.tracer.start_span(
            SPAN_NAME, context=ctx, kind=self._kind, attributes=attrs, start_time=int(met.arrival_time * 1e9)
        )
        if out.error:
            span.set_status(self._status(self._error, str(out.error)))
        span.end(end_time=int(max(end, met.arrival_time) * 1e9))

    def shutdown(self) -> None:
        """Export what is still queued, then stop the exporter's thread."""
        self.provider.shutdown()


def make_tracer(endpoint: str | None) -> RequestTracer | None:
    """The tracer of --otlp-traces-endpoint (None without one); a ValueError without OpenTelemetry."""
    return RequestTracer(endpoint) if endpoint else None
