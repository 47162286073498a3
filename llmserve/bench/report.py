"""Output: console tables, the JSON file, PNG plots (matplotlib, Agg) and a Markdown report."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .client import RequestRecord
from .loadgen import PhaseRun
from .metrics import request_tpot

METRICS = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2el_ms"))
STATS = ("mean", "median", "p90", "p95", "p99")
PLOTS = {"throughput": "throughput.png", "percentiles": "latency_percentiles.png", "cdf": "latency_cdf.png"}


def _f(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


# ---------------------------------------------------------------------------------------------
# Console


def errors_text(errors: dict) -> str:
    return ", ".join(f"{k} x{n}" for k, n in sorted(errors.items())) or "none"


def server_text(srv: dict) -> str:
    if not srv:
        return ""
    parts = []
    for key, label in (("running", "running"), ("waiting", "waiting")):
        if key in srv:
            parts.append(f"{label} mean {srv[key]['mean']:.1f} max {srv[key]['max']:.0f}")
    if "kv_usage" in srv:
        kv = srv["kv_usage"]
        parts.append(f"KV usage mean {100 * kv['mean']:.0f}% max {100 * kv['max']:.0f}%")
    if srv.get("prefix_cache_hit_rate") is not None:
        parts.append(f"prefix-cache hits {100 * srv['prefix_cache_hit_rate']:.0f}%")
    if "preemptions" in srv:
        parts.append(f"preemptions {srv['preemptions']:.0f}")
    if "generation_tokens" in srv:
        parts.append(f"generated tokens {srv['generation_tokens']:.0f}")
    return " | ".join(parts)


def phase_text(s: dict) -> str:
    """The figures of one phase, the way `vllm bench serve` prints them."""
    rows = [
        ("Requests completed / failed", f"{s['completed']} / {s['failed']}"),
        ("Errors", errors_text(s["errors"])),
        ("Wall time (s)", _f(s["duration_s"], 2)),
        ("Peak concurrency", str(s["peak_concurrency"])),
        ("Request throughput (req/s)", _f(s["request_throughput"], 2)),
        ("Output token throughput (tok/s)", _f(s["output_throughput"], 1)),
        ("Total token throughput (tok/s)", _f(s["total_token_throughput"], 1)),
        (
            "Input / output tokens",
            f"{s['total_input_tokens']} / {s['total_output_tokens']}"
            f"  (N from {', '.join(s['output_tokens_source']) or '-'})",
        ),
    ]
    if "goodput" in s:
        rows.append(
            ("Goodput (req/s)", f"{s['goodput']:.2f}  ({100 * s['slo_attainment']:.0f}% of requests met the SLO)")
        )
    head = f" {s['phase']} ".center(64, "=")
    body = "\n".join(f"{k + ':':<34}{v}" for k, v in rows)
    table = format_table(["(ms)"] + list(STATS), [[name] + [_f(s[key][st]) for st in STATS] for name, key in METRICS])
    srv = server_text(s.get("server") or {})
    return "\n".join([head, body, table] + ([f"Server: {srv}"] if srv else []))


def _level_header(mode: str) -> str:
    return {"concurrency": "concurrency", "rate": "rate (req/s)", "users": "users"}[mode]


def comparison_rows(summaries: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The articles' table (concurrency, total time, mean per request, req/s) and more."""
    headers = [
        _level_header(summaries[0]["mode"]),
        "requests",
        "errors",
        "total time (s)",
        "mean latency (s)",
        "time/request (s)",
        "req/s",
        "out tok/s",
        "TTFT p50 (ms)",
        "TTFT p99 (ms)",
        "TPOT p50 (ms)",
        "TPOT p99 (ms)",
    ]
    rows = []
    for s in summaries:
        e2e = s["e2el_ms"]["mean"]
        rows.append(
            [
                "inf" if math.isinf(s["level"]) else f"{s['level']:g}",
                str(s["requests"]),
                str(s["failed"]),
                _f(s["duration_s"], 2),
                _f(e2e / 1000 if e2e else None, 2),
                _f(s["time_per_request_s"], 2),
                _f(s["request_throughput"], 2),
                _f(s["output_throughput"], 1),
                _f(s["ttft_ms"]["median"]),
                _f(s["ttft_ms"]["p99"]),
                _f(s["tpot_ms"]["median"]),
                _f(s["tpot_ms"]["p99"]),
            ]
        )
    if any(s.get("server") for s in summaries):
        headers += ["srv waiting max", "srv KV max"]
        for s, row in zip(summaries, rows):
            srv = s.get("server") or {}
            row += [
                _f((srv.get("waiting") or {}).get("max"), 0),
                _f(100 * srv["kv_usage"]["max"], 0) + "%" if "kv_usage" in srv else "-",
            ]
    return headers, rows


def comparison_text(summaries: list[dict]) -> str:
    return format_table(*comparison_rows(summaries))


# ---------------------------------------------------------------------------------------------
# JSON


def record_dict(rec: RequestRecord, t0: float) -> dict:
    tpot = request_tpot(rec)
    return {
        "index": rec.index,
        "start_s": rec.start - t0,
        "end_s": rec.end - t0,
        "success": rec.success,
        "error": rec.error,
        "error_detail": rec.error_detail or None,
        "ttft_s": rec.ttft,
        "e2el_s": rec.e2e,
        "tpot_s": tpot,
        "itl_s": rec.itl,
        "prompt_len": rec.prompt_len,
        "prompt_tokens": rec.prompt_tokens,
        "max_tokens": rec.max_tokens,
        "output_tokens": rec.output_tokens,
        "output_tokens_source": rec.output_tokens_source or None,
        "chunks": rec.chunks,
        "finish_reason": rec.finish_reason,
        "output_chars": len(rec.text),
        "timeout_s": rec.timeout,
    }


def phase_json(run: PhaseRun, summary: dict) -> dict:
    return {"summary": summary, "requests": [record_dict(r, run.start) for r in run.records]}


def write_json(path: str | Path, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1, default=_json_default), encoding="utf-8")


def _json_default(x):
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    raise TypeError(f"not JSON serialisable: {type(x)}")


# ---------------------------------------------------------------------------------------------
# Plots


def write_plots(
    out_dir: str | Path, summaries: list[dict], runs: list[PhaseRun], knee: dict | None = None
) -> dict[str, str]:
    """throughput vs level, TTFT/TPOT percentiles vs level, latency CDFs; returns file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mode = summaries[0]["mode"]
    xs = list(range(len(summaries)))
    labels = ["inf" if math.isinf(s["level"]) else f"{s['level']:g}" for s in summaries]
    xlabel = _level_header(mode)

    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot(xs, [s["output_throughput"] for s in summaries], "o-", color="tab:blue")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(xs, [s["request_throughput"] for s in summaries], "s--", color="tab:orange")
    ax2.set_ylabel("requests/s", color="tab:orange")
    if knee is not None and knee["saturated"]:
        k = next((i for i, s in enumerate(summaries) if s["level"] == knee["level"]), None)
        if k is not None:
            ax.axvline(k, color="grey", ls=":", label="knee")
            ax.legend(loc="upper left")
    ax.set_xticks(xs, labels)
    ax.set_xlabel(xlabel)
    ax.set_title("Throughput")
    ax.set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(out / PLOTS["throughput"], dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (name, key) in zip(axes, (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"))):
        for st, style in (("median", "o-"), ("p90", "s--"), ("p99", "^:")):
            ys = [s[key][st] if s[key][st] is not None else float("nan") for s in summaries]
            ax.plot(xs, ys, style, label=st)
        ax.set_xticks(xs, labels)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} percentiles")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / PLOTS["percentiles"], dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (name, get) in zip(axes, (("TTFT", lambda r: r.ttft), ("E2E latency", lambda r: r.e2e))):
        for run in runs:
            vals = sorted(get(r) for r in run.records if r.success)
            if vals:
                ys = [0.0] + [(i + 1) / len(vals) for i in range(len(vals))]
                ax.step([vals[0] * 1000] + [v * 1000 for v in vals], ys, where="post", label=run.phase.name)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} CDF")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out / PLOTS["cdf"], dpi=100)
    plt.close(fig)
    return dict(PLOTS)


# ---------------------------------------------------------------------------------------------
# Markdown


def markdown_report(result: dict, plots: dict[str, str] | None = None) -> str:
    cfg, summaries = result["config"], [p["summary"] for p in result["phases"]]
    lines = [
        "# llmserve bench report",
        "",
        f"- server: `{cfg['base_url']}`, model `{cfg['model']}`, endpoint `{cfg['endpoint']}`",
        f"- dataset: `{cfg['dataset']}`, tokenizer: {cfg['tokenizer']}",
        f"- started: {cfg['started']}",
        "",
        "## Comparison across phases",
        "",
        markdown_table(*comparison_rows(summaries)),
        "",
    ]
    if result.get("advice"):
        lines += ["## Recommendation", ""] + [f"- {t}" for t in result["advice"]] + [""]
    if plots:
        lines += ["## Plots", ""] + [f"![{k}]({v})" for k, v in plots.items()] + [""]
    lines += ["## Phases", ""]
    for s in summaries:
        lines += [
            f"### {s['phase']}",
            "",
            f"{s['completed']} completed, {s['failed']} failed "
            f"(errors: {errors_text(s['errors'])}), wall time {s['duration_s']:.2f} s, "
            f"peak concurrency {s['peak_concurrency']}, "
            f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s"
            + (f", goodput {s['goodput']:.2f} req/s" if "goodput" in s else "")
            + ".",
            "",
            markdown_table(["(ms)"] + list(STATS), [[n] + [_f(s[k][st]) for st in STATS] for n, k in METRICS]),
            "",
        ]
        srv = server_text(s.get("server") or {})
        if srv:
            lines += [f"Server (`/metrics`): {srv}", ""]
    return "\n".join(lines)
