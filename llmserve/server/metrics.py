"""Prometheus metrics, named like vLLM's under an `llmserve:` prefix so dashboards carry over.

Engine state (running, waiting, KV usage, prefix-cache counters, preemptions) is read from the engine
at scrape time; request figures (TTFT, ITL, latency, tokens, outcomes) are recorded as requests go.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.process_collector import ProcessCollector

P = "llmserve:"
LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
)
RECENT_WINDOW = 60.0  # seconds of TTFT/ITL samples kept for /stats percentiles
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


KV_DISK_DOCS = {
    "external_prefix_cache_queries": "Prompt tokens looked up in the disk tier (after a miss in RAM).",
    "external_prefix_cache_hits": "Prompt tokens loaded from the disk tier instead of computed.",
    "kv_disk_bytes_read": "Bytes of KV blocks read from the disk tier.",
    "kv_disk_bytes_written": "Bytes of KV blocks written to the disk tier.",
    "kv_disk_load_seconds": "Seconds spent looking up and loading blocks from the disk tier.",
    "kv_disk_corrupt_files": "Disk tier files that did not check out (their blocks were recomputed).",
    "kv_disk_dropped_writes": "Blocks not written because the writer was too far behind.",
    # --kv-cache-url (kv_remote.py)
    "kv_remote_queries": "Prompt tokens looked up in the shared KV store (after a miss in RAM and on disk).",
    "kv_remote_hits": "Prompt tokens loaded from the shared KV store instead of computed.",
    "kv_remote_misses": "Prompt tokens looked up in the shared KV store and not loaded from it.",
    "kv_remote_bytes_read": "Bytes of KV blocks read from the shared KV store.",
    "kv_remote_bytes_written": "Bytes of KV blocks written to the shared KV store.",
    "kv_remote_errors": "Calls to the shared KV store that failed (timeout, refused, wrong password).",
    "kv_remote_corrupt_blocks": "Store entries that did not check out (another model's, torn): recomputed.",
    "kv_remote_dropped_writes": "Blocks not sent to the store (writer behind, or the breaker open).",
    "kv_remote_refused_writes": "Blocks the store refused (full: maxmemory with noeviction).",
    "kv_remote_skipped_fetches": "Look-ups not fetched: the run was too short to beat recomputing it.",
    "kv_remote_breaker_state": "The store's circuit breaker: 0 closed (used), 1 open (not asked), 2 half-open.",
    "kv_remote_min_fetch_blocks": "The shortest run of blocks worth fetching now (-1: none is).",
    "kv_remote_fetch_seconds": "Time of a look-up in the shared KV store (read, check, copy into the pool).",
}
KV_TIER_GAUGES = ("kv_remote_breaker_state", "kv_remote_min_fetch_blocks")


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
        yield counter(
            "spec_decode_num_drafts", "Speculative verifications (per request and step).", s.spec_decode_num_drafts
        )
        yield counter(
            "spec_decode_num_draft_tokens",
            "Speculative tokens proposed (n-gram or draft model).",
            s.spec_decode_num_draft_tokens,
        )
        yield counter(
            "spec_decode_num_accepted_tokens",
            "Speculative tokens accepted by verification.",
            s.spec_decode_num_accepted_tokens,
        )
        for name, value in (s.kv_disk or {}).items():  # --kv-cache-dir, --kv-cache-url
            if isinstance(value, tuple):  # (bucket bounds, counts per bucket, sum): a histogram
                yield _histogram(P + name, KV_DISK_DOCS[name], labels, v, *value)
            elif name in KV_TIER_GAUGES:
                yield gauge(name, KV_DISK_DOCS[name], value)
            else:
                yield counter(name, KV_DISK_DOCS[name], value)
        info = GaugeMetricFamily(
            P + "cache_config_info",
            "KV cache configuration (labels; the value is 1).",
            labels=labels + ["block_size", "cache_dtype", "enable_prefix_caching", "num_blocks"],
        )
        info.add_metric(v + [str(s.block_size), s.cache_dtype, str(s.enable_prefix_caching), str(s.num_blocks)], 1)
        yield info
        if s.max_lora is not None:  # --enable-lora: as vLLM's vllm:lora_requests_info (the value: the time)
            lora = GaugeMetricFamily(
                P + "lora_requests_info",
                "LoRA adapters of running and waiting requests.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            lora.add_metric(
                [str(s.max_lora), ",".join(s.waiting_lora_adapters), ",".join(s.running_lora_adapters)], time.time()
            )
            yield lora
        yield from _cuda_metrics(labels, v)


def _histogram(name, doc, labels, values, bounds, counts, total):
    h = HistogramMetricFamily(name, doc, labels=labels)
    cumulative, buckets = 0, []
    for bound, n in zip((*map(str, bounds), "+Inf"), counts):
        cumulative += n
        buckets.append((bound, cumulative))
    h.add_metric(values, buckets, total)
    return h


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
            util = torch.cuda.utilization()  # NVML
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
        self.get_stats = get_stats
        self.recent: deque = deque(maxlen=50000)  # (time, is_ttft, seconds) for /stats percentiles
        self.tokens_streamed = 0  # output tokens as they reach the server (live rate)
        self._proc = None
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        r.register(_EngineCollector(get_stats, model_name))
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed.", lab, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", lab, registry=r)
        self.request_success = Counter(
            P + "request_success", "Requests finished, by finish reason.", lab + ["finished_reason"], registry=r
        )
        self.request_errors = Counter(
            P + "request_errors", "Requests that failed, by kind.", lab + ["kind"], registry=r
        )
        self.ttft = Histogram(
            P + "time_to_first_token_seconds", "Time to first token.", lab, buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            P + "inter_token_latency_seconds", "Time between output tokens.", lab, buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds",
            "Request latency, arrival to finish.",
            lab,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            P + "request_queue_time_seconds",
            "Time waiting before first scheduled.",
            lab,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_len = Histogram(
            P + "request_prompt_tokens", "Prompt length of requests.", lab, buckets=TOKEN_BUCKETS, registry=r
        )
        self.gen_len = Histogram(
            P + "request_generation_tokens", "Output length of requests.", lab, buckets=TOKEN_BUCKETS, registry=r
        )
        self.http_requests = Counter(
            P + "http_requests", "HTTP requests by route and status.", ["route", "status"], registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- per request ---------------------------------------------------------------------------
    def token_times(self, arrival: float, times: list[float]) -> None:
        """Record TTFT (first) and ITL (gaps) from the times output tokens reached the server."""
        m = self.model_name
        if times:
            now = time.time()
            self.ttft.labels(m).observe(times[0] - arrival)
            self.recent.append((now, True, times[0] - arrival))
            for a, b in zip(times, times[1:]):
                self.itl.labels(m).observe(b - a)
                self.recent.append((now, False, b - a))

    def stats(self) -> dict:
        """A JSON snapshot for the web page (`GET /stats`): engine state, counters, TTFT/ITL
        percentiles over the last minute, process CPU seconds and resident memory."""
        s = self.get_stats()
        now = time.time()
        while self.recent and self.recent[0][0] < now - RECENT_WINDOW:
            self.recent.popleft()
        ttft = sorted(v for _, first, v in self.recent if first)
        itl = sorted(v for _, first, v in self.recent if not first)
        cpu = rss = None
        try:
            import psutil

            self._proc = self._proc or psutil.Process()
            t = self._proc.cpu_times()
            cpu, rss = t.user + t.system, self._proc.memory_info().rss
        except Exception:  # noqa: BLE001 - psutil missing or unsupported: leave them out
            pass
        out = {
            "time": now,
            "model": self.model_name,
            "generation_tokens": self.tokens_streamed,
            "ttft": _percentiles(ttft),
            "itl": _percentiles(itl),
            "process_cpu_seconds": cpu,
            "process_resident_memory_bytes": rss,
        }
        if s is not None:
            out.update(
                num_requests_running=s.num_running,
                num_requests_waiting=s.num_waiting,
                num_requests_preempted=s.num_preempted,
                kv_cache_usage=s.kv_cache_usage,
                prefix_cache_queries=s.prefix_cache_queries,
                prefix_cache_hits=s.prefix_cache_hits,
                num_preemptions=s.num_preemptions,
                engine_steps=s.steps,
                running_lora_adapters=list(s.running_lora_adapters),
                waiting_lora_adapters=list(s.waiting_lora_adapters),
            )
            tiers = s.kv_disk or {}
            if "kv_remote_queries" in tiers:  # --kv-cache-url: the dashboard's shared-store card
                out["kv_remote"] = {
                    k.removeprefix("kv_remote_"): v for k, v in tiers.items() if k.startswith("kv_remote_")
                }
                out["kv_remote"].pop("fetch_seconds")
        return out

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


def render_merged(metrics: list[ServerMetrics]) -> bytes:
    """One exposition of several models' metrics (--models-dir): each family once, with every model's samples
    (told apart by their `model_name` label); the process' own families from the first only."""
    families: dict = {}
    for m in metrics:
        for fam in m.registry.collect():
            if fam.name not in families:
                families[fam.name] = fam
            elif not fam.name.startswith(("process_", "python_")):
                families[fam.name].samples.extend(fam.samples)

    class _Merged:
        def collect(self):
            return list(families.values())

    return generate_latest(_Merged())


def _percentiles(sorted_values: list[float]) -> dict:
    n = len(sorted_values)
    if not n:
        return {"n": 0, "p50": None, "p90": None, "p99": None}
    pick = lambda q: sorted_values[min(n - 1, int(q * n))]  # noqa: E731
    return {"n": n, "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}
