"""The shared KV store through real servers (`llmserve serve --kv-cache-url`, the bundled model, a real
redis-server): replica B answers the prompt replica A computed from the store (same greedy text, store hits
in /metrics); a corrupted entry and another model's entries are recomputed, never trusted; a store killed
during a run, a full store and a wrong password fail no request (the breaker opens, one log line)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
import redis

from llmserve.testing.launcher import ServerProcess, wait_until

pytestmark = pytest.mark.timeout(900)

TEXT = open(os.path.join(os.path.dirname(__file__), "..", "data", "alice.txt")).read()
FLAGS = ["--num-threads", "1", "--max-model-len", "2048", "--num-kv-blocks", "160", "--log-level", "warning"]
M = "llmserve:"


def _complete(srv: ServerProcess, prompt: str, max_tokens: int = 8) -> dict:
    r = httpx.post(
        srv.url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _settled(srv: ServerProcess, name: str = M + "kv_remote_bytes_written_total") -> float:
    """A counter once it stops moving (the writer has caught up)."""
    last = [-1.0]

    def still() -> bool:
        now = srv.metrics().get(name, 0.0)
        done = now > 0 and now == last[0]
        last[0] = now
        return done

    assert wait_until(still, timeout=60, interval=0.5), f"{name} never settled"
    return last[0]


def _keys(client) -> set[bytes]:
    return set(client.scan_iter(match=b"llmserve:kv:*"))


def _prefix(key: bytes) -> bytes:
    return key.rsplit(b":", 1)[0] + b":"


@contextmanager
def a_computed_the_prompt(url: str):
    """Replicas A and B on the store at `url`, A having computed TEXT and sent every full block:
    (A, B, A's answer, its prompt tokens, bytes A wrote)."""
    flags = [*FLAGS, "--kv-cache-url", url]
    with ServerProcess(*flags) as a, ServerProcess(*flags) as b:
        a.wait_ready()
        b.wait_ready()
        cold = _complete(a, TEXT)
        n_prompt = cold["usage"]["prompt_tokens"]
        assert n_prompt > 500
        assert a.metrics().get(M + "kv_remote_hits_total", 0) == 0
        written = _settled(a)
        assert written >= (n_prompt // 16) * 30 * 2 * 16 * 3 * 64 * 4  # every full block, float32
        yield a, b, cold, n_prompt, written


def test_replica_b_answers_what_a_computed_and_checks_every_entry(redis_store):
    client = redis.Redis.from_url(redis_store)
    client.flushdb()
    with a_computed_the_prompt(redis_store) as (a, b, cold, n_prompt, written):
        ours = _keys(client)
        assert len(ours) == n_prompt // 16

        shared = _complete(b, TEXT)  # B never saw the prompt: its blocks come from the store
        assert shared["choices"][0]["text"] == cold["choices"][0]["text"]
        m = b.metrics()
        assert m[M + "kv_remote_hits_total"] == (n_prompt - 1) // 16 * 16
        assert m[M + "kv_remote_bytes_read_total"] >= written * ((n_prompt - 1) // 16) / (n_prompt // 16) - 1
        assert m[M + "kv_remote_fetch_seconds_count"] >= 1
        assert m[M + "kv_remote_breaker_state"] == 0
        assert m[M + "kv_remote_corrupt_blocks_total"] == 0
        stats = httpx.get(b.url + "/stats", timeout=5).json()  # what the dashboard's store card shows
        assert stats["kv_remote"]["hits"] == m[M + "kv_remote_hits_total"]

        # a corrupted entry: the blocks before it are read, it and the rest recomputed, the same text
        other = TEXT[len(TEXT) // 2 :] + " " + TEXT[: len(TEXT) // 2]
        want = _complete(a, other)
        _settled(a)
        new = sorted(_keys(client) - ours)
        assert len(new) >= 8
        victim = new[len(new) // 2]
        value = bytearray(client.get(victim))
        value[-100] ^= 0xFF
        client.set(victim, bytes(value))
        before = b.metrics()[M + "kv_remote_hits_total"]
        got = _complete(b, other)
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        m = b.metrics()
        assert m[M + "kv_remote_corrupt_blocks_total"] == 1
        assert m[M + "kv_remote_hits_total"] - before < (got["usage"]["prompt_tokens"] - 1) // 16 * 16
        assert "does not check out" in b.log()

    # another model's replica (int8 weights: another fingerprint) shares the store and trusts none of A's
    # entries, not even A's bytes copied under its own keys
    with ServerProcess(*FLAGS, "--kv-cache-url", redis_store, "--quantization", "int8") as c:
        c.wait_ready()
        own = _complete(c, "The quick brown fox jumps over the lazy dog. " * 8)
        _settled(c)
        c_prefix = {_prefix(k) for k in _keys(client)} - {_prefix(k) for k in ours}
        assert len(c_prefix) == 1, c_prefix
        assert own["usage"]["prompt_tokens"] >= 32
        (c_key,) = c_prefix
        for k in ours:  # A's entries of TEXT, forged under C's keys
            client.set(c_key + k.rsplit(b":", 1)[1], client.get(k))
        _complete(c, TEXT)
        m = c.metrics()
        assert m[M + "kv_remote_hits_total"] == 0
        assert m[M + "kv_remote_corrupt_blocks_total"] >= 1


def test_a_store_killed_during_a_run_fails_no_request(redis_factory):
    store = redis_factory()
    with ServerProcess(*FLAGS, "--kv-cache-url", store.url, "--kv-cache-url-timeout", "0.3") as a:
        a.wait_ready()
        prompts = [f"Request {i}. " + TEXT[i * 37 :] for i in range(12)]
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(_complete, a, p, 16) for p in prompts]
            assert wait_until(lambda: a.metrics().get(M + "kv_remote_bytes_written_total", 0) > 0, timeout=120)
            store.kill()  # mid-run: connections reset, the port refuses
            results = [f.result() for f in futures]  # _complete asserts 200 for every one
        assert len(results) == 12
        again = _complete(a, TEXT, 4)  # after the store is gone
        assert again["usage"]["completion_tokens"] == 4
        m = a.metrics()
        assert m[M + "kv_remote_breaker_state"] == 1
        assert m[M + "kv_remote_errors_total"] >= 1
        assert a.log().count("breaker open") == 1  # one line per change, not one per request
        assert m.get(M + "request_success_total", 0) >= 13

        store.start()  # the store comes back on its port: the writer's probe closes the breaker
        assert wait_until(lambda: a.metrics()[M + "kv_remote_breaker_state"] == 0, timeout=60, interval=0.5)
        assert "reachable again" in a.log()
        before = a.metrics()[M + "kv_remote_bytes_written_total"]
        _complete(a, "A new prompt after the store came back. " + TEXT[:800], 2)
        assert wait_until(lambda: a.metrics()[M + "kv_remote_bytes_written_total"] > before, timeout=60)


def test_a_store_that_stops_answering_fails_no_request(redis_factory):
    """A hung store (SIGSTOP: connections open, no answers): each call gives up at --kv-cache-url-timeout, three
    timeouts in a row open the breaker, requests go on computing; answering again, it is used again."""
    store = redis_factory()
    with ServerProcess(*FLAGS, "--kv-cache-url", store.url, "--kv-cache-url-timeout", "0.3") as a:
        a.wait_ready()
        _complete(a, "Warm the connection. " + TEXT[:300], 2)
        store.pause()
        for i in range(4):
            _complete(a, f"Prompt {i} while the store hangs. " + TEXT[i * 100 :], 4)
        assert wait_until(lambda: a.metrics()[M + "kv_remote_breaker_state"] == 1, timeout=60, interval=0.5)
        log = a.log()
        assert log.count("breaker open") == 1 and "TimeoutError" in log
        store.pause(False)
        assert wait_until(lambda: a.metrics()[M + "kv_remote_breaker_state"] == 0, timeout=90, interval=0.5)
        assert a.log().count("reachable again") == 1


def test_a_full_store_and_a_wrong_password_fail_no_request(redis_factory, tmp_path):
    full = redis_factory(maxmemory="1mb", policy="noeviction")
    locked = redis_factory(password="right-password")
    wrong = locked.url.replace("right-password", "wrong-password")
    secret = tmp_path / "password"
    secret.write_text("right-password\n")
    open_url = f"redis://127.0.0.1:{locked.port}/0"
    with (
        ServerProcess(*FLAGS, "--kv-cache-url", full.url) as f,
        ServerProcess(*FLAGS, "--kv-cache-url", wrong) as w,
        ServerProcess(*FLAGS, "--kv-cache-url", open_url, "--kv-cache-url-password-file", str(secret)) as p,
    ):
        for srv in (f, w, p):
            srv.wait_ready()
        prompt = TEXT[:1200]
        texts = {srv.port: _complete(srv, prompt)["choices"][0]["text"] for srv in (f, w, p)}
        assert len(set(texts.values())) == 1

        assert wait_until(lambda: f.metrics().get(M + "kv_remote_refused_writes_total", 0) > 0, timeout=60)
        m = f.metrics()
        assert m[M + "kv_remote_breaker_state"] == 0  # full is not down: reads go on
        assert f.log().count("refuses writes") == 1
        _complete(f, prompt)

        m = w.metrics()
        assert m[M + "kv_remote_breaker_state"] == 1
        assert m.get(M + "kv_remote_bytes_written_total", 0) == 0
        log = w.log()
        assert log.count("breaker open") == 1
        assert "AuthenticationError" in log
        assert "wrong-password" not in log  # the URL is logged without its password

        _settled(p)  # the password from the file opens the store
        assert p.metrics()[M + "kv_remote_breaker_state"] == 0
        assert locked.client().dbsize() > 0


def test_a_tls_store_with_the_password_from_a_file(redis_factory, tmp_path):
    """rediss:// (the store's certificate checked against its CA) and AUTH from --kv-cache-url-password-file."""
    from tests.e2e.test_tls_keys import make_cert

    key, cert = make_cert(tmp_path)
    store = redis_factory(tls=(key, cert), password="tls-secret")
    secret = tmp_path / "password"
    secret.write_text("tls-secret\n")
    url = f"rediss://127.0.0.1:{store.port}/0?ssl_ca_certs={cert}"
    with ServerProcess(*FLAGS, "--kv-cache-url", url, "--kv-cache-url-password-file", str(secret)) as srv:
        srv.wait_ready()
        _complete(srv, TEXT[:1200])
        _settled(srv)
        assert srv.metrics()[M + "kv_remote_breaker_state"] == 0
        assert store.client().dbsize() > 0
        assert "tls-secret" not in srv.log()
