"""The SLO `llmserve tune` tunes for: percentile bounds on a phase's latencies, e.g. `ttft_p95=2000,tpot_p95=150`.

A phase meets the SLO when every bound holds on its completed requests (bench's figures, llmserve/bench/metrics.py)
and no request failed; its goodput is then bench's (requests meeting every bound, per second of wall time).
"""

from __future__ import annotations

from dataclasses import dataclass

METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = ("p90", "p95", "p99", "mean", "median", "max")


@dataclass(frozen=True)
class Bound:
    metric: str  # ttft | tpot | itl | e2el
    stat: str  # p95, p99, mean, ...
    ms: float

    @property
    def key(self) -> str:
        return f"{self.metric}_{self.stat}"

    def value(self, summary: dict) -> float | None:
        return (summary.get(f"{self.metric}_ms") or {}).get(self.stat)


def parse_slo(text: str) -> tuple[Bound, ...]:
    """`"ttft_p95=2000,tpot_p95=150"` -> bounds; a ValueError naming the keys it knows for anything else."""
    bounds = []
    for part in (text or "").replace(" ", ",").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        metric, _, stat = key.strip().lower().partition("_")
        metric = {"e2e": "e2el"}.get(metric, metric)
        if not sep or metric not in METRICS or stat not in PERCENTILES:
            raise ValueError(
                f"--slo: unknown key {key.strip()!r}; use METRIC_STAT=MS with METRIC one of {', '.join(METRICS)} "
                f"and STAT one of {', '.join(PERCENTILES)} (e.g. ttft_p95=2000,tpot_p95=150)"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--slo: {key.strip()} needs a number of milliseconds, not {value!r}") from None
        if ms <= 0:
            raise ValueError(f"--slo: {key.strip()} must be positive")
        bounds.append(Bound(metric, stat, ms))
    if not bounds:
        raise ValueError("--slo: give at least one bound, e.g. ttft_p95=2000,tpot_p95=150")
    return tuple(bounds)


def bench_slo(bounds: tuple[Bound, ...]) -> dict[str, float]:
    """The per-request bounds bench's goodput counts (`summarize(run, slo)`): ttft, tpot, e2el."""
    out: dict[str, float] = {}
    for b in bounds:
        if b.metric in ("ttft", "tpot", "e2el"):
            out[b.metric] = min(out.get(b.metric, b.ms), b.ms)
    return out


def check(summary: dict, bounds: tuple[Bound, ...]) -> list[str]:
    """What broke in a phase: '' list when it meets the SLO. Failed requests break it too."""
    broken = []
    if summary.get("failed"):
        kinds = ", ".join(f"{k}: {v}" for k, v in (summary.get("errors") or {}).items())
        broken.append(f"{summary['failed']} failed requests" + (f" ({kinds})" if kinds else ""))
    if not summary.get("completed"):
        return broken or ["no request completed"]
    for b in bounds:
        v = b.value(summary)
        if v is not None and v > b.ms:
            broken.append(f"{b.key} {v:.0f} ms > {b.ms:.0f}")
    return broken


def text(bounds: tuple[Bound, ...]) -> str:
    return ",".join(f"{b.key}={b.ms:g}" for b in bounds)
