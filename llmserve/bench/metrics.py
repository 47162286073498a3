"""Per-request records -> the figures of a phase, and the knee and SLO limit across phases.

Definitions (the same as `vllm bench serve`, so numbers compare; see docs/bench.md):
  TTFT    time from sending the request to the first chunk with non-empty content
  E2E     time from sending the request to the end of the stream
  TPOT    per request (E2E - TTFT) / (N - 1), N = output tokens; requests with N <= 1 have none
          (and count as 0 for goodput, as in vLLM)
  ITL     every gap between two consecutive content chunks, over all requests
  request / output-token / total-token throughput: completed requests / output tokens / input +
          output tokens of completed requests, over the wall time of the phase
  goodput completed requests that meet every SLO, per second of wall time
N is the usage chunk's completion_tokens when the server sends one, else the answer re-tokenised.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable, Sequence

import numpy as np

from .client import RequestRecord
from .loadgen import PhaseRun

SLO_KEYS = ("ttft", "tpot", "e2el")


def distribution(seconds: Sequence[float]) -> dict:
    """mean / median / std / min / max / p90 / p95 / p99, in milliseconds (None when empty)."""
    keys = ("mean", "median", "std", "min", "max", "p90", "p95", "p99")
    if len(seconds) == 0:
        return {k: None for k in keys}
    a = np.asarray(seconds, dtype=float) * 1000.0
    p90, p95, p99 = np.percentile(a, [90, 95, 99])  # linear interpolation, as numpy and vLLM
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "std": float(a.std()),
        "min": float(a.min()),
        "max": float(a.max()),
        "p90": float(p90),
        "p95": float(p95),
        "p99": float(p99),
    }


def parse_slo(items: Iterable[str] | str | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` or `"ttft:500,tpot:50"` -> {"ttft": 500.0, "tpot": 50.0} (ms)."""
    if not items:
        return {}
    if isinstance(items, str):
        items = [items]
    slo = {}
    for item in items:
        for part in item.replace(",", " ").split():
            key, _, value = part.partition(":")
            key = {"e2e": "e2el"}.get(key.strip().lower(), key.strip().lower())
            if key not in SLO_KEYS or not value:
                raise ValueError(f"bad SLO {part!r}: use ttft:MS, tpot:MS or e2el:MS")
            slo[key] = float(value)
    return slo


def request_tpot(rec: RequestRecord) -> float | None:
    """(E2E - TTFT) / (N - 1) in seconds; None when N <= 1 or the request failed."""
    if not rec.success or rec.ttft is None or not rec.output_tokens or rec.output_tokens <= 1:
        return None
    return (rec.e2e - rec.ttft) / (rec.output_tokens - 1)


def meets_slo(rec: RequestRecord, slo: dict[str, float]) -> bool:
    if not rec.success:
        return False
    got = {"ttft": rec.ttft, "tpot": request_tpot(rec) or 0.0, "e2el": rec.e2e}
    return all(got[k] * 1000.0 <= bound for k, bound in slo.items())


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """The most requests in flight at once (failed ones too: they held a slot)."""
    edges = sorted(
        [(r.start, 1) for r in records] + [(r.end, -1) for r in records], key=lambda e: (e[0], e[1])
    )  # an end before a start at the same instant
    peak = now = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return peak


def summarize(run: PhaseRun, slo: dict[str, float] | None = None) -> dict:
    """Every figure of one phase (times in ms, throughputs per second of wall time)."""
    recs, wall = run.records, max(run.wall_time, 1e-9)
    ok = [r for r in recs if r.success]
    out_tokens = [r.output_tokens or 0 for r in ok]
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    tpots = [t for t in (request_tpot(r) for r in ok) if t is not None]
    summary = {
        "phase": run.phase.name,
        "mode": run.phase.mode,
        "level": run.phase.level,
        "requests": len(recs),
        "completed": len(ok),
        "failed": len(recs) - len(ok),
        "errors": dict(Counter(r.error for r in recs if not r.success)),
        "duration_s": run.wall_time,
        "total_input_tokens": in_tokens,
        "total_output_tokens": sum(out_tokens),
        "request_throughput": len(ok) / wall,
        "output_throughput": sum(out_tokens) / wall,
        "total_token_throughput": (in_tokens + sum(out_tokens)) / wall,
        "time_per_request_s": wall / len(ok) if ok else None,  # the articles' "mean per request"
        "peak_concurrency": peak_concurrency(recs),
        "output_tokens_source": dict(Counter(r.output_tokens_source for r in ok)),
        "ttft_ms": distribution([r.ttft for r in ok]),
        "tpot_ms": distribution(tpots),
        "itl_ms": distribution([g for r in ok for g in r.itl]),
        "e2el_ms": distribution([r.e2e for r in ok]),
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in recs)
        summary.update(
            slo=slo, good_requests=good, goodput=good / wall, slo_attainment=good / len(recs) if recs else 0.0
        )
    return summary


def find_knee(summaries: Sequence[dict]) -> dict | None:
    """The sweep's knee: the level with the highest power = throughput / mean latency.

    Power (Kleinrock) rises while more load buys throughput at little latency cost and falls once
    throughput flattens while latency keeps growing, so its maximum marks where the curve bends.
    Throughput is output tokens/s (requests/s when there are no tokens); latency is mean E2E.
    """
    points = [s for s in summaries if s["completed"] and s["e2el_ms"]["mean"]]
    if len(points) < 2:
        return None
    points = sorted(points, key=lambda s: s["level"])
    key = "output_throughput" if all(s["output_throughput"] > 0 for s in points) else "request_throughput"
    power = [s[key] / s["e2el_ms"]["mean"] for s in points]
    i = int(np.argmax(power))
    knee = {
        "level": points[i]["level"],
        "phase": points[i]["phase"],
        "throughput_key": key,
        "throughput": points[i][key],
        "mean_e2el_ms": points[i]["e2el_ms"]["mean"],
        "saturated": i < len(points) - 1,
    }
    if knee["saturated"]:
        last = points[-1]
        knee["beyond"] = {
            "level": last["level"],
            "throughput_gain": last[key] / max(points[i][key], 1e-9),
            "latency_gain": last["e2el_ms"]["mean"] / points[i]["e2el_ms"]["mean"],
        }
    return knee


def best_under_slo(summaries: Sequence[dict], percentile: float = 90.0) -> dict | None:
    """The highest level at which at least `percentile`% of requests met every SLO."""
    meeting = [s for s in summaries if "slo_attainment" in s and s["slo_attainment"] * 100.0 >= percentile - 1e-9]
    if not meeting:
        return None
    best = max(meeting, key=lambda s: s["level"] if not math.isinf(s["level"]) else 1e18)
    return {
        "level": best["level"],
        "phase": best["phase"],
        "slo_attainment": best["slo_attainment"],
        "goodput": best["goodput"],
    }
