"""`llmserve tune`: find the serve flags with the highest goodput for your traffic under your SLO.

Examples:
  llmserve tune --slo ttft_p95=2000,tpot_p95=100 --output-len 512 --budget 20m --out tuned.yaml
  llmserve tune --model /models/llama-1b --slo ttft_p95=3000,tpot_p95=200 --workload requests.jsonl \\
      --max-replicas 2 --users 50 --out tuned.yaml
  llmserve serve --config tuned.yaml      # or, when it says replicas: N,  llmserve launch --config tuned.yaml

Each candidate is started as its own server on --port and load-tested with Poisson arrivals (llmserve bench's load);
its goodput is the highest request rate whose percentiles meet the SLO. The study is kept in REPORT_DIR/tune.db:
run the same command again to resume (what was measured is not measured again). Ctrl-C writes the best so far.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

from . import report, slo
from . import workload as workload_mod
from .space import KNOBS


class TuneError(Exception):
    pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    from llmserve.bench.cli import describe

    describe(p, __doc__)
    p.add_argument("--model", default=None, help="as `llmserve serve --model` takes it (default: the bundled model)")
    p.add_argument("--slo", required=True, help="bounds in ms, METRIC_STAT=MS: ttft_p95=2000,tpot_p95=150")
    p.add_argument("--budget", default="20m", help="wall time for the whole search: 90s, 20m, 1h")
    p.add_argument("--max-replicas", type=int, default=None, help="most servers per machine (default: the cores)")
    p.add_argument("--out", default="tuned.yaml", help="the chosen settings, for `llmserve serve --config`")
    p.add_argument(
        "--report-dir", default=None, help="report.md, candidates.png, tune.db (default: OUT's stem + -report)"
    )
    p.add_argument("--fresh", action="store_true", help="start a new study instead of resuming REPORT_DIR/tune.db")
    p.add_argument("--port", type=int, default=None, help="where candidates listen (replicas: the next ports)")
    g = p.add_argument_group("workload (a request log, or a dataset as llmserve bench takes it)")
    g.add_argument("--workload", default=None, help="JSONL request log: prompt or messages, max_tokens, arrival (s)")
    g.add_argument("--dataset", choices=["random", "prefix", "sharegpt", "prompts"], default="sharegpt")
    g.add_argument("--dataset-path", default=None)
    g.add_argument("--input-len", default="128", help="random/prefix: tokens, N or LO-HI")
    g.add_argument("--output-len", default=None, help="max_tokens, N or LO-HI (EOS honoured)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("search")
    g.add_argument(
        "--sampler", choices=["tpe", "grid"], default="tpe", help="Optuna's sampler beside the one-flag moves"
    )
    g.add_argument(
        "--knobs",
        default=None,
        help="search only these (comma-separated; the others stay at their defaults), e.g. "
        "max_num_seqs,max_num_batched_tokens (vLLM auto_tune's grid); default: all of " + ", ".join(KNOBS),
    )
    g.add_argument(
        "--grid-points",
        type=int,
        default=4,
        help="measure first this many of the points vLLM's auto_tune grid starts with (the defaults, then "
        "max_num_seqs x max_num_batched_tokens corners around them; 1: the defaults only)",
    )
    g.add_argument(
        "--confirm",
        type=int,
        default=2,
        help="re-measure this many best candidates back to back before choosing, the pick made on those figures "
        "(its time reserved from --budget; 0 or 1: choose on the single figures)",
    )
    g.add_argument("--probe-seconds", type=float, default=20.0, help="arrivals per rate probe span about this long")
    g.add_argument("--max-probes", type=int, default=5, help="rate probes per candidate")
    g.add_argument(
        "--max-requests",
        type=int,
        default=128,
        help="requests per rate probe at most; rates stop at --max-requests / --probe-seconds (above it a probe "
        "is a burst, not a load)",
    )
    g.add_argument(
        "--min-agreement",
        type=float,
        default=0.9,
        help="quality guard: greedy agreement with float32 a candidate needs (0: no guard, no float32 reference)",
    )
    g.add_argument("--quality-prompts", type=int, default=4, help="quality guard: prompts scored")
    g.add_argument("--quality-tokens", type=int, default=32, help="quality guard: answer tokens per prompt")
    g = p.add_argument_group("capacity")
    g.add_argument("--users", type=int, default=None, help="how many replicas for this many users")
    g.add_argument("--think-time", type=float, default=10.0, help="seconds a user reads before the next request")
    g.add_argument("--rate", type=float, default=None, help="how many replicas for this many requests/s")


def parse_budget(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h|)\s*", str(text))
    if not m:
        raise ValueError(f"--budget: {text!r} is not a duration (90s, 20m, 1h)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def validate(args) -> tuple:
    """Everything that can be checked before a server starts; TuneError with the reason."""
    from .objective import MIN_PROBE_REQUESTS, START_SECONDS

    try:
        bounds = slo.parse_slo(args.slo)
        budget = parse_budget(args.budget)
        wl = workload_mod.from_args(args)
    except ValueError as e:
        raise TuneError(str(e)) from None
    need = START_SECONDS + args.probe_seconds
    if budget < need:
        raise TuneError(
            f"--budget {args.budget} is too small for one candidate (~{need:.0f} s: a server start, "
            f"~{START_SECONDS:.0f} s, and a rate probe of --probe-seconds {args.probe_seconds:g}); give at least "
            f"--budget {need:.0f}s"
        )
    if not 0 <= args.min_agreement <= 1:
        raise TuneError("--min-agreement is a fraction, 0 to 1")
    unknown = set((args.knobs or "").replace(" ", "").split(",")) - set(KNOBS) - {""}
    if unknown:
        raise TuneError(f"--knobs: unknown {', '.join(sorted(unknown))}; the knobs are {', '.join(KNOBS)}")
    if args.grid_points < 1 or args.confirm < 0:
        raise TuneError("--grid-points must be >= 1 and --confirm >= 0")
    if args.max_requests < MIN_PROBE_REQUESTS:
        raise TuneError(f"--max-requests must be >= {MIN_PROBE_REQUESTS} (a probe's fewest requests)")
    if args.max_replicas is not None and args.max_replicas < 1:
        raise TuneError("--max-replicas must be >= 1")
    return bounds, budget, wl


def run(args: argparse.Namespace) -> int:
    try:
        return tune(args)
    except TuneError as e:
        print(f"llmserve tune: {e}", file=sys.stderr)
        return 2


def _request_tokens(wl, args) -> float:
    if wl.log:
        return sum(r.output_len + len(r.prompt) / 4 for r in wl.log) / len(wl.log)
    out = workload_mod.parse_range(args.output_len) if args.output_len else (256, 256)
    return sum(out) / 2 + 256


def tune(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from llmserve.testing.launcher import free_port

    from . import objective, space
    from .search import Tuner

    bounds, budget, wl = validate(args)
    try:
        gaps = [b.ms for b in bounds if b.metric in ("tpot", "itl")]
        sp = space.for_model(args.model, _request_tokens(wl, args), args.max_replicas, min(gaps, default=None))
    except (ValueError, OSError, FileNotFoundError) as e:
        raise TuneError(f"--model: {e}") from None
    if args.knobs:
        keep = set(args.knobs.replace(" ", "").split(","))
        sp.choices = {k: (v if k in keep else [sp.defaults[k]]) for k, v in sp.choices.items()}
    out_path = Path(args.out)
    rdir = Path(args.report_dir or out_path.with_name(out_path.stem + "-report"))
    rdir.mkdir(parents=True, exist_ok=True)
    db = rdir / "tune.db"
    if args.fresh and db.exists():
        db.unlink()
    ident = json.dumps([args.model, wl.label, slo.text(bounds), sp.choices], sort_keys=True, default=str)
    name = "tune-" + hashlib.sha1(ident.encode()).hexdigest()[:12]
    console = Console(stderr=True)
    ctx = objective.Context(
        model=args.model,
        cores=sp.cores,
        bounds=bounds,
        workload=wl,
        out_dir=str(rdir),
        port=args.port or free_port(),
        probe_seconds=args.probe_seconds,
        max_probes=args.max_probes,
        max_requests=args.max_requests,
        min_agreement=args.min_agreement,
        quality_prompts=args.quality_prompts,
        quality_tokens=args.quality_tokens,
        log=lambda s: console.print(s, highlight=False),
    )
    t0 = time.monotonic()
    ctx.deadline = t0 + budget
    console.print(
        f"llmserve tune: {sp.size()} points ({', '.join(f'{k} {v}' for k, v in sp.choices.items())}); "
        f"SLO {slo.text(bounds)}; workload {wl.label}; budget {budget:.0f} s; report in {rdir}",
        highlight=False,
    )
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console)
    task = progress.add_task("budget", total=budget)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(1.0):
            progress.update(task, completed=min(budget, time.monotonic() - t0))

    interrupted = False
    with progress:
        threading.Thread(target=tick, daemon=True).start()
        try:
            ref_path = rdir / f"quality-{name}.json"
            guarded = any(space.changes_answers({**sp.defaults, k: v}) for k in sp.choices for v in sp.choices[k])
            if guarded and args.min_agreement > 0:
                if ref_path.exists():
                    ctx.reference = json.loads(ref_path.read_text())
                else:
                    console.print("quality guard: the float32 model's answers (reference)", highlight=False)
                    ctx.reference = objective.measure_reference(ctx, sp.defaults)
                    ref_path.write_text(json.dumps(ctx.reference))

            def on_result(entry: dict) -> None:
                r = entry["result"]
                if r["goodput"] > 0 and (ctx.hint is None or r["goodput"] > ctx.hint):
                    ctx.hint = r["rate"]
                best = tuner.best()
                desc = f"best {best['result']['goodput']:.3g} req/s" if best else "no candidate meets the SLO yet"
                progress.update(task, description=f"{len(tuner.measured)} measured, {desc}")

            tuner = Tuner(
                sp,
                lambda params, tag: objective.measure(ctx, params, tag),
                bounds,
                f"sqlite:///{db}",
                name,
                budget_s=max(0.0, ctx.deadline - time.monotonic()),
                sampler=args.sampler,
                seed=args.seed,
                log=ctx.log,
                estimate_s=objective.START_SECONDS + args.probe_seconds * 2,
                on_result=on_result,
                grid_points=args.grid_points,
                confirm=args.confirm,
                remeasure=lambda params, tag, start: objective.measure(ctx, params, tag, start=start),
            )
            if tuner.resumed:
                console.print(f"resumed: {tuner.resumed} candidates read back from {db}", highlight=False)
                best = tuner.best()
                ctx.hint = best["result"]["rate"] if best else None
            outcome = tuner.run()
        except KeyboardInterrupt:
            interrupted = True
            outcome = None
        finally:
            stop.set()
    if outcome is None:  # interrupted before the search began
        console.print("interrupted before any candidate was measured", highlight=False)
        return 130
    outcome.interrupted = outcome.interrupted or interrupted
    return finish(args, outcome, bounds, wl, budget, rdir, out_path, tuner.resumed, console)


def finish(args, outcome, bounds, wl, budget, rdir: Path, out_path: Path, resumed: int, console) -> int:
    best = outcome.best
    cap = report.capacity(best, outcome.space.cores, args.users, args.think_time, args.rate)
    try:
        plot = report.write_plot(rdir / "candidates.png", outcome, bounds) if outcome.measured else None
    except Exception as e:  # noqa: BLE001 - a plot that fails leaves the report and the YAML
        console.print(f"note: no plot ({e!r})", highlight=False)
        plot = None
    meta = {"model": args.model, "workload": wl.label, "budget": args.budget, "resumed": resumed, "cpu": _cpu()}
    md = report.markdown(outcome, bounds, meta, plot, cap)
    (rdir / "report.md").write_text(md, encoding="utf-8")
    data = {"measured": outcome.measured, "pruned": outcome.pruned, "capacity": cap, "slo": slo.text(bounds)}
    if outcome.confirmation:
        data["confirmation"] = outcome.confirmation.as_dict()
    (rdir / "candidates.json").write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
    if best is None and outcome.interrupted and not outcome.measured:
        console.print("llmserve tune: interrupted before any candidate was measured", highlight=False)
        return 130
    if best is None:
        c = outcome.closest(bounds)
        msg = "no candidate met the SLO " + slo.text(bounds)
        if c:
            msg += (
                f"; closest: {report.flags_text(c['params'], outcome.space.defaults)} at {c['probe']['rate']:.3g} "
                f"requests/s, failed on {', '.join(c['failed'])} ({c['over']:.2f}x the bound)"
            )
        console.print(f"llmserve tune: {msg}; report: {rdir / 'report.md'}", highlight=False)
        return 3
    g, first = best.get("confirmed") or best["result"]["goodput"], best["result"]["goodput"]
    how = f" (confirmed; first figure {first:.3g})" if best.get("confirmed") else ""
    header = [
        f"llmserve tune: goodput {g:.3g} requests/s{how} under {slo.text(bounds)} on {wl.label}",
        f"({len(outcome.measured)} candidates; report: {rdir / 'report.md'})",
    ]
    if best["params"]["replicas"] > 1:
        header.append(f"several replicas: start with `llmserve launch --config {out_path.name}`")
    report.write_yaml(out_path, best["params"], outcome.space.cores, args.model, header)
    console.print(
        f"llmserve tune: chosen {report.flags_text(best['params'], outcome.space.defaults)}: goodput {g:.3g} "
        f"requests/s{how}; wrote {out_path} and {rdir / 'report.md'}"
        + (" (interrupted: best so far)" if outcome.interrupted else ""),
        highlight=False,
    )
    if cap:
        console.print(
            f"capacity for {cap['load']}: {cap['replicas']} replicas on {cap['machines']} machines", highlight=False
        )
    return 0


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return os.uname().machine
