"""`llmserve bench`: load-test any OpenAI-compatible server (llmserve, vLLM, llama.cpp, SGLang).

Examples:
  llmserve bench --base-url http://127.0.0.1:8000 --concurrency 1,5,20 --num-requests 10,5,20
  llmserve bench --base-url URL --request-rate 1,2,4,inf --dataset random --input-len 256 \\
      --output-len 64-128 --goodput ttft:500 tpot:50 --output-dir bench-out
  llmserve bench --base-url URL --users 10 --think-time 1-3 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections import deque
from datetime import datetime, timezone
from pathlib import Path

from . import advice, report
from .client import ENDPOINTS, OpenAIClient, RequestRecord
from .datasets import DatasetConfig, build_requests, parse_range, pick_tokenizer
from .loadgen import LoadPhase, PhaseRun, run_phase
from .metrics import best_under_slo, find_knee, parse_slo, summarize
from .scrape import MetricsScraper

DURATION_POOL = 256  # distinct requests prepared per phase in --duration mode (then cycled)


class BenchError(Exception):
    pass


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def describe(p: argparse.ArgumentParser, doc: str) -> None:
    """A subcommand's --help: its module docstring's examples as the epilog, defaults shown (bench, tune)."""
    p.epilog = doc.split("\n", 2)[2]
    p.formatter_class = _HelpFormatter


def add_arguments(p: argparse.ArgumentParser) -> None:
    describe(p, __doc__)
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is fine)")
    g.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)"
    )
    g.add_argument(
        "--model",
        default=None,
        help="model name (default: the first of /v1/models); several, comma-separated: requests take them in turn",
    )
    g.add_argument(
        "--endpoint",
        choices=list(ENDPOINTS),
        default="chat",
        help="the API to load: "
        + ", ".join(f"{k} ({v})" for k, v in ENDPOINTS.items())
        + "; embeddings are not streamed (TTFT = latency, no output tokens)",
    )
    g.add_argument(
        "--metrics-url",
        default="auto",
        help="Prometheus endpoint to scrape during each phase: auto (BASE/metrics, "
        "skipped when absent), a URL or path, or none",
    )
    g.add_argument("--scrape-interval", type=float, default=1.0, help="seconds")

    g = p.add_argument_group("load (one of --concurrency, --request-rate, --users)")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--concurrency", help="closed loop; a comma list is a sweep, e.g. 1,5,20")
    m.add_argument(
        "--request-rate",
        help="open loop, requests/s with Poisson arrivals (see --burstiness); "
        "'inf' sends all at once; a comma list is a sweep, e.g. 1,2,4,inf",
    )
    m.add_argument("--users", help="locust-like users who wait --think-time between requests; a comma list is a sweep")
    g.add_argument(
        "--num-requests",
        default=None,
        help="requests per phase, or a comma list, one per level (default: "
        "max(10, 2 x level); rate: max(20, 10 x rate), 50 for inf)",
    )
    g.add_argument("--duration", type=float, default=None, help="seconds per phase instead of a request count")
    g.add_argument("--warmup", type=int, default=0, help="requests sent (and not measured) before the first phase")
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier, >1 steadier",
    )
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight in --request-rate mode")
    g.add_argument("--think-time", default="1-3", help="seconds, LO-HI, for --users")
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("requests")
    g.add_argument(
        "--dataset",
        choices=["random", "prefix", "sharegpt", "prompts"],
        default="sharegpt",
        help="sharegpt without --dataset-path uses the shipped sample of 40 conversations",
    )
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON, or .txt/.jsonl prompts")
    g.add_argument("--input-len", default="128", help="random/prefix: tokens, N or LO-HI")
    g.add_argument(
        "--output-len",
        default=None,
        help="max_tokens, N or LO-HI (default: the answer's length for sharegpt, 128 otherwise)",
    )
    g.add_argument("--prefix-len", type=int, default=256, help="prefix dataset: shared tokens")
    g.add_argument(
        "--tokenizer",
        default="auto",
        help="auto (the server's /tokenize, else words), server, words, or a local Hugging Face tokenizer path",
    )
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens (vLLM/llmserve extension)")
    g.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    g.add_argument(
        "--timeout",
        default="auto",
        help="per-request deadline in seconds, or auto = 60 s + --timeout-per-token x "
        "max_tokens + 2 ms x prompt tokens",
    )
    g.add_argument("--timeout-per-token", type=float, default=0.5)

    g = p.add_argument_group("results")
    g.add_argument(
        "--goodput",
        "--slo",
        dest="slo",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs, e.g. ttft:500 tpot:50 e2el:5000: goodput counts requests meeting "
        "all; the advice names the highest level where --slo-percentile %% do",
    )
    g.add_argument("--slo-percentile", type=float, default=90.0)
    g.add_argument("--output-json", default=None, help="every figure and per-request records")
    g.add_argument("--output-dir", default=None, help="writes bench.json, PNG plots and report.md here")
    g.add_argument(
        "--no-progress", action="store_true", help="no live progress bar (it shows only on a terminal anyway)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        asyncio.run(bench(args))
    except BenchError as e:
        print(f"llmserve bench: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


# ---------------------------------------------------------------------------------------------


def _levels(text: str) -> list[float]:
    try:
        return [math.inf if x.strip().lower() == "inf" else float(x) for x in text.split(",")]
    except ValueError:
        raise BenchError(f"bad level list {text!r}") from None


def phases_from_args(args: argparse.Namespace) -> list[LoadPhase]:
    if args.request_rate:
        mode, levels = "rate", _levels(args.request_rate)
    elif args.users:
        mode, levels = "users", _levels(args.users)
    else:
        mode, levels = "concurrency", _levels(args.concurrency or "1")
    if any(lv <= 0 or (mode != "rate" and (math.isinf(lv) or lv != int(lv))) for lv in levels):
        raise BenchError(
            f"--{mode.replace('rate', 'request-rate')} needs positive {'numbers' if mode == 'rate' else 'integers'}"
        )
    counts: list[int | None]
    if args.num_requests:
        try:
            counts = [int(x) for x in str(args.num_requests).split(",")]
        except ValueError:
            raise BenchError(f"bad --num-requests {args.num_requests!r}") from None
        if len(counts) == 1:
            counts *= len(levels)
        if len(counts) != len(levels) or min(counts) < 1:
            raise BenchError("--num-requests needs one positive count, or one per level")
    elif args.duration:
        counts = [None] * len(levels)  # the duration alone ends each phase
    else:
        counts = [default_count(mode, lv) for lv in levels]
    try:
        lo, _, hi = args.think_time.partition("-")
        think = (float(lo), float(hi or lo))
    except ValueError:
        raise BenchError(f"bad --think-time {args.think_time!r}") from None
    return [
        LoadPhase(mode, lv, n, args.duration, args.burstiness, args.max_concurrency, think)
        for lv, n in zip(levels, counts)
    ]


def default_count(mode: str, level: float) -> int:
    if mode == "rate":
        return 50 if math.isinf(level) else max(20, math.ceil(10 * level))
    return max(10, int(2 * level))


class Progress:
    """A tqdm bar per phase: requests done, errors, output tok/s over the last 5 s."""

    WINDOW = 5.0

    def __init__(self, desc: str, total: int | None, enabled: bool) -> None:
        from tqdm import tqdm

        # disable=None: on only when stderr is a terminal
        self.bar = tqdm(
            total=total,
            desc=desc,
            unit="req",
            disable=None if enabled else True,
            leave=True,
            dynamic_ncols=True,
            file=sys.stderr,
        )
        self.errors, self.t0 = 0, time.perf_counter()
        self.stamps: deque[float] = deque()
        self._task: asyncio.Task | None = None

    def on_chunk(self) -> None:
        self.stamps.append(time.perf_counter())

    def on_done(self, rec: RequestRecord) -> None:
        self.errors += not rec.success
        self.bar.update(1)
        self._refresh()

    def _refresh(self) -> None:
        now = time.perf_counter()
        while self.stamps and self.stamps[0] < now - self.WINDOW:
            self.stamps.popleft()
        span = min(self.WINDOW, max(now - self.t0, 1e-3))
        self.bar.set_postfix(errors=self.errors, tok_s=f"{len(self.stamps) / span:.1f}", refresh=True)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            self._refresh()

    def start(self) -> None:
        if not self.bar.disable:
            self._task = asyncio.create_task(self._tick())

    def close(self) -> None:
        if self._task:
            self._task.cancel()
        self.bar.close()


async def fill_token_counts(records: list[RequestRecord], tok) -> None:
    """N for answers whose server sent no usage chunk: re-tokenise the text (after the phase)."""
    for rec in records:
        if rec.success and rec.output_tokens is None:
            try:
                rec.output_tokens = len(await tok.encode(rec.text))
                rec.output_tokens_source = "tokenizer" if tok.exact else "words"
            except Exception as e:  # the server's /tokenize went away: N stays unknown
                print(f"note: could not count output tokens ({e!r})", file=sys.stderr)
                return


async def bench(args: argparse.Namespace) -> dict:
    phases = phases_from_args(args)
    try:
        slo = parse_slo(args.slo)
        cfg = DatasetConfig(
            args.dataset,
            args.dataset_path,
            parse_range(args.input_len),
            parse_range(args.output_len) if args.output_len else None,
            args.prefix_len,
            args.seed,
        )
        extra = json.loads(args.extra_body) if args.extra_body else None
        timeout = None if args.timeout == "auto" else float(args.timeout)
    except ValueError as e:
        raise BenchError(str(e)) from None
    client = OpenAIClient(
        args.base_url,
        args.model,
        args.api_key,
        args.endpoint,
        args.temperature,
        args.ignore_eos,
        extra,
        timeout,
        args.timeout_per_token,
    )
    show = not args.no_progress
    try:
        try:
            model = await client.resolve_model()
        except Exception as e:
            raise BenchError(
                f"cannot list models at {client.root}/v1/models ({e!r}); is the server up? (or pass --model)"
            ) from None
        try:
            tok = await pick_tokenizer(client.http, model, args.tokenizer)
        except Exception as e:
            raise BenchError(f"tokenizer: {e}") from None
        scraper = None
        if args.metrics_url != "none":
            url = "/metrics" if args.metrics_url == "auto" else args.metrics_url
            scraper = MetricsScraper(client.http, url, args.scrape_interval)
            if not await scraper.probe():
                if args.metrics_url != "auto":
                    print(f"note: no Prometheus metrics at {url}", file=sys.stderr)
                scraper = None
        counts = [p.num_requests or DURATION_POOL for p in phases]
        try:
            pool = await build_requests(cfg, args.warmup + sum(counts), tok)
        except (OSError, ValueError) as e:
            raise BenchError(f"dataset: {e}") from None
        print(
            f"llmserve bench: {client.root} model={model} endpoint={args.endpoint} "
            f"dataset={args.dataset} tokenizer={tok.name}"
            f"{' metrics=' + (scraper.flavor or '?') if scraper else ''}",
            flush=True,
        )

        if args.warmup:
            lv = phases[0].level
            width = args.warmup if math.isinf(lv) else max(1, min(args.warmup, int(lv)))
            await run_phase(client, LoadPhase("concurrency", width, args.warmup), pool[: args.warmup], args.seed)
        runs: list[PhaseRun] = []
        summaries: list[dict] = []
        offset = args.warmup
        for phase, n in zip(phases, counts):
            reqs, offset = pool[offset : offset + n], offset + n
            progress = Progress(phase.name, phase.num_requests, show)
            if scraper:
                await scraper.start()
            progress.start()
            run_ = await run_phase(client, phase, reqs, args.seed, progress.on_chunk, progress.on_done)
            progress.close()
            server = await scraper.stop() if scraper else {}
            await fill_token_counts(run_.records, tok)
            summary = summarize(run_, slo)
            summary["server"] = server
            runs.append(run_)
            summaries.append(summary)
            print(report.phase_text(summary), flush=True)

        knee = find_knee(summaries) if len(summaries) > 1 else None
        best = best_under_slo(summaries, args.slo_percentile) if slo else None
        tips = advice.recommend(summaries, knee, best, slo, args.slo_percentile, args.dataset)
        if len(summaries) > 1:
            print("\n" + " Comparison ".center(64, "="))
            print(report.comparison_text(summaries))
        if tips:
            print("\nRecommendation:")
            print("\n".join(f"- {t}" for t in tips))

        result = {
            "config": {
                "base_url": client.root,
                "model": model,
                "endpoint": args.endpoint,
                "dataset": args.dataset,
                "dataset_path": args.dataset_path,
                "tokenizer": tok.name,
                "mode": phases[0].mode,
                "levels": [p.level for p in phases],
                "seed": args.seed,
                "warmup": args.warmup,
                "slo": slo or None,
                "slo_percentile": args.slo_percentile,
                "temperature": args.temperature,
                "ignore_eos": args.ignore_eos,
                "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            },
            "phases": [report.phase_json(r, s) for r, s in zip(runs, summaries)],
            "knee": knee,
            "slo_best": best,
            "advice": tips,
        }
        if args.output_json:
            report.write_json(args.output_json, result)
        if args.output_dir:
            out = Path(args.output_dir)
            report.write_json(out / "bench.json", result)
            plots = report.write_plots(out, summaries, runs, knee)
            (out / "report.md").write_text(report.markdown_report(result, plots), encoding="utf-8")
            print(f"\nwrote {out}/report.md, bench.json and {len(plots)} plots")
        return result
    finally:
        await client.aclose()
