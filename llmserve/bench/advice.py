"""Turn a sweep's figures into a short recommendation: which setting to change, and why.

The rules read the client figures (knee, SLO, errors, TTFT vs TPOT growth) and, where the server
exposes Prometheus metrics, the server-side ones of the heaviest phase (requests waiting, KV-cache
usage, preemptions, prefix-cache hit rate). Flag names are llmserve's, which follow vLLM's.
"""

from __future__ import annotations

import math

KV_HIGH, KV_LOW = 0.90, 0.50
RUNNING_PLATEAU = 0.8  # running mean / peak from which the batch counts as held at a cap


def _lvl(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:g}"


def _at(mode: str, level: float) -> str:
    """How a level reads in a sentence: concurrency 5, 2 requests/s, 10 users."""
    return {
        "concurrency": f"concurrency {_lvl(level)}",
        "rate": f"{_lvl(level)} requests/s",
        "users": f"{_lvl(level)} users",
    }[mode]


def recommend(
    summaries: list[dict],
    knee: dict | None = None,
    slo_best: dict | None = None,
    slo: dict | None = None,
    slo_percentile: float = 90.0,
    dataset: str | None = None,
) -> list[str]:
    if not summaries:
        return []
    tips: list[str] = []
    mode = summaries[0]["mode"]
    ordered = sorted(summaries, key=lambda s: s["level"])
    heavy = ordered[-1]

    if knee is not None:
        if knee["saturated"]:
            b = knee["beyond"]
            tips.append(
                f"Knee at {_at(mode, knee['level'])}: going to {_lvl(b['level'])} gave "
                f"x{b['throughput_gain']:.2f} throughput for x{b['latency_gain']:.2f} mean latency. "
                f"Run each server at about {_at(mode, knee['level'])}; for more load add replicas "
                f"(`llmserve launch` / `llmserve route`) rather than queueing deeper."
            )
        else:
            tips.append(
                f"No knee within the sweep: throughput still grew up to "
                f"{_at(mode, heavy['level'])}. Extend the sweep (e.g. {_lvl(heavy['level'] * 2)},"
                f"{_lvl(heavy['level'] * 4)}) to find where it flattens."
            )

    if slo:
        spec = " ".join(f"{k}<={v:g}ms" for k, v in slo.items())
        if slo_best is not None:
            tips.append(
                f"SLO ({spec} for {slo_percentile:g}% of requests) holds up to "
                f"{_at(mode, slo_best['level'])} (goodput {slo_best['goodput']:.2f} req/s)."
            )
        else:
            low = ordered[0]
            failed = f" ({low['failed']} of {low['requests']} failed)" if low["failed"] else ""
            tips.append(
                f"No level met the SLO ({spec} for {slo_percentile:g}% of requests); at "
                f"{_at(mode, low['level'])} only {100 * low.get('slo_attainment', 0):.0f}% did"
                f"{failed}. Lower the load below the sweep's first level, shorten outputs, or use "
                "a faster device or smaller model."
            )

    tips += _error_tips(ordered)
    tips += _server_tips(heavy, dataset, saturated=bool(knee and knee["saturated"]))
    tips += _latency_tips(ordered)
    return tips


def _error_tips(ordered: list[dict]) -> list[str]:
    tips = []
    for s in ordered:
        errs = s["errors"]
        if not errs:
            continue
        at = f"at {s['phase']}"
        if errs.get("timeout"):
            tips.append(
                f"{errs['timeout']} request(s) timed out {at}: the server is overloaded "
                "there, or the client deadline is too short (`--timeout`, "
                "`--timeout-per-token`)."
            )
        shed = sum(n for k, n in errs.items() if k in ("http_429", "http_503"))
        if shed:
            tips.append(
                f"{shed} request(s) were refused (429/503) {at}: the server's queue is "
                "full; lower the load or raise its queue limit."
            )
        if errs.get("incomplete_stream"):
            tips.append(
                f"{errs['incomplete_stream']} stream(s) were cut off {at}: check the "
                "server log and any proxy idle timeout."
            )
        other = {k: n for k, n in errs.items() if k not in ("timeout", "http_429", "http_503", "incomplete_stream")}
        if other:
            tips.append(f"Other errors {at}: " + ", ".join(f"{k} x{n}" for k, n in sorted(other.items())) + ".")
    return tips


def _at_a_cap(srv: dict) -> bool:
    """Whether the running batch sat at its peak (a cap such as --max-num-seqs) rather than moving below it: its
    mean over the phase within RUNNING_PLATEAU of its peak (the phase's ramp and drain pull the mean down a little;
    a batch starved of prefill moves far below its peak: 64 users, 1B Q4_K_M, mean 35 against a peak of 48)."""
    r = srv.get("running") or {}
    return bool(r.get("max")) and r.get("mean", 0.0) >= RUNNING_PLATEAU * r["max"]


def _server_tips(heavy: dict, dataset: str | None, saturated: bool) -> list[str]:
    srv = heavy.get("server") or {}
    if not srv:
        return []
    tips = []
    waiting = (srv.get("waiting") or {}).get("mean", 0.0)
    waiting_max = (srv.get("waiting") or {}).get("max", 0.0)
    kv = (srv.get("kv_usage") or {}).get("max")
    running = (srv.get("running") or {}).get("max")
    pre = srv.get("preemptions") or 0
    at = f"At {heavy['phase']}"
    if waiting_max >= 1 and ((kv is not None and kv >= KV_HIGH) or pre > 0):
        tips.append(
            f"{at} requests waited (mean {waiting:.1f}) while the KV cache was "
            f"{100 * (kv or 0):.0f}% full: memory is the limit. Raise the KV budget "
            "(`--kv-cache-memory` GiB on CPU, `--gpu-memory-utilization` on CUDA) or lower "
            "`--max-model-len` so that more sequences fit."
        )
    elif waiting_max >= 1 and kv is not None and kv < KV_LOW and _at_a_cap(srv):
        tips.append(
            f"{at} requests waited (mean {waiting:.1f}, max {waiting_max:.0f}) while the "
            f"KV cache was only {100 * kv:.0f}% used (running held at "
            f"{running:.0f}): the sequence cap is the limit. Raise `--max-num-seqs`."
        )
    elif waiting_max >= 1 and kv is not None and kv < KV_LOW:
        running_mean = (srv.get("running") or {}).get("mean", 0.0)
        tips.append(
            f"{at} requests waited (mean {waiting:.1f}, max {waiting_max:.0f}) with the KV cache only "
            f"{100 * kv:.0f}% used and the running batch below any cap (mean {running_mean:.1f}, peak "
            f"{running:.0f}): prompts waited for their prefill, so compute is the limit at this load. A step's "
            "prompt share is `--max-num-batched-tokens` and, on CPU, `--max-step-ms` (longer steps: more "
            "throughput, longer gaps between tokens); replicas add throughput."
        )
    elif waiting_max < 1 and running is not None and saturated:
        tips.append(
            f"{at} the server admitted every request (nothing waited; up to "
            f"{running:.0f} running) yet throughput grew less than latency: it is "
            "compute-bound, so more load mostly slows each token. "
            "`--max-num-batched-tokens` trades TTFT against TPOT; replicas add throughput."
        )
    if pre > 0:
        tips.append(
            f"{at} the server preempted sequences {pre:.0f} time(s) (recomputed from "
            "scratch): give the KV cache more memory or lower `--max-num-seqs`."
        )
    hit = srv.get("prefix_cache_hit_rate")
    if dataset == "prefix" and hit is not None and hit < 0.3:
        tips.append(
            f"Prefix-cache hit rate was only {100 * hit:.0f}% on a shared-prefix dataset: "
            "check that prefix caching is on (`--enable-prefix-caching`) and that the KV "
            "cache is large enough to keep the prefix."
        )
    return tips


def _latency_tips(ordered: list[dict]) -> list[str]:
    first, last = ordered[0], ordered[-1]
    if first is last:
        return []
    try:
        ttft_g = last["ttft_ms"]["median"] / first["ttft_ms"]["median"]
        tpot_g = last["tpot_ms"]["median"] / first["tpot_ms"]["median"]
    except (TypeError, ZeroDivisionError):
        return []
    if ttft_g > 3 and ttft_g > 2 * tpot_g:
        return [
            f"Median TTFT grew x{ttft_g:.1f} from {first['phase']} to {last['phase']} while "
            f"TPOT grew x{tpot_g:.1f}: requests queue before their prefill. A larger "
            "`--max-num-batched-tokens` (more prefill per step) or more replicas shorten "
            "the queue."
        ]
    return []
