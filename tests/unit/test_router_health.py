"""Health checks and metrics scraping against httpx mock transports: no network, no clock."""

from __future__ import annotations

import asyncio

import httpx

from llmserve.router.discovery import Registry
from llmserve.router.health import HealthChecker, parse_load_metrics
from llmserve.router.metrics import RouterMetrics
from llmserve.router.policies import Backend

METRICS_PAGE = """\
# HELP llmserve:num_requests_running Requests running
# TYPE llmserve:num_requests_running gauge
llmserve:num_requests_running{model_name="m"} 3.0
llmserve:num_requests_waiting{model_name="m"} 2.0
llmserve:kv_cache_usage_perc{model_name="m"} 0.25
llmserve:prefix_cache_hits_total{model_name="m"} 10
vllm:num_requests_running{model_name="other"} 1
"""


def test_parse_load_metrics_sums_label_sets_and_knows_vllm_names():
    assert parse_load_metrics(METRICS_PAGE) == {"running": 4.0, "waiting": 2.0, "kv_usage": 0.25}
    assert parse_load_metrics("garbage\n# only comments") == {}


class FakeFleet:
    """A mock transport: each backend's answer to /ready is set by the test."""

    def __init__(self):
        self.ready: dict[str, object] = {}  # host -> status code, or "refuse"

    def handler(self, request: httpx.Request) -> httpx.Response:
        state = self.ready.get(request.url.host, 200)
        if state == "refuse":
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/ready":
            return httpx.Response(state)
        if request.url.path == "/v1/models":
            return httpx.Response(
                200, json={"object": "list", "data": [{"id": f"model-{request.url.host}", "object": "model"}]}
            )
        if request.url.path == "/metrics":
            return httpx.Response(200, text=METRICS_PAGE)
        return httpx.Response(404)


def make(n=2, **kw):
    fleet = FakeFleet()
    reg = Registry()
    for i in range(n):
        reg.add(Backend(url=f"http://b{i}:8000"))
    client = httpx.AsyncClient(transport=httpx.MockTransport(fleet.handler))
    changes = []
    hc = HealthChecker(reg, client, RouterMetrics(), on_change=lambda: changes.append(1), **kw)
    return fleet, reg, hc, changes


def run(coro):
    return asyncio.run(coro)


def test_first_check_admits_and_reads_models():
    fleet, reg, hc, changes = make()
    fleet.ready["b1"] = 503
    run(hc.check_all())
    b0, b1 = reg.get("http://b0:8000"), reg.get("http://b1:8000")
    assert b0.healthy and b0.models == {"model-b0"}
    assert not b1.healthy and "503" in b1.ejected_reason
    assert len(changes) == 1


def test_ejected_after_n_failures_in_a_row_and_readmitted():
    fleet, reg, hc, _ = make(unhealthy_threshold=3, healthy_threshold=2)
    b0 = reg.get("http://b0:8000")
    run(hc.check_all())
    assert b0.healthy
    fleet.ready["b0"] = 500

    async def rounds(k):
        for _ in range(k):
            await hc.check_all()

    run(rounds(2))
    assert b0.healthy  # two failures: still in
    run(rounds(1))
    assert not b0.healthy  # the third ejects
    fleet.ready["b0"] = 200
    run(rounds(1))
    assert not b0.healthy  # one good check is not enough (threshold 2)
    run(rounds(1))
    assert b0.healthy
    assert hc.metrics.readmissions.labels(b0.url)._value.get() == 1
    assert hc.metrics.ejections.labels(b0.url, "active")._value.get() == 1


def test_refused_connection_ejects_at_once_and_passive_reports_eject():
    fleet, reg, hc, _ = make(unhealthy_threshold=5)
    b0, b1 = reg.get("http://b0:8000"), reg.get("http://b1:8000")
    run(hc.check_all())
    fleet.ready["b0"] = "refuse"
    run(hc.check_all())
    assert not b0.healthy and "unreachable" in b0.ejected_reason
    hc.report_failure(b1, httpx.ConnectError("reset"))
    assert not b1.healthy
    assert hc.metrics.ejections.labels(b1.url, "passive")._value.get() == 1
    fleet.ready["b0"] = 200
    run(hc.check_all())
    assert b0.healthy and b1.healthy  # both come back through active checks


def test_scrape_metrics_sets_backend_load():
    fleet, reg, hc, _ = make(scrape_metrics=True)
    run(hc.check_all())
    b0 = reg.get("http://b0:8000")
    assert (b0.running, b0.waiting, b0.kv_usage) == (4.0, 2.0, 0.25)
    assert b0.load(use_metrics=True) == 6.0 and b0.load() == 0.0


def test_declared_models_are_kept():
    fleet, reg, hc, _ = make(n=0)
    reg.add(Backend(url="http://b9:8000", models={"mine"}, models_declared=True))
    run(hc.check_all())
    assert reg.get("http://b9:8000").models == {"mine"}
