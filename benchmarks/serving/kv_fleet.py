"""A fleet sharing its prefix cache (`--kv-cache-url`): the prefill tokens it computes with and without the store.

Chat traffic of `--tenants` tenants, each with its own system prompt of ~`--system-tokens` tokens and
`--turns` user questions, sent in a shuffled order (`--concurrency` at a time) to `llmserve route` (each of
`--policies`, default cache_aware) over `--replicas` `llmserve serve` replicas of the same model; once with every
replica on one redis-server (`--kv-cache-url`), once without. A COUNT, not a timing: each replica's /metrics
says how many prompt tokens it took (`llmserve:prompt_tokens_total`) and how many of them its prefix cache gave
(`llmserve:prefix_cache_hits_total`: RAM, and the store's blocks copied into the pool); the rest were computed.
Summed over the fleet, the ratio with/without the store is the figure (issue #57's target: <= 0.3x). The
clients' `usage.prompt_tokens_details.cached_tokens` is summed too, as a check of the same figure.

    python -m benchmarks.serving.kv_fleet [--replicas 4] [--tenants 8] [--turns 6] [--system-tokens 1000] \\
        [--policies cache_aware,round_robin] [--num-kv-blocks 96] [--no-write]

Issue #57's figure: `--tenants 8 --turns 12 --num-kv-blocks 96` (each replica's pool holds 1.6 of the 2 prompts
its tenants need, so a tenant's prefix is evicted between its turns, as in a fleet whose prefixes outgrow its KV
memory); at the default pool every tenant fits in one replica's RAM and the store has nothing to save (1.00x).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from benchmarks.common import write_section
from llmserve.testing.launcher import ROUTE, ServerProcess, wait_until
from llmserve.testing.redis_server import RedisServer

M = "llmserve:"
TEXT = open(os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "alice.txt")).read()
QUESTIONS = [
    "Summarise the passage in one sentence.",
    "Who is the main character here?",
    "What happens first in this passage?",
    "Name one object that appears in the text.",
    "Is the tone of the passage happy or sad?",
    "What would be a good title for it?",
    "Which place does the text describe?",
    "Give one word that describes Alice.",
    "What does Alice want at this point?",
    "Which animal is mentioned first?",
    "How long is the passage, roughly?",
    "Is anything in it impossible in real life?",
    "What is the last thing that happens?",
    "Which sentence is the most surprising?",
    "Does anyone speak in the passage?",
    "What colour is mentioned, if any?",
]  # a tenant's turns ask different questions (up to 16 turns): no turn repeats another's prompt


def system_prompt(tenant: int, tokens: int) -> str:
    """Tenant `tenant`'s own system prompt, ~`tokens` tokens (the book runs ~4 characters a token): its own first
    line, then the book from a place of its own, wrapped round (every block of it differs from another tenant's)."""
    start = (tenant * 331) % len(TEXT)
    book = (TEXT[start:] + "\n" + TEXT[:start] + "\n") * (1 + tokens * 4 // len(TEXT))
    head = f"You are the assistant of tenant {tenant} (company no. {tenant * 101}). Answer from this passage.\n"
    return head + book[: tokens * 4]


def chat(url: str, system: str, question: str, max_tokens: int) -> dict:
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=3600)
    r.raise_for_status()
    return r.json()["usage"]


def counters(replicas: list[ServerProcess]) -> dict:
    names = ("prompt_tokens_total", "prefix_cache_hits_total", "prefix_cache_queries_total", "kv_remote_hits_total")
    names += ("num_preemptions_total", "request_success_total", "kv_remote_skipped_fetches_total")
    names += ("kv_remote_queries_total", "kv_remote_dropped_writes_total")
    out = {n: 0.0 for n in names}
    per = []
    for r in replicas:
        m = r.metrics()
        for n in names:
            out[n] += m.get(M + n, 0.0)
        per.append(m.get(M + "prompt_tokens_total", 0.0))
    out["per_replica_prompt_tokens"] = per
    return out


def fleet_run(a, policy: str, store: RedisServer | None) -> dict:
    length = min(2048, a.num_kv_blocks * 16) if a.num_kv_blocks else 2048  # a sequence fits in the pool
    flags = ["--num-threads", "1", "--max-num-seqs", str(a.max_num_seqs), "--max-model-len", str(length)]
    flags += ["--log-level", "warning", *a.extra.split()]
    if a.num_kv_blocks:
        flags += ["--num-kv-blocks", str(a.num_kv_blocks)]
    if store is not None:
        store.client().flushdb()
        flags += ["--kv-cache-url", store.url]
    replicas = [ServerProcess(*flags) for _ in range(a.replicas)]
    try:
        for r in replicas:
            r.wait_ready(timeout=1200)
        route = ["--policy", policy, "--health-interval", "1", "--log-level", "warning"]
        for r in replicas:
            route += ["--backend", r.url]
        with ServerProcess(*route, cmd=ROUTE) as router:
            router.wait_ready(timeout=120)
            assert wait_until(lambda: httpx.get(router.url + "/ready", timeout=5).status_code == 200, timeout=60)
            systems = [system_prompt(t, a.system_tokens) for t in range(a.tenants)]
            work = [(t, q) for t in range(a.tenants) for q in range(a.turns)]
            random.Random(a.seed).shuffle(work)  # the tenants' turns arrive mixed
            t0 = time.perf_counter()
            with ThreadPoolExecutor(a.concurrency) as pool:
                usages = list(
                    pool.map(
                        lambda w: chat(router.url, systems[w[0]], QUESTIONS[w[1] % len(QUESTIONS)], a.max_tokens), work
                    )
                )
            seconds = time.perf_counter() - t0
        c = counters(replicas)
    finally:
        for r in replicas:
            r.stop()
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages)
    # what a request whose prefix was found still computes: its own question and the partial block before it
    tails = sorted(
        u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"]
        for u in usages
        if (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) > 0
    )
    c.update(
        requests=len(usages),
        client_prompt=prompt,
        client_cached=cached,
        computed=c["prompt_tokens_total"] - c["prefix_cache_hits_total"],
        client_computed=prompt - cached,
        tail=tails[len(tails) // 2] if tails else 0,
        seconds=seconds,
    )
    return c


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--turns", type=int, default=6, help="user questions per tenant")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--policies", default="cache_aware", help="router policies, comma-separated (each run twice)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=0,
        help="each replica's KV pool in 16-token blocks (0: the memory default); below 128, --max-model-len is "
        "the pool's tokens (at least a prompt and its answer: 64 blocks)",
    )
    p.add_argument("--extra", default="", help="more serve flags, space-separated")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    load = os.getloadavg()
    rows, notes = [], []
    with RedisServer() as store:
        for policy in a.policies.split(","):
            res = {}
            for label, s in (("no store", None), ("shared store", store)):
                res[label] = r = fleet_run(a, policy, s)
                print(policy, label, r, flush=True)
                rows.append(
                    f"| {policy} | {label} | {r['requests']} | {r['prompt_tokens_total']:.0f} | "
                    f"{r['prefix_cache_hits_total']:.0f} | {r['kv_remote_hits_total']:.0f} | **{r['computed']:.0f}** | "
                    f"{r['client_computed']:.0f} | {' / '.join(f'{x:.0f}' for x in r['per_replica_prompt_tokens'])} | "
                    f"{r['num_preemptions_total']:.0f} |"
                )
            # the responses' figure (the replicas' counters say the same: a request's hits are counted once)
            ratio = res["shared store"]["client_computed"] / max(res["no store"]["client_computed"], 1)
            per_request = res["no store"]["client_prompt"] / max(res["no store"]["requests"], 1)
            floor = a.tenants * per_request  # each tenant's prompt computed once in the fleet, about
            without, with_ = (res[k]["client_computed"] / floor for k in ("no store", "shared store"))
            tail = res["shared store"]["tail"] or res["no store"]["tail"]
            least = floor + (res["no store"]["requests"] - a.tenants) * tail  # ... and every other request its tail
            note = (
                f"`{policy}` ({per_request:.0f} prompt tokens a request, chat template included): fleet-wide prefill "
                f"computed with the store **{ratio:.2f}x** without it ({res['shared store']['client_computed']:.0f} vs "
                f"{res['no store']['client_computed']:.0f} tokens by the responses; issue #57's target <= 0.3x). "
                "In prompts' worth: "
                f"{without:.1f} without the store, {with_:.1f} with it, for {a.tenants} tenants. The least a fleet "
                f"computes is about {least:.0f} tokens: each tenant's prompt once, and each other request its own "
                f"question and the partial block before it ({tail} tokens, the median of a request with a hit)."
            )
            if res["shared store"]["kv_remote_hits_total"] == 0 and without < 1.5:
                note += (
                    " The router already keeps each tenant on one replica: without the store the fleet computes "
                    "each prompt about once, and the store has nothing left to save at this load."
                )
            elif res["shared store"]["client_computed"] <= 1.05 * least:
                note += " With the store the fleet computes that least: no prompt twice anywhere in it."
            elif a.concurrency > 1:
                more = (res["shared store"]["client_computed"] - least) / per_request
                note += (
                    f" With the store the fleet still computes {more:.1f} prompts' worth more than once: a "
                    f"tenant's turn that reaches another replica while the first is still prefilling its prompt "
                    f"({a.concurrency} requests in flight) finds only the blocks already written, and computes the "
                    "rest again."
                )
            notes.append(note)
    budget = ""
    if a.num_kv_blocks:
        budget = f" --num-kv-blocks {a.num_kv_blocks} --max-model-len {min(2048, a.num_kv_blocks * 16)}"
        fit = a.num_kv_blocks * 16 / max(per_request, 1)
        notes.insert(
            0,
            f"Each replica's KV pool is {a.num_kv_blocks} blocks of 16 tokens ({a.num_kv_blocks * 16} tokens): "
            f"{fit:.1f} prompts of {per_request:.0f} tokens, running sequences included, for the "
            f"{a.tenants / a.replicas:.0f} tenants a replica gets on average under a router that keeps each tenant "
            "on one replica. A fleet runs so when its tenants' prefixes outgrow its KV memory: more tenants (or "
            "longer system prompts, or a larger model's KV per token) than a replica's cache holds, so the prefix "
            "of a tenant whose turn comes back has been evicted from RAM meanwhile.",
        )
    body = (
        f"`python -m benchmarks.serving.kv_fleet {' '.join(sys.argv[1:])}`: the bundled SmolLM2-135M, {a.replicas} "
        f"`llmserve serve` replicas (`--num-threads 1 --max-num-seqs {a.max_num_seqs}`{budget}) "
        "behind `llmserve route`, "
        f"{a.tenants} tenants each with its own ~{a.system_tokens}-token system prompt and {a.turns} user "
        f"questions ({a.tenants * a.turns} chat requests, shuffled, {a.concurrency} at a time, {a.max_tokens} greedy "
        "tokens each); once with every replica on one `redis-server` (`--kv-cache-url`, loopback), once without. "
        "Counts, not timings (valid on the shared machine; load average "
        f"{load[0]:.1f} / {load[1]:.1f} at the start). Computed = `prompt_tokens_total - prefix_cache_hits_total` "
        "summed over the replicas' /metrics (store hits become prefix-cache hits once copied into the pool); "
        "the clients' `prompt_tokens - cached_tokens` is the same figure from the responses.\n\n"
        "| router | run | requests | prompt tokens | prefix-cache hits | of them from the store | computed | "
        "computed (clients) | prompt tokens per replica | preemptions |\n|---|---|---|---|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\n"
        + "\n\n".join(notes)
        + "\n"
    )
    print(body)
    if not a.no_write:
        title = f"Shared KV store: a fleet's prefill with and without it ({a.tenants} tenants x {a.turns} turns, "
        title += f"{a.concurrency} in flight"
        title += f", a {a.num_kv_blocks}-block KV pool a replica)" if a.num_kv_blocks else ")"
        write_section(title, body)


if __name__ == "__main__":
    main()
