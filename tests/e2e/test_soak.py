"""Short soak in CI (issue #8): benchmarks/soak.py's mix at 200 requests. The full run (2,000) is
`python benchmarks/soak.py`; its figures are in BENCHMARKS.md and docs/reliability.md."""
from __future__ import annotations

import os

import pytest

from benchmarks.soak import run_soak
from tests.server_proc import ServerProcess

# Written against a shared machine that stayed in benchmark quiet mode: not yet run. Enable with
# LLMSERVE_RELIABILITY_TESTS=1 until they have been verified (see docs/reliability.md, "Status").
pytestmark = pytest.mark.skipif(os.environ.get("LLMSERVE_RELIABILITY_TESTS") != "1",
                                reason="issue #8 reliability tests: not yet verified; set LLMSERVE_RELIABILITY_TESTS=1")


def test_short_soak_loses_nothing_and_leaks_no_blocks():
    srv = ServerProcess("--scheduling-policy", "priority", "--max-num-seqs", "16", "--max-model-len", "512",
                        "--kv-cache-memory", "0.25")
    try:
        srv.wait_ready()
        res = run_soak(srv.url, srv.proc.pid, n=200, concurrency=16, seed=1)
        print("\nsoak:", res)
        assert res["accounted"] == 200
        assert res["lost"] == 0, res["lost_examples"]
        assert res["complete"] > 100 and res["bad_rejected"] > 5 and res["abandoned"] > 10
        assert res["kv_cache_usage_end"] == 0 and res["running_end"] == 0 and res["waiting_end"] == 0
        # RSS flat after warm-up: the second half's peak within 64 MiB of the first half's
        assert res["rss_warm_second_half_peak_mib"] <= res["rss_warm_first_half_peak_mib"] + 64, res
        assert srv.proc.poll() is None
    finally:
        srv.kill()
