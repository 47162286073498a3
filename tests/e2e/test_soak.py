"""Short soak in CI (issue #8): benchmarks/serving/soak.py's mix (10% malformed requests, 20% of clients
disconnecting at random moments, random priorities), 2 x 200 requests of 4-48 output tokens: long enough that a
good share of the disconnecting clients leave mid-request whatever the machine's speed (with 4-16 tokens, once
16-row decode steps got faster, only 8 of ~60 left before their answer was done). The full run
(2,000) is `python -m benchmarks.serving.soak`; its figures are in BENCHMARKS.md and docs/reliability.md.

RSS climbs for the first few hundred requests on CPU (the allocator meeting new batch shapes; 904 ->
1,218 MiB in the first 400 of the full run, then +3 MiB over the next 1,600): too early for a flatness
figure here, which the full run gives. This test holds RSS under the stated bound (weights + KV budget +
runtime allowance) at every sample, and round 2 within 160 MiB of round 1, a coarse guard that a leak
of about 1 MB per request would trip."""

from __future__ import annotations

import httpx

from benchmarks.serving.soak import run_soak
from llmserve.testing.launcher import ServerProcess
from tests.e2e.test_overload_faults import memory_bound

N = 200


def _check(res: dict) -> None:
    assert res["accounted"] == N
    assert res["lost"] == 0, res["lost_examples"]
    assert res["complete"] > N // 2 and res["bad_rejected"] > 5 and res["abandoned"] > 10, res
    # no leaked blocks: back to idle once the last request (or its abort) is done
    assert res["kv_cache_usage_end"] == 0 and res["running_end"] == 0 and res["waiting_end"] == 0, res


def test_short_soak_loses_nothing_and_leaks_no_blocks():
    srv = ServerProcess(
        "--scheduling-policy", "priority", "--max-num-seqs", "16", "--max-model-len", "512", "--kv-cache-memory", "0.25"
    )
    try:
        srv.wait_ready()
        first = run_soak(srv.url, srv.proc.pid, n=N, concurrency=16, seed=1, max_tokens=48)
        print("\nsoak, round 1:", first)
        _check(first)
        second = run_soak(srv.url, srv.proc.pid, n=N, concurrency=16, seed=2, max_tokens=48)
        print("soak, round 2:", second)
        _check(second)
        bound = memory_bound(srv) / 2**20
        assert max(first["rss_peak_mib"], second["rss_peak_mib"]) < bound, (bound, first, second)
        assert second["rss_peak_mib"] <= first["rss_peak_mib"] + 160, (first, second)
        assert httpx.get(srv.url + "/ready", timeout=5).status_code == 200
        assert srv.proc.poll() is None
    finally:
        srv.kill()
