"""The disk tier through real servers (`llmserve serve --kv-cache-dir`, the bundled model): a replica
started beside the first one, and the first one restarted, both load a long prompt's KV from the shared
folder (disk hits in /metrics) and answer the same greedy text as the replica that computed it."""

from __future__ import annotations

import os

import httpx
import pytest

from llmserve.testing.launcher import ServerProcess, wait_until

pytestmark = pytest.mark.timeout(600)

TEXT = open(os.path.join(os.path.dirname(__file__), "..", "data", "alice.txt")).read()
FLAGS = ["--num-threads", "1", "--max-model-len", "2048", "--num-kv-blocks", "128", "--log-level", "warning"]
HITS = "llmserve:external_prefix_cache_hits_total"
WRITTEN = "llmserve:kv_disk_bytes_written_total"


def _complete(srv: ServerProcess) -> dict:
    r = httpx.post(
        srv.url + "/v1/completions",
        json={"prompt": TEXT, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _written_settles(srv: ServerProcess) -> float:
    """Bytes written once the writer has caught up (the figure stops moving)."""
    last = [-1.0]

    def settled() -> bool:
        now = srv.metrics().get(WRITTEN, 0.0)
        done = now > 0 and now == last[0]
        last[0] = now
        return done

    assert wait_until(settled, timeout=60, interval=0.5)
    return last[0]


def test_a_second_replica_and_a_restart_load_the_prompt_from_disk(tmp_path):
    folder = str(tmp_path / "kv")
    flags = [*FLAGS, "--kv-cache-dir", folder]
    with ServerProcess(*flags) as first, ServerProcess(*flags) as second:
        first.wait_ready()
        second.wait_ready()
        cold = _complete(first)
        n_prompt = cold["usage"]["prompt_tokens"]
        assert n_prompt > 500
        assert first.metrics().get(HITS, 0.0) == 0
        written = _written_settles(first)
        assert written >= (n_prompt // 16) * 30 * 2 * 16 * 3 * 64 * 4  # every full block, float32

        shared = _complete(second)  # never saw the prompt: it reads what the first one wrote
        assert shared["choices"][0]["text"] == cold["choices"][0]["text"]
        assert second.metrics()[HITS] == (n_prompt - 1) // 16 * 16
        assert second.metrics().get(WRITTEN, 0.0) == 0  # nothing new to write
    with ServerProcess(*flags) as restarted:
        restarted.wait_ready()
        again = _complete(restarted)
        m = restarted.metrics()
        assert again["choices"][0]["text"] == cold["choices"][0]["text"]
        assert m[HITS] == (n_prompt - 1) // 16 * 16
        assert m["llmserve:kv_disk_bytes_read_total"] >= written
        assert m["llmserve:kv_disk_corrupt_files_total"] == 0
