"""The shared KV store (`--kv-cache-url`), two real servers on one redis-server (loopback):

1. TTFT: replica B's time to first token on a prompt replica A computed (its blocks read from the store),
   against B's own cold TTFT on another prompt of the same length; the greedy tokens must be A's.
2. Throughput with the store empty (every look-up a miss, every block written): `llmserve bench` at
   `--concurrency` against the same server without the store.
3. The store killed (SIGKILL) during a 64-request `llmserve bench` run: failed requests (want 0).

    python -m benchmarks.serving.kv_store [--model ~/ckpt/llama-1b] [--prompt-tokens 2000] [--threads 2] \\
        [--phases ttft,throughput,outage] [--repeats 3] [--no-write]

Prompts are token ids (seeded), so any model's vocabulary takes them; EOS is ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from benchmarks.common import write_section
from llmserve.testing.launcher import ServerProcess, wait_until
from llmserve.testing.redis_server import RedisServer

M = "llmserve:"


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


def ttft(srv: ServerProcess, ids: list[int], max_tokens: int = 8) -> tuple[float, str]:
    """(seconds to the first streamed token, the greedy text)."""
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first, text = None, []
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            piece = chunk["choices"][0]["text"] if chunk.get("choices") else ""
            if piece and first is None:
                first = time.perf_counter() - t0
            text.append(piece)
    return first, "".join(text)


def settled(srv: ServerProcess) -> float:
    last = [-1.0]

    def still() -> bool:
        now = srv.metrics().get(M + "kv_remote_bytes_written_total", 0.0)
        done = now > 0 and now == last[0]
        last[0] = now
        return done

    wait_until(still, timeout=600, interval=1.0)
    return last[0]


def ttft_round(A: ServerProcess, B: ServerProcess, n: int, seed: int) -> dict:
    """B's cold TTFT on a prompt of its own, A's on the next one, then B's on A's (a store hit: the greedy text must
    be A's), then B's again (a RAM hit: the floor); the store's counters of B's hit."""
    cold_b, _ = ttft(B, prompt_ids(n, seed + 1))  # B computes: its cold TTFT
    cold_a, text_a = ttft(A, prompt_ids(n, seed + 2))  # A computes the prompt B gets next
    written = settled(A)
    settled(B)
    before = B.metrics()
    hit_b, text_b = ttft(B, prompt_ids(n, seed + 2))
    m = B.metrics()
    got = {k: m.get(M + k, 0) - before.get(M + k, 0) for k in ("kv_remote_hits_total", "kv_remote_bytes_read_total")}
    fetch = m.get(M + "kv_remote_fetch_seconds_sum", 0) - before.get(M + "kv_remote_fetch_seconds_sum", 0)
    floor_b, text_again = ttft(B, prompt_ids(n, seed + 2))  # now in B's RAM: the floor
    _, text_a_again = ttft(A, prompt_ids(n, seed + 2))  # A's own hit in RAM: the same KV bytes, the same last step
    return {
        "cold_b": cold_b,
        "cold_a": cold_a,
        "written": written,
        "hit_b": hit_b,
        "hits": got["kv_remote_hits_total"],
        "read": got["kv_remote_bytes_read_total"],
        "fetch": fetch,
        "floor_b": floor_b,
        "same": text_b == text_again == text_a_again,  # a hit's answer, wherever its KV came from
        "same_cold": text_b == text_a,  # ... and A's cold answer (its prefill in other chunks: float rounding)
    }


def bench(url: str, a, n: int, out: str, kill=None) -> dict:
    cmd = [sys.executable, "-m", "llmserve.cli", "bench", "--base-url", url, "--concurrency", str(a.concurrency)]
    cmd += ["--num-requests", str(n), "--dataset", "random", "--input-len", str(a.input_len)]
    cmd += ["--output-len", str(a.output_len), "--ignore-eos", "--temperature", "0", "--no-progress"]
    cmd += ["--output-json", out]
    if kill is not None:  # the store dies this many seconds into the run
        threading.Timer(kill[0], kill[1]).start()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    s = json.load(open(out))["phases"][0]["summary"]
    return {"tok_s": s["output_throughput"], "completed": s["completed"], "failed": s["failed"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="what serve takes (default: the bundled model)")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--phases", default="ttft,throughput,outage")
    p.add_argument("--repeats", type=int, default=3, help="ttft: rounds (new prompts each), the ratio's median")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="throughput: runs of each setting, alternated")
    p.add_argument("--extra", default="", help="more serve flags, space-separated")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    phases = a.phases.split(",")
    name = os.path.basename(a.model.rstrip("/")) if a.model else "the bundled SmolLM2-135M"
    base = (["--model", a.model] if a.model else []) + ["--num-threads", str(a.threads), *a.extra.split()]
    base += ["--max-model-len", str(max(2048, a.prompt_tokens + 64)), "--log-level", "warning"]
    tmp = tempfile.mkdtemp()
    load = os.getloadavg()
    rows, notes = [], []
    with RedisServer() as store:
        store_flags = [*base, "--kv-cache-url", store.url]
        if "ttft" in phases:
            with ServerProcess(*store_flags) as A, ServerProcess(*store_flags) as B:
                A.wait_ready(timeout=1200)
                B.wait_ready(timeout=1200)
                ttft(B, prompt_ids(32, 7), 2)  # warm-up (first-step costs), unrelated prompt
                ttft(A, prompt_ids(32, 8), 2)
                runs = [ttft_round(A, B, a.prompt_tokens, 10 * k) for k in range(a.repeats)]
            for k, r in enumerate(runs):
                print("ttft", k, r, flush=True)
                rows.append(
                    f"| {k + 1} | {r['cold_b'] * 1000:.0f} ms | {r['cold_a'] * 1000:.0f} ms "
                    f"({r['written'] / 1e6:.1f} MB written) | {r['hit_b'] * 1000:.0f} ms | {r['hits']:.0f} | "
                    f"{r['read'] / 1e6:.1f} MB | {r['fetch'] * 1000:.0f} ms | {r['floor_b'] * 1000:.0f} ms | "
                    f"**{r['hit_b'] / r['cold_b']:.3f}x** | {'yes' if r['same'] else 'NO'} | "
                    f"{'yes' if r['same_cold'] else 'no'} |"
                )
            med = {k: statistics.median(r[k] for r in runs) for k in ("cold_b", "hit_b", "fetch", "floor_b", "read")}
            ratios = [r["hit_b"] / r["cold_b"] for r in runs]
            notes.append(
                f"B's TTFT on A's prompt **{statistics.median(ratios):.3f}x** its cold TTFT, the median of "
                f"{len(runs)} rounds' ratios ({', '.join(f'{x:.3f}' for x in ratios)}; target <= 0.1x). Greedy text "
                f"of B's store hit the same as B's and A's hits in RAM (the same KV bytes, the same last-token step) "
                f"in **{sum(r['same'] for r in runs)} of {len(runs)}** rounds, as A's cold run in "
                f"{sum(r['same_cold'] for r in runs)} of {len(runs)}. Medians: cold "
                f"{med['cold_b'] * 1000:.0f} ms, store hit {med['hit_b'] * 1000:.0f} ms, of which the look-up "
                f"(read, check, copy into the pool) {med['fetch'] * 1000:.0f} ms "
                f"({med['read'] / 1e6 / max(med['fetch'], 1e-9):.0f} MB/s); the RAM-hit floor "
                f"{med['floor_b'] * 1000:.0f} ms ({med['floor_b'] / med['cold_b']:.3f}x)."
            )
        store.client().flushdb()
        if "throughput" in phases:
            res: dict[str, list[dict]] = {"no store": [], "empty store": []}
            for rnd in range(a.rounds):  # ABAB: a machine whose speed drifts weighs on both
                for label, flags in (("no store", base), ("empty store", store_flags)):
                    store.client().flushdb()
                    with ServerProcess(*flags) as s:
                        s.wait_ready(timeout=1200)
                        r = bench(s.url, a, a.num_requests, os.path.join(tmp, f"{label}-{rnd}.json"))
                        r["hits"] = s.metrics().get(M + "kv_remote_hits_total", 0)
                        r["written"] = s.metrics().get(M + "kv_remote_bytes_written_total", 0)
                    res[label].append(r)
                    print(label, rnd, r, flush=True)
            med = {k: statistics.median(r["tok_s"] for r in v) for k, v in res.items()}
            each = {k: ", ".join(f"{r['tok_s']:.1f}" for r in v) for k, v in res.items()}
            notes.append(
                f"Output throughput at {a.concurrency} concurrent with an empty store (0 hits: "
                f"{sum(r['hits'] for r in res['empty store']):.0f} tokens; "
                f"{res['empty store'][-1]['written'] / 1e6:.0f} MB written a run) "
                f"**{med['empty store'] / med['no store']:.2f}x** "
                f"the same server without one (medians of {each['empty store']} vs {each['no store']} tok/s, runs "
                f"alternated; target >= 0.95x; {a.num_requests} requests, {a.input_len} in / {a.output_len} out). "
                "The redis-server process runs on the same 2 cores as the replica here."
            )
        if "outage" in phases:
            store.client().flushdb()
            with ServerProcess(*store_flags) as s:
                s.wait_ready(timeout=1200)
                r = bench(s.url, a, 64, os.path.join(tmp, "outage.json"), kill=(5.0, store.kill))
                m = s.metrics()
                log = s.log()
            print("outage", r, flush=True)
            notes.append(
                f"The store killed (SIGKILL) 5 s into a 64-request run: **{r['failed']} failed**, "
                f"{r['completed']} completed ({r['tok_s']:.1f} tok/s); breaker state after: "
                f"{m.get(M + 'kv_remote_breaker_state', -1):.0f} (1 = open), store errors "
                f"{m.get(M + 'kv_remote_errors_total', 0):.0f}, 'breaker open' logged "
                f"{log.count('breaker open')} time(s)."
            )
    body = (
        f"`python -m benchmarks.serving.kv_store {' '.join(sys.argv[1:])}`: {name}, two `llmserve serve` replicas "
        f"(`--num-threads {a.threads}`) on one `redis-server` (loopback, Debian's 7.0), prompts of "
        f"{a.prompt_tokens} token ids, 8 greedy tokens, streamed TTFT, each replica warmed up by a short prompt. "
        "**Taken under load**: the machine is "
        f"shared (load average {load[0]:.1f} / {load[1]:.1f} on its cores at the start); the ratios are within "
        "one run, the absolute times are not comparable with other days.\n\n"
    )
    if rows:
        body += (
            "| round | B cold TTFT | A cold TTFT | B on A's prompt (store hit) | tokens from the store | read | "
            "fetch time | B again (RAM hit) | hit / cold | same text as the RAM hits | same text as A's cold run |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n"
        )
        body += "\n".join(rows)
        body += "\n\n"
    body += "\n\n".join(notes) + "\n"
    print(body)
    if not a.no_write:
        only = "" if set(phases) == {"ttft", "throughput", "outage"} else f", {'+'.join(phases)} only"
        write_section(f"Shared KV store: replica B answers what replica A computed ({name}{only})", body)


if __name__ == "__main__":
    main()
