"""Router benchmarks on one machine: two `llmserve serve` replicas (1 thread each) behind
`llmserve route`, and a fake backend for the router's own overhead.

    python -m benchmarks.serving.router                 # all three parts, ~15 minutes on 2 CPU cores
    python -m benchmarks.serving.router --parts overhead --out bench-out/router.json

1. mix       short chats and long-prompt requests, Poisson arrivals, the same schedule and
             request mix for each policy: p95 latency with `least_outstanding` vs `round_robin`.
2. tenants   8 long system prompts, many users each, on replicas whose KV cache holds about four
             of them: backend prefix-cache hit rate (from their /metrics) and mean TTFT with
             `cache_aware` vs `round_robin` (`--tenant-policies`; `cache_aware-tree`: without the
             replicas' KV events).
3. overhead  20 concurrent streaming clients against a fake backend that answers in ~0.25 s,
             directly and through the router: the added latency per request (p50, p95), and
             the router's own `proxy_overhead_seconds` (arrival to upstream send).

Each policy run uses fresh prompt text (same lengths, same arrival times) so no run reuses the
previous one's KV cache. Routers, replicas and the fake backend are separate processes; the load
generator is this process (asyncio + httpx, streaming).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import statistics
import time

import httpx

from benchmarks.serving.router_load import Fleet, Rec, Req, backend_metrics, closed_loop, open_loop, pct, words
from llmserve.bench.scrape import parse_prometheus, parse_samples

# ----------------------------------------------------------------------------------------------
# 1. short chats + long prompts: least_outstanding vs round_robin
# ----------------------------------------------------------------------------------------------


def mix_workload(seed: int, salt: str, n: int, rate: float, long_frac: float, long_words: int) -> list[Req]:
    shape = random.Random(seed)  # kinds and arrival times: the same for every policy
    text = random.Random(f"{seed}-{salt}")  # prompt text: fresh for every policy
    reqs, t = [], 0.0
    for _ in range(n):
        t += shape.expovariate(rate)
        if shape.random() < long_frac:
            reqs.append(
                Req(
                    "long",
                    {
                        "model": "smol",
                        "max_tokens": 16,
                        "temperature": 0,
                        "prompt": "Summarize: " + words(text, long_words),
                    },
                    t,
                )
            )
        else:
            reqs.append(
                Req(
                    "short",
                    {
                        "model": "smol",
                        "max_tokens": 16,
                        "temperature": 0,
                        "messages": [{"role": "user", "content": words(text, shape.randint(6, 20)) + "?"}],
                    },
                    t,
                )
            )
    return reqs


def run_mix(fleet: Fleet, args) -> dict:
    backends = fleet.replicas(2, ["--served-model-name", "smol", "--max-model-len", "2048"])
    routers = {policy: fleet.router(backends, policy) for policy in args.mix_policies}
    out = {
        "backends": len(backends),
        "rounds": args.mix_rounds,
        "requests_per_round": args.mix_requests,
        "rate_per_s": args.mix_rate,
        "long_fraction": args.long_frac,
        "long_words": args.long_words,
        "policies": {},
    }
    recs: dict[str, list[Rec]] = {p: [] for p in args.mix_policies}
    # Rounds alternate the policies' order, so that a slow spell of the machine does not land
    # on one policy only; within a round both get the same arrival times and request kinds.
    for rnd in range(args.mix_rounds):
        order = args.mix_policies if rnd % 2 == 0 else list(reversed(args.mix_policies))
        for policy in order:
            reqs = mix_workload(
                args.seed + rnd, policy, args.mix_requests, args.mix_rate, args.long_frac, args.long_words
            )
            got = asyncio.run(open_loop(routers[policy], reqs))
            recs[policy] += got
            e2e = [r.e2e for r in got if r.ok]
            print(
                f"  mix round {rnd} {policy:18s} p50 {pct(e2e, 50):.2f}s  p95 {pct(e2e, 95):.2f}s"
                f"  ok {len(e2e)}/{len(got)}",
                flush=True,
            )
    for policy, rs in recs.items():
        ok = [r for r in rs if r.ok]
        e2e = [r.e2e for r in ok]
        short = [r.e2e for r in ok if r.kind == "short"]
        res = {
            "ok": len(ok),
            "failed": len(rs) - len(ok),
            "p50_s": pct(e2e, 50),
            "p95_s": pct(e2e, 95),
            "mean_s": statistics.mean(e2e),
            "short_p50_s": pct(short, 50),
            "short_p95_s": pct(short, 95),
            "long_p95_s": pct([r.e2e for r in ok if r.kind == "long"], 95),
            "ttft_p95_s": pct([r.ttft for r in ok if r.ttft is not None], 95),
            "per_backend": {b: sum(1 for r in ok if r.backend == b) for b in backends},
        }
        out["policies"][policy] = res
        print(
            f"  mix {policy:18s} p50 {res['p50_s']:.2f}s  p95 {res['p95_s']:.2f}s  "
            f"short p95 {res['short_p95_s']:.2f}s  ok {res['ok']}/{len(rs)}",
            flush=True,
        )
    fleet.stop(list(routers.values()) + backends)
    lo, rr = out["policies"].get("least_outstanding"), out["policies"].get("round_robin")
    if lo and rr:
        out["p95_ratio_rr_over_lo"] = rr["p95_s"] / lo["p95_s"]
    return out


# ----------------------------------------------------------------------------------------------
# 2. multi-tenant: cache_aware vs round_robin
# ----------------------------------------------------------------------------------------------


def tenant_workload(seed: int, salt: str, tenants: int, users: int, system_words: int) -> list[Req]:
    shape = random.Random(seed)
    text = random.Random(f"{seed}-{salt}")
    systems = [f"You are assistant {i} of company {i}. " + words(text, system_words) for i in range(tenants)]
    order = [(t, u) for t in range(tenants) for u in range(users)]
    shape.shuffle(order)
    return [
        Req(
            "tenant",
            {
                "model": "smol",
                "max_tokens": 4,
                "temperature": 0,
                "messages": [
                    {"role": "system", "content": systems[t]},
                    {"role": "user", "content": f"I am user {u}. " + words(text, 6) + "?"},
                ],
            },
        )
        for t, u in order
    ]


def run_tenants(fleet: Fleet, args) -> dict:
    backends = fleet.replicas(
        2,
        ["--served-model-name", "smol", "--max-model-len", "512", "--num-kv-blocks", str(args.kv_blocks)]
        + ["--kv-events-config", '{"enable_kv_cache_events": true}'],
    )
    out = {
        "backends": len(backends),
        "tenants": args.tenants,
        "users_per_tenant": args.users,
        "system_words": args.system_words,
        "kv_blocks_per_backend": args.kv_blocks,
        "concurrency": args.tenant_concurrency,
        "policies": {},
    }
    for policy in args.tenant_policies.split(","):
        # cache_aware reads the replicas' KV events unless told not to: `cache_aware-tree` is the guessed tree alone
        events = "0" if policy.endswith("-tree") else "0.5"
        url = fleet.router(backends, policy.removesuffix("-tree"), "--kv-events-interval", events)
        reqs = tenant_workload(args.seed, policy, args.tenants, args.users, args.system_words)
        before = [backend_metrics(b) for b in backends]
        t = time.perf_counter()
        recs = asyncio.run(closed_loop(url, reqs, args.tenant_concurrency))
        wall = time.perf_counter() - t
        after = [backend_metrics(b) for b in backends]
        q = sum(
            a.get("llmserve:prefix_cache_queries_total", 0) - b.get("llmserve:prefix_cache_queries_total", 0)
            for a, b in zip(after, before)
        )
        h = sum(
            a.get("llmserve:prefix_cache_hits_total", 0) - b.get("llmserve:prefix_cache_hits_total", 0)
            for a, b in zip(after, before)
        )
        ok = [r for r in recs if r.ok]
        ttft = [r.ttft for r in ok if r.ttft is not None]
        res = {
            "ok": len(ok),
            "failed": len(recs) - len(ok),
            "wall_s": round(wall, 1),
            "prefix_cache_hit_rate": h / q if q else float("nan"),
            "prefix_cache_queries": q,
            "prefix_cache_hits": h,
            "mean_ttft_s": statistics.mean(ttft),
            "p95_ttft_s": pct(ttft, 95),
            "mean_e2e_s": statistics.mean(r.e2e for r in ok),
        }
        res["routing_decisions"] = {
            x.labels["reason"]: x.value
            for x in parse_samples(httpx.get(url + "/metrics").text)
            if x.name == "llmserve_router:routing_decisions_total"
        }
        out["policies"][policy] = res
        print(
            f"  tenants {policy:14s} hit rate {res['prefix_cache_hit_rate']:.1%}  mean TTFT "
            f"{res['mean_ttft_s']:.2f}s  ok {res['ok']}/{len(recs)}",
            flush=True,
        )
        fleet.stop([url])
    fleet.stop(backends)
    ca, rr = out["policies"].get("cache_aware"), out["policies"].get("round_robin")
    if ca and rr:
        out["hit_rate_ratio_ca_over_rr"] = ca["prefix_cache_hit_rate"] / max(rr["prefix_cache_hit_rate"], 1e-9)
        out["mean_ttft_ratio_rr_over_ca"] = rr["mean_ttft_s"] / ca["mean_ttft_s"]
    return out


# ----------------------------------------------------------------------------------------------
# 3. router overhead
# ----------------------------------------------------------------------------------------------


async def timed_closed_loop(url: str, n_each: int, concurrency: int, seed: int) -> list[float]:
    """`concurrency` clients, each sending `n_each` streamed chats one after the other; returns
    each request's end-to-end latency (the whole stream read)."""
    rng = random.Random(seed)
    reqs = [
        Req("chat", {"model": "fake", "max_tokens": 8, "messages": [{"role": "user", "content": words(rng, 12)}]})
        for _ in range(n_each * concurrency)
    ]
    recs = await closed_loop(url, reqs, concurrency)
    assert all(r.ok for r in recs), [r.error for r in recs if not r.ok][:3]
    return [r.e2e for r in recs]


def run_overhead(fleet: Fleet, args) -> dict:
    # a backend that takes ~0.25 s per request (first token after 0.1 s, then 8 tokens 20 ms
    # apart), like a small model would: 20 in flight keep the CPU far from saturation, so the
    # difference is the router's own latency, not queueing for a core
    fake = fleet.fake("--ttft", "0.1", "--itl", "0.02")
    router = fleet.router([fake], "cache_aware")
    asyncio.run(timed_closed_loop(router, 5, args.overhead_concurrency, 0))  # warm up
    asyncio.run(timed_closed_loop(fake, 5, args.overhead_concurrency, 0))
    direct, routed = [], []
    for rnd in range(args.overhead_rounds):  # interleave, to share any drift
        direct += asyncio.run(timed_closed_loop(fake, args.overhead_requests, args.overhead_concurrency, rnd))
        routed += asyncio.run(timed_closed_loop(router, args.overhead_requests, args.overhead_concurrency, rnd))
    m = parse_prometheus(httpx.get(router + "/metrics").text)
    s = m.get("llmserve_router:proxy_overhead_seconds_sum", 0.0)
    c = m.get("llmserve_router:proxy_overhead_seconds_count", 0.0)
    out = {
        "concurrency": args.overhead_concurrency,
        "requests_each": len(direct),
        "direct_p50_ms": pct(direct, 50) * 1e3,
        "routed_p50_ms": pct(routed, 50) * 1e3,
        "direct_p95_ms": pct(direct, 95) * 1e3,
        "routed_p95_ms": pct(routed, 95) * 1e3,
        "router_pre_send_mean_ms": s / c * 1e3 if c else float("nan"),
    }
    out["added_p50_ms"] = out["routed_p50_ms"] - out["direct_p50_ms"]
    out["added_p95_ms"] = out["routed_p95_ms"] - out["direct_p95_ms"]
    print(
        f"  overhead at {args.overhead_concurrency} concurrent: direct p50 "
        f"{out['direct_p50_ms']:.2f} ms, routed p50 {out['routed_p50_ms']:.2f} ms, added p50 "
        f"{out['added_p50_ms']:.2f} ms (p95 {out['added_p95_ms']:.2f} ms)",
        flush=True,
    )
    fleet.stop([router, fake])
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--parts", default="overhead,tenants,mix")
    p.add_argument("--out", default="bench-out/router.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mix-requests", type=int, default=25, help="per round and policy")
    p.add_argument("--mix-rounds", type=int, default=4)
    p.add_argument("--mix-rate", type=float, default=0.8, help="arrivals per second (Poisson)")
    p.add_argument("--long-frac", type=float, default=0.25)
    p.add_argument("--long-words", type=int, default=400)
    p.add_argument("--mix-policies", default="round_robin,least_outstanding")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--system-words", type=int, default=360)
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=116,
        help="KV blocks per replica in the tenants part: about 4.3 of the 8 system prompts",
    )
    p.add_argument("--tenant-concurrency", type=int, default=4)
    p.add_argument(
        "--tenant-policies",
        default="round_robin,cache_aware",
        help="cache_aware reads the replicas' KV events; cache_aware-tree: its guessed prefix tree alone",
    )
    p.add_argument("--overhead-concurrency", type=int, default=20)
    p.add_argument("--overhead-requests", type=int, default=25, help="per client per round")
    p.add_argument("--overhead-rounds", type=int, default=2)
    args = p.parse_args()
    args.mix_policies = args.mix_policies.split(",")
    parts = args.parts.split(",")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    log_dir = os.path.join(os.path.dirname(args.out) or ".", "router-logs")
    os.makedirs(log_dir, exist_ok=True)
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "python": platform.python_version(),
        "args": vars(args),
    }
    fleet = Fleet(log_dir)
    try:
        for part in parts:
            print(f"[{part}]", flush=True)
            result[part] = {"overhead": run_overhead, "tenants": run_tenants, "mix": run_mix}[part](fleet, args)
    finally:
        fleet.stop()
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "args"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
