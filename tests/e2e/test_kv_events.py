"""GET /kv_events (--kv-events-config) on real servers, and the router's cache_aware policy reading them:
two replicas of the bundled model behind `llmserve route`; a prompt is routed to the replica that holds
it, and once that replica has evicted it (other prompts sent to it directly took its small pool), the
router no longer routes the prompt there, though its guessed prefix tree still would."""

from __future__ import annotations

import os

import httpx
import pytest

from llmserve.bench.scrape import parse_prometheus
from llmserve.engine.kv_events import chain_digests
from llmserve.testing.launcher import ROUTE, ServerProcess, wait_until

pytestmark = pytest.mark.timeout(600)

ALICE = open(os.path.join(os.path.dirname(__file__), "..", "data", "alice.txt")).read()
PROMPT = ALICE[:1200]
EVENTS = '{"enable_kv_cache_events": true}'
FLAGS = ["--num-threads", "1", "--max-model-len", "512", "--num-kv-blocks", "48", "--log-level", "warning"]


def _complete(url: str, prompt: str) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _decisions(router: ServerProcess) -> dict[str, float]:
    m = parse_prometheus(httpx.get(router.url + "/metrics", timeout=5).text, labelled=True)
    out: dict[str, float] = {}
    for key, value in m.items():
        if key.startswith("llmserve_router:routing_decisions_total{"):
            reason = key.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + value
    return out


def _backend(router: ServerProcess, url: str) -> dict:
    return next(b for b in httpx.get(router.url + "/router/backends", timeout=5).json()["backends"] if b["url"] == url)


def _served_by(srv: ServerProcess) -> float:
    return srv.metrics().get("llmserve:prefix_cache_queries_total", 0.0)


def test_the_endpoint_answers_events_and_bad_input(tmp_path):
    with ServerProcess(*FLAGS, "--kv-events-config", EVENTS) as on, ServerProcess(*FLAGS) as off:
        on.wait_ready()
        off.wait_ready()
        assert httpx.get(off.url + "/kv_events").status_code == 404
        first = httpx.get(on.url + "/kv_events", params={"after": -1}).json()
        assert first["reset"] and first["events"][1]["block_hashes"] == [] and first["block_size"] == 16
        _complete(on.url, PROMPT)
        body = httpx.get(on.url + "/kv_events", params={"after": first["seq"]}).json()
        assert not body["reset"] and body["seq"] > first["seq"]
        stored = [h for e in body["events"] if e["type"] == "BlockStored" for h in e["block_hashes"]]
        tokens = httpx.post(on.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
        assert [d.hex() for d in chain_digests(tokens, 16)] == stored[: len(tokens) // 16]
        bad = httpx.get(on.url + "/kv_events", params={"after": "x"})
        assert bad.status_code in (400, 422) and "error" in bad.json()
    with pytest.raises(RuntimeError, match="kv_events_config"):
        ServerProcess(*FLAGS, "--kv-events-config", "{bad json").wait_ready(120)


def test_a_prefix_evicted_on_a_replica_is_no_longer_routed_there(tmp_path):
    procs: list[ServerProcess] = []
    try:
        a = ServerProcess(*FLAGS, "--kv-events-config", EVENTS)
        b = ServerProcess(*FLAGS, "--kv-events-config", EVENTS)
        procs += [a, b]
        a.wait_ready()
        b.wait_ready()
        router = ServerProcess(
            "--backend", a.url, "--backend", b.url, "--policy", "cache_aware", "--kv-events-interval", "0.2",
            "--health-interval", "0.5", "--log-level", "warning", cmd=ROUTE,
        )  # fmt: skip
        procs.append(router)
        router.wait_ready(60)
        assert wait_until(lambda: all(_backend(router, s.url)["kv_blocks"] == 0 for s in (a, b)), timeout=30)

        _complete(router.url, PROMPT)
        x, y = (a, b) if _served_by(a) else (b, a)
        assert _decisions(router) == {"cache_miss": 1}
        assert wait_until(lambda: _backend(router, x.url)["kv_blocks"] >= 15, timeout=30)
        _complete(router.url, PROMPT)
        assert _decisions(router) == {"cache_miss": 1, "cache_hit": 1}
        assert _served_by(y) == 0  # both went to x

        # x's pool (48 blocks) is taken by three other prompts sent to it directly: the prompt's blocks go
        for i in range(3):
            _complete(x.url, ALICE[::-1][600 * i : 600 * (i + 1)])
        tokens = httpx.post(x.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
        first_block = chain_digests(tokens, 16)[0].hex()
        seq = httpx.get(x.url + "/kv_events", params={"after": 0}).json()["seq"]
        snapshot = httpx.get(x.url + "/kv_events", params={"after": -1}).json()["events"][1]["block_hashes"]
        assert first_block not in snapshot
        assert wait_until(lambda: _backend(router, x.url)["kv_events_seq"] >= seq, timeout=30)

        _complete(router.url, PROMPT)  # the tree still says x; the events say x no longer holds it
        assert _decisions(router) == {"cache_miss": 2, "cache_hit": 1}
    finally:
        for p in procs:
            p.stop()
