"""Prometheus metrics, named like vLLM's under an `llmserve:` prefix so dashboards carry over.

Engine state (running, waiting, KV usage, prefix-cache counters, preemptions) is read from the engine
at scrape time; request figures (TTFT, ITL, latency, tokens, outcomes) are recorded as requests go.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector

P = "llmserve:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class _EngineCollector:
    """Gauges and counters read from the engine when /metrics is scraped."""

    def __init__(self, get_stats, model_name: str) -> None:
        self.get_stats = get_stats
        self.model_name = model_name

    def collect(self):
        s = self.get_stats()
        if s is None:
            return
        labels = ["model_name"]
        v = [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(P + name, doc, labels=labels)
            g.add_metric(v, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(P + name, doc, labels=labels)
            c.add_metric(v, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (preempted included).", s.num_waiting)
        yield gauge("num_requests_preempted", "Waiting requests that were preempted.", s.num_preempted)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks held by requests (0-1).", s.kv_cache_usage)
        yield gauge("kv_cache_num_blocks", "KV cache blocks in the pool.", s.num_blocks)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("num_preemptions", "Requests preempted (recomputed later) to free KV blocks.", s.num_preemptions)
        yield counter("engine_steps", "Engine steps run.", s.steps)
        yield from _cuda_metrics(labels, v)


def _cuda_metrics(labels, values):
    try:
        import torch
        if not torch.cuda.is_available():
            return
        g = GaugeMetricFamily(P + "gpu_memory_allocated_bytes", "GPU memory held by tensors.", labels=labels)
        g.add_metric(values, torch.cuda.memory_allocated())
        yield g
        g = GaugeMetricFamily(P + "gpu_memory_reserved_bytes", "GPU memory reserved by the allocator.", labels=labels)
        g.add_metric(values, torch.cuda.memory_reserved())
        yield g
        try:
            util = torch.cuda.utilization()   # NVML
            g = GaugeMetricFamily(P + "gpu_utilization_perc", "GPU utilisation (NVML, 0-100).", labels=labels)
            g.add_metric(values, util)
            yield g
        except Exception:  # noqa: BLE001 - NVML missing: report what we can
            pass
    except Exception:  # noqa: BLE001
        return


class ServerMetrics:
    def __init__(self, model_name: str, get_stats) -> None:
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        self.model_name = model_name
        ProcessCollector(registry=r)   # process_cpu_seconds_total, process_resident_memory_bytes, ...
        r.register(_EngineCollector(get_stats, model_name))
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed.", lab, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", lab, registry=r)
        self.request_success = Counter(P + "request_success", "Requests finished, by finish reason.",
                                       lab + ["finished_reason"], registry=r)
        self.request_errors = Counter(P + "request_errors", "Requests that failed, by kind.",
                                      lab + ["kind"], registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between output tokens.", lab,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Request latency, arrival to finish.", lab,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(P + "request_queue_time_seconds", "Time waiting before first scheduled.",
                                    lab, buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_len = Histogram(P + "request_prompt_tokens", "Prompt length of requests.", lab,
                                    buckets=TOKEN_BUCKETS, registry=r)
        self.gen_len = Histogram(P + "request_generation_tokens", "Output length of requests.", lab,
                                 buckets=TOKEN_BUCKETS, registry=r)
        self.http_requests = Counter(P + "http_requests", "HTTP requests by route and status.",
                                     ["route", "status"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- per request ---------------------------------------------------------------------------
    def token_times(self, arrival: float, times: list[float]) -> None:
        """Record TTFT (first) and ITL (gaps) from the times output tokens reached the server."""
        m = self.model_name
        if times:
            self.ttft.labels(m).observe(times[0] - arrival)
            for a, b in zip(times, times[1:]):
                self.itl.labels(m).observe(b - a)

    def finished(self, out, num_prompt_tokens: int) -> None:
        m = self.model_name
        comp = out.outputs[0]
        self.prompt_tokens.labels(m).inc(num_prompt_tokens)
        self.generation_tokens.labels(m).inc(len(comp.token_ids))
        self.prompt_len.labels(m).observe(num_prompt_tokens)
        self.gen_len.labels(m).observe(len(comp.token_ids))
        reason = comp.finish_reason or "abort"
        self.request_success.labels(m, reason).inc()
        met = out.metrics
        if met is not None:
            self.e2e.labels(m).observe((met.finished_time or time.time()) - met.arrival_time)
            if met.first_scheduled_time is not None:
                self.queue_time.labels(m).observe(met.first_scheduled_time - met.arrival_time)

    def error(self, kind: str) -> None:
        self.request_errors.labels(self.model_name, kind).inc()
