"""The router's Prometheus metrics (`GET /metrics` on the router), vLLM-style names.

One registry per router instance, so several routers can live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

disable_created_metrics()  # no *_created series (as vLLM does)

P = "llmserve_router:"

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RouterMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            P + "requests",
            "Requests answered, by backend and HTTP status (backend 'none' when the router answered itself)",
            ["backend", "status"],
            registry=r,
        )
        self.retries = Counter(
            P + "retries",
            "Attempts retried on another backend, by the backend that failed and why",
            ["backend", "reason"],
            registry=r,
        )
        self.ejections = Counter(
            P + "ejections",
            "Backends ejected from routing, by reason (active: failed health checks; passive: connection errors)",
            ["backend", "reason"],
            registry=r,
        )
        self.readmissions = Counter(P + "readmissions", "Ejected backends admitted again", ["backend"], registry=r)
        self.in_flight = Gauge(P + "in_flight_requests", "Requests in flight per backend", ["backend"], registry=r)
        self.healthy = Gauge(P + "backend_healthy", "1 if the backend takes requests", ["backend"], registry=r)
        self.decisions = Counter(
            P + "routing_decisions",
            "Routing decisions by policy and reason (cache_hit, cache_miss, balance, session, length, ...)",
            ["policy", "reason"],
            registry=r,
        )
        self.queued = Gauge(P + "queued_requests", "Requests waiting at the router for a backend with room", registry=r)
        self.rejected = Counter(
            P + "rejected_requests", "Requests the router refused, by reason", ["reason"], registry=r
        )
        self.client_disconnects = Counter(
            P + "client_disconnects",
            "Requests whose client went away before the end (the backend request is aborted)",
            registry=r,
        )
        self.stream_errors = Counter(
            P + "stream_errors",
            "Streams cut by a backend failure after the first byte (never replayed)",
            ["backend"],
            registry=r,
        )
        self.overhead = Histogram(
            P + "proxy_overhead_seconds",
            "Time the router adds before the request leaves for a backend (parse, route), excluding queueing",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.queue_time = Histogram(
            P + "queue_time_seconds", "Time waiting for a backend with room", registry=r, buckets=_LATENCY_BUCKETS
        )
        self.ttfb = Histogram(
            P + "time_to_first_byte_seconds",
            "From request arrival to the first byte sent to the client",
            ["backend"],
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.duration = Histogram(
            P + "request_duration_seconds",
            "From request arrival to the last byte",
            ["backend"],
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.backend_load = Gauge(
            P + "backend_scraped_load",
            "Load read from the backend's /metrics (running, waiting, kv_usage)",
            ["backend", "kind"],
            registry=r,
        )

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
