"""`llmserve:prefix_cache_queries_total` / `_hits_total` on a real server count a request once, when it is
scheduled (vLLM's semantics), and agree with its response's `usage.prompt_tokens_details.cached_tokens`, also
when the request waits for room in a small KV pool (looked up again every step meanwhile)."""

from __future__ import annotations

import json
import random
import threading

import httpx

from llmserve.testing.launcher import ServerProcess

# 40 blocks of 16 tokens: X (360 prompt tokens + 24 generated: 24 blocks) and B (276 tokens, 16 of its 18
# blocks cached) do not fit together, so B waits while X decodes
FLAGS = ["--num-threads", "1", "--max-model-len", "640", "--num-kv-blocks", "40", "--max-num-seqs", "4"]
FLAGS += ["--log-level", "warning"]
M = "llmserve:"


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


def _usage(url: str, ids: list[int], max_tokens: int) -> dict:
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["usage"]


def _counters(srv: ServerProcess) -> tuple[float, float]:
    m = srv.metrics()
    return m.get(M + "prefix_cache_queries_total", 0.0), m.get(M + "prefix_cache_hits_total", 0.0)


def test_a_request_that_waits_for_room_counts_its_prefix_hits_once():
    prefix = _ids(256, 1)  # 16 whole blocks
    with ServerProcess(*FLAGS) as srv:
        srv.wait_ready()
        first = _usage(srv.url, prefix, 1)
        assert first["prompt_tokens_details"]["cached_tokens"] == 0
        q0, h0 = _counters(srv)
        assert (q0, h0) == (256, 0)
        body = {"prompt": _ids(360, 2), "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
        body["stream_options"] = {"include_usage": True}
        started, usage_x = threading.Event(), {}

        def run_x():  # X holds most of the pool while it decodes
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        started.set()
                        usage_x.update(chunk.get("usage") or {})

        x = threading.Thread(target=run_x)
        x.start()
        assert started.wait(300)
        b = _usage(srv.url, prefix + _ids(20, 3), 2)  # scheduled once X is done and has given its blocks back
        x.join(300)
        assert usage_x["prompt_tokens"] == 360 and usage_x["completion_tokens"] == 24
        cached_x = (usage_x.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        assert b["prompt_tokens_details"]["cached_tokens"] == 256
        q, h = _counters(srv)
        assert h - h0 == cached_x + 256
        assert q - q0 == 360 + 276
