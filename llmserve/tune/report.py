"""What `llmserve tune` hands back: the YAML `llmserve serve --config` (or `llmserve launch --config`) reads, a
markdown report with a PNG plot (every candidate on the goodput / p95-latency plane, the SLO lines, the chosen
point, the defaults), and the capacity answer: how many replicas of the chosen config, on how many machines."""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from . import slo
from .search import Outcome
from .space import KNOBS, changes_answers, serve_settings


def write_yaml(path: str | Path, params: dict, cores: int, model: str | None, header: list[str]) -> None:
    settings = ({"model": model} if model else {}) | serve_settings(params, cores)
    text = "".join(f"# {line}\n" for line in header) + yaml.safe_dump(settings, sort_keys=False)
    Path(path).write_text(text, encoding="utf-8")


def capacity(best: dict, cores: int, users: int | None, think: float, rate: float | None) -> dict | None:
    """Replicas and machines for `rate` requests/s, or `users` who each wait `think` s between answers."""
    if not best or (users is None and rate is None):
        return None
    r = best["result"]
    per_machine = best.get("confirmed") or r["goodput"]
    if per_machine <= 0:
        return None
    if users is None:
        need, how = rate, f"{rate:g} requests/s"
    else:
        e2e = (r.get("best") or {}).get("e2el_mean") or 0.0
        need = users / (think + e2e / 1000.0)
        how = f"{users} users ({think:g} s think time + {e2e / 1000:.1f} s per answer: {need:.2f} requests/s)"
    machines = max(1, math.ceil(need / per_machine))
    per = best["params"]["replicas"]
    return {
        "load": how,
        "rate": need,
        "goodput_per_machine": per_machine,
        "machines": machines,
        "replicas": machines * per,
        "replicas_per_machine": per,
        "threads_per_replica": max(1, cores // per),
    }


def flags_text(params: dict, defaults: dict) -> str:
    diff = [f"{k}={params[k]}" for k in KNOBS if params[k] != defaults[k]]
    return ", ".join(diff) or "defaults"


def _point(m: dict, key: str) -> tuple[float | None, float]:
    r = m["result"]
    p = r.get("best") or (min(r["probes"], key=lambda p: p["rate"]) if r.get("probes") else None)
    return ((p or {}).get(key), r.get("goodput", 0.0))


def write_plot(path: str | Path, out: Outcome, bounds) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lat = [b for b in bounds if b.metric in ("ttft", "tpot", "e2el", "itl")][:2] or [slo.Bound("e2el", "p95", 0)]
    fig, axes = plt.subplots(1, len(lat), figsize=(6 * len(lat), 4.5), squeeze=False)
    best, defaults = out.best, out.defaults
    for ax, b in zip(axes[0], lat):
        xs, ys, colors = [], [], []
        for m in out.measured:
            x, y = _point(m, b.key)
            if x is None:
                continue
            xs.append(x)
            ys.append(y)
            colors.append("tab:red" if m["result"].get("refused") else "tab:blue")
        ax.scatter(xs, ys, c=colors, alpha=0.6, label="candidates (red: refused by the quality guard)")
        for m, style, label in ((defaults, "D", "defaults"), (best, "*", "chosen")):
            if m:
                x, y = _point(m, b.key)
                if x is not None:
                    ax.scatter([x], [y], marker=style, s=220, edgecolors="black", label=label, zorder=3)
        if b.ms:
            ax.axvline(b.ms, color="tab:red", linestyle="--", label=f"SLO {b.key} {b.ms:g} ms")
        ax.set_xlabel(f"{b.key} (ms) at the candidate's goodput rate")
        ax.set_ylabel("goodput (requests/s meeting the SLO)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("llmserve tune: every candidate")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path).name


def markdown(out: Outcome, bounds, meta: dict, plot: str | None, cap: dict | None) -> str:
    d = out.space.defaults
    best, dm = out.best, out.defaults
    lines = [
        "# llmserve tune report",
        "",
        f"- model: {meta.get('model') or 'bundled (SmolLM2-135M-Instruct)'}; machine: {out.space.cores} cores"
        f"{'; ' + meta['cpu'] if meta.get('cpu') else ''}",
        f"- workload: {meta.get('workload')}; SLO: {slo.text(bounds)} (every probe: no failed request)",
        f"- budget {meta.get('budget')}; {len(out.measured)} candidates measured"
        f" ({meta.get('resumed', 0)} read back from a previous run), {len(out.pruned)} pruned"
        + ("; **interrupted**: the best so far" if out.interrupted else ""),
        f"- search space ({out.space.size()} points): " + "; ".join(f"{k} {out.space.choices[k]}" for k in KNOBS),
        *[f"- note: {n}" for n in out.space.notes],
        "",
    ]
    rnd = out.confirmation
    if best:
        g, g0 = best["result"]["goodput"], (dm or {}).get("result", {}).get("goodput")
        ratio = f" ({g / g0:.2f}x the defaults' {g0:.3g}/s)" if g0 else ""
        if best.get("confirmed") is not None:
            g, g0 = best["confirmed"], rnd.confirmed(dm["number"]) if dm and dm["number"] in rnd.members else None
            ratio = f" ({g / g0:.2f}x the defaults' {g0:.3g}/s, re-measured in the same round)" if g0 else ratio
            ratio += f"; first figure {best['result']['goodput']:.3g}/s"
        lines += [f"**Chosen**: {flags_text(best['params'], d)}: goodput {g:.3g} requests/s{ratio}.", ""]
    else:
        c = out.closest(bounds)
        lines += ["**No candidate met the SLO.**"]
        if c:
            lines += [
                f"Closest: {flags_text(c['params'], d)} at {c['probe']['rate']:.3g} requests/s: "
                f"{', '.join(c['failed'])} over the bound ({c['over']:.2f}x)."
            ]
        lines += [""]
    if rnd:
        lines += [*confirmation_lines(out), ""]
    if cap:
        lines += [
            f"**Capacity** for {cap['load']}: {cap['replicas']} replicas ({cap['replicas_per_machine']} per machine, "
            f"{cap['threads_per_replica']} threads each) on {cap['machines']} machines like this one, behind "
            f"`llmserve route` (each machine: {cap['goodput_per_machine']:.3g} requests/s within the SLO).",
            "",
        ]
    if plot:
        lines += [f"![candidates]({plot})", ""]
    head = "| # | flags (vs defaults) | goodput /s | rate /s | " + " | ".join(b.key for b in bounds)
    lines += [head + " | agreement | logprob diff | s | load (1 min) |", "|" + "---|" * (8 + len(bounds))]
    for m in out.measured:
        r = m["result"]
        p = r.get("best") or {}
        q = r.get("quality") or {}
        cells = [
            str(m["number"]),
            flags_text(m["params"], d) + _verdict(r),
            f"{r['goodput']:.3g}",
            ("≥ " if r.get("ceiling") or r.get("open") else "") + f"{r.get('rate', 0):.3g}",
            *[f"{p.get(b.key):.0f}" if p.get(b.key) is not None else "-" for b in bounds],
            f"{q['agreement']:.3f}" if q else ("1 (float32)" if not changes_answers(m["params"]) else "-"),
            f"{q['logprob_diff']:.4f}" if q else "-",
            f"{r.get('seconds', 0):.0f}",
            _load(r) or "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if any(m["result"].get("ceiling") for m in out.measured):
        lines += ["", "≥: met the SLO at the probes' ceiling (--max-requests / --probe-seconds); a lower bound."]
    if any(m["result"].get("open") for m in out.measured):
        lines += ["", "≥: met the SLO at every probe, the search ended (--max-probes) before it broke; a lower bound."]
    if out.pruned:
        lines += ["", "Pruned (not measured):", ""]
        lines += [f"- {flags_text(p['params'], d)}: {p['rule']}" for p in out.pruned]
    effects = knob_effects(out)
    if effects:
        lines += ["", "What each knob did here (one flag changed from the defaults):", ""] + effects
    return "\n".join(lines) + "\n"


def confirmation_lines(out: Outcome) -> list[str]:
    """The confirmation round: each member's first figure beside its re-measured ones."""
    c, d = out.confirmation, out.space.defaults
    by_number = {m["number"]: m for m in out.measured}
    done = c.passes()
    state = (
        f"{done} complete pass{'es' if done != 1 else ''}" if done else "**incomplete**: chosen on the first figures"
    )
    lines = [
        f"Confirmation round {c.number} ({state}"
        + (f"; {c.reused} measurements read back from a previous run" if c.reused else "")
        + "): the best candidates re-measured back to back, the pick made on these figures:",
        "",
        "| trial | flags (vs defaults) | first goodput /s | re-measured goodput /s | confirmed /s | load (1 min) |",
        "|---|---|---|---|---|---|",
    ]
    for n in c.members:
        m = by_number[n]
        again = [r for r in c.records if r["of"] == n]
        figs = ", ".join(f"{r['result']['goodput']:.3g}" + (" (read back)" if i < c.reused else "") for i, r in
                         enumerate(c.records) if r in again)  # fmt: skip
        loads = [_load(m["result"])] + [_load(r["result"]) for r in again]
        conf = c.confirmed(n)
        lines.append(
            f"| {n} | {flags_text(m['params'], d)} | {m['result']['goodput']:.3g} | {figs or '-'} | "
            f"{'-' if conf is None else f'{conf:.3g}'} | {' / '.join(x for x in loads if x) or '-'} |"
        )
    return lines


def _load(r: dict) -> str:
    load = r.get("load")
    return f"{load[0]:.1f}-{load[1]:.1f}" if load else ""


def _verdict(r: dict) -> str:
    """Why a candidate has no goodput: refused, an error, or the SLO broken at its lowest probe."""
    if r.get("refused"):
        return " (refused by the quality guard)"
    if r.get("error"):
        return f" (error: {r['error'][:80]})"
    fail = r.get("fail")
    if not r.get("goodput") and fail:
        return f" (fails at {fail['rate']:.3g}/s: {'; '.join(fail.get('broken') or [])})"
    return ""


def knob_effects(out: Outcome) -> list[str]:
    dm = out.defaults
    if not dm or not dm["result"]["goodput"]:
        return []
    g0 = dm["result"]["goodput"]
    lines = []
    for m in out.measured:
        diff = [k for k in KNOBS if m["params"][k] != out.space.defaults[k]]
        if len(diff) == 1:
            k = diff[0]
            r = m["result"]
            what = "refused by the quality guard" if r.get("refused") else f"goodput {r['goodput'] / g0:.2f}x"
            lines.append(f"- {k} {out.space.defaults[k]} -> {m['params'][k]}: {what}")
    return lines
