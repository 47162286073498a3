"""Fault injection with real processes on loopback: `llmserve route` (the CLI) in front of two
fake backend processes; one is SIGKILLed while 40 requests run, then started again.

The same scenario with two real `llmserve serve` replicas is in test_router_e2e.py; this one
needs no model and runs in seconds."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import httpx
import openai
import pytest

from llmserve.bench.sse import iter_sse
from llmserve.testing.launcher import FAKE, ROUTE, ServerProcess, free_port, wait_until

pytestmark = pytest.mark.timeout(120)

HEALTH_INTERVAL = 0.5


def fake(port: int, tmp_path, itl: float = 0.02) -> ServerProcess:
    return ServerProcess(
        "--model", "m", "--itl", str(itl), cmd=FAKE, port=port, log_path=str(tmp_path / f"fake-{port}.log")
    )


@pytest.fixture
def fleet(tmp_path):
    ports = [free_port(), free_port()]
    rport = free_port()
    procs = {}
    try:
        for p in ports:
            procs[p] = fake(p, tmp_path)
        for p in ports:
            procs[p].wait_ready(30)
        router = ServerProcess(
            "--backend",
            f"http://127.0.0.1:{ports[0]}",
            "--backend",
            f"http://127.0.0.1:{ports[1]}",
            "--policy",
            "least_outstanding",
            "--max-retries",
            "2",
            "--health-interval",
            str(HEALTH_INTERVAL),
            "--unhealthy-threshold",
            "2",
            "--log-level",
            "warning",
            cmd=ROUTE,
            port=rport,
            log_path=str(tmp_path / "router.log"),
        )
        procs["router"] = router.wait_ready(30)
        yield procs, ports, router.url, tmp_path
    finally:
        for p in procs.values():
            p.stop()


def backends(router_url: str) -> dict[str, dict]:
    return {b["url"]: b for b in httpx.get(router_url + "/router/backends").json()["backends"]}


def test_sigkill_one_backend_during_40_requests(fleet):
    procs, ports, router_url, tmp_path = fleet
    victim_url = f"http://127.0.0.1:{ports[0]}"
    client = openai.OpenAI(base_url=router_url + "/v1", api_key="x", max_retries=0, timeout=60)
    started = threading.Event()
    results = []

    def one(i: int):
        stream = i % 2 == 0
        first_byte_from = None
        try:
            if stream:
                rsp = client.chat.completions.with_raw_response.create(
                    model="m", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=30, stream=True
                )
                first_byte_from = rsp.headers["x-llmserve-backend"]
                text = "".join(c.choices[0].delta.content or "" for c in rsp.parse() if c.choices)
            else:
                out = client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=30
                )
                text = out.choices[0].message.content
            ok = text == " ".join(f"tok{k}" for k in range(30))
            results.append((i, stream, first_byte_from, ok, None))
        except openai.APIError as e:
            results.append((i, stream, first_byte_from, False, e))
        finally:
            started.set()

    with cf.ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(one, i) for i in range(40)]
        # kill the victim while requests are in flight on it
        assert wait_until(lambda: backends(router_url)[victim_url]["outstanding"] >= 2, timeout=20)
        t_kill = time.monotonic()
        procs[ports[0]].kill()
        for f in futures:
            f.result(timeout=60)

    assert len(results) == 40
    failed = [r for r in results if not r[3]]
    # every request that had not started streaming succeeded (retried on the other backend);
    # the only failures are streams already under way on the killed backend (never replayed)
    for i, stream, first_from, _ok, err in failed:
        assert stream and first_from == victim_url, (i, stream, first_from, err)
    assert all(ok for _, stream, _, ok, _ in results if not stream)
    assert len(failed) < 10

    # ejected within the health interval (passive ejection usually makes it immediate)
    assert wait_until(lambda: not backends(router_url)[victim_url]["healthy"], timeout=2 * HEALTH_INTERVAL + 1)
    assert time.monotonic() - t_kill < 2 * HEALTH_INTERVAL + 10
    m = httpx.get(router_url + "/metrics").text
    assert f'llmserve_router:ejections_total{{backend="{victim_url}"' in m

    # restarted on the same port: re-admitted, and takes traffic again
    procs[ports[0]] = fake(ports[0], tmp_path).wait_ready(30)
    assert wait_until(lambda: backends(router_url)[victim_url]["healthy"], timeout=10)
    seen = set()
    for i in range(8):
        rsp = httpx.post(
            router_url + "/v1/completions", json={"model": "m", "prompt": str(i), "max_tokens": 2}, timeout=30
        )
        assert rsp.status_code == 200
        seen.add(rsp.headers["x-llmserve-backend"])
    assert victim_url in seen
    m = httpx.get(router_url + "/metrics").text
    assert f'llmserve_router:readmissions_total{{backend="{victim_url}"}} 1.0' in m


def test_stream_cut_mid_way_is_not_replayed(fleet):
    """A stream under way when its backend dies ends with an OpenAI error event; the router
    does not resend it to the other backend."""
    procs, ports, router_url, tmp_path = fleet
    with httpx.stream(
        "POST",
        router_url + "/v1/completions",
        timeout=30,
        json={"model": "m", "prompt": "long", "max_tokens": 500, "stream": True},
    ) as s:
        victim = s.headers["x-llmserve-backend"]
        events = iter_sse(s.iter_bytes())
        assert next(events).json()["choices"]
        victim_port = int(victim.rsplit(":", 1)[1])
        procs[victim_port].kill()
        rest = list(events)
    other = procs[ports[1] if victim_port == ports[0] else ports[0]]
    assert "error" in rest[-1].json() and not any(e.done for e in rest)
    stats = httpx.get(other.url + "/_stats").json()
    assert stats["requests"] == 0  # not replayed on the surviving backend
