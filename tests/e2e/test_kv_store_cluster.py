"""The shared KV store on a real Redis Cluster (`--kv-cache-url redis+cluster://`, three primaries of Debian's
redis-server, two real `llmserve serve` replicas of the bundled model): replica B answers the prompt replica A
computed from the cluster with the same greedy text, A's blocks spread over the nodes by hash slot; a node
killed during a run fails no request (the breaker opens), and back, the store is used again."""

from __future__ import annotations

import pytest
import redis

from llmserve.testing.launcher import ServerProcess, wait_until
from tests.e2e.test_kv_store_server import FLAGS, TEXT, M, _complete, _settled, a_computed_the_prompt

pytestmark = pytest.mark.timeout(900)


def _sizes(cluster) -> list[int]:
    return [node.client().dbsize() for node in cluster.nodes]


def test_replica_b_reads_what_a_computed_from_a_cluster_spread_over_its_nodes(redis_cluster):
    with a_computed_the_prompt(redis_cluster.url) as (a, b, cold, n_prompt, written):
        sizes = _sizes(redis_cluster)
        assert sum(sizes) == n_prompt // 16, sizes  # one key per full block, each on the node of its slot
        assert sum(1 for n in sizes if n > 0) >= 2, sizes  # keys of one prompt land on several primaries
        for node in redis_cluster.nodes:  # and each on the node that owns its slot (no key a node refuses)
            c = node.client()
            for key in c.scan_iter(match=b"llmserve:kv:*"):
                assert c.execute_command("CLUSTER", "KEYSLOT", key) in _owned_slots(c)

        shared = _complete(b, TEXT)  # B never saw the prompt: its blocks come from the cluster
        assert shared["choices"][0]["text"] == cold["choices"][0]["text"]
        m = b.metrics()
        assert m[M + "kv_remote_hits_total"] == (n_prompt - 1) // 16 * 16
        assert m[M + "kv_remote_breaker_state"] == 0
        assert m[M + "kv_remote_corrupt_blocks_total"] == 0
        assert m[M + "kv_remote_errors_total"] == 0


def _owned_slots(client: redis.Redis) -> set[int]:
    me = client.execute_command("CLUSTER", "MYID").decode()
    owned: set[int] = set()
    for start, end, *nodes in client.execute_command("CLUSTER", "SLOTS"):
        if any(n[2].decode() == me for n in nodes[:1]):
            owned.update(range(start, end + 1))
    return owned


def test_a_cluster_node_killed_fails_no_request_and_back_is_used_again(redis_cluster):
    with ServerProcess(*FLAGS, "--kv-cache-url", redis_cluster.url, "--kv-cache-url-timeout", "0.3") as a:
        a.wait_ready()
        _complete(a, "Warm the cluster. " + TEXT[:1500], 2)
        _settled(a)
        victim = redis_cluster.nodes[1]
        victim.kill()  # its slots' keys are gone; calls to it are refused
        for i in range(3):
            got = _complete(a, f"Prompt {i} with a node down. " + TEXT[i * 200 :], 4)
            assert got["usage"]["completion_tokens"] == 4
        assert wait_until(lambda: a.metrics()[M + "kv_remote_breaker_state"] == 1, timeout=60, interval=0.5)
        assert a.log().count("breaker open") == 1

        victim.start()  # the same port and nodes.conf: it rejoins, the writer's probe closes the breaker
        assert wait_until(lambda: a.metrics()[M + "kv_remote_breaker_state"] == 0, timeout=120, interval=0.5)
        assert "reachable again" in a.log()
        before = a.metrics()[M + "kv_remote_bytes_written_total"]
        _complete(a, "A new prompt after the node came back. " + TEXT[:900], 2)
        written = wait_until(lambda: a.metrics()[M + "kv_remote_bytes_written_total"] > before, timeout=60)
        assert written, a.log()[-3000:]
