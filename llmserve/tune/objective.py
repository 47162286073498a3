"""One candidate's figure: its goodput, the highest Poisson request rate whose percentiles meet the SLO.

`rate_search` bisects on where the SLO breaks: it doubles the rate while a probe meets the SLO (quadruples it while
every percentile is under half its bound) and halves it while one fails, then bisects between the highest passing
and the lowest failing rate until they are within `tol`. Rates stop at a ceiling, `max_requests / probe_seconds`:
above it a probe's requests would arrive in a burst shorter than `--probe-seconds`, which every server drains within
the SLO however far its sustained capacity is below the rate (a 64-request burst at 600 requests/s "passed" on the
bundled model), so a candidate that passes at the ceiling is reported there (`"ceiling": True`), a lower bound. Each
probe is one phase of `llmserve bench`'s open-loop load (llmserve/bench/loadgen.py) over the same requests, read
by bench's own figures (llmserve/bench/metrics.py), with the server's metrics scraped alongside (KV usage,
preemptions: what the search's pruning rules read). The goodput is bench's at the highest passing rate: requests
meeting every bound, per second of wall time.

`Candidate.measure` starts the candidate's server (`llmserve serve`, or `llmserve launch` for several replicas,
through llmserve/testing/launcher.py's ServerProcess), warms it up (not measured), runs the quality guard where the
candidate can change the answers, then the rate search, and stops the server. A confirmation re-measurement
(`start` given: llmserve/tune/confirm.py) skips the quality guard (the candidate passed it) and searches the rate
from `start` without giving up early, the same start for every member of the round.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable

import httpx

from llmserve.bench.client import OpenAIClient
from llmserve.bench.loadgen import LoadPhase, run_phase
from llmserve.bench.metrics import summarize
from llmserve.bench.scrape import MetricsScraper

from . import quality, slo
from .space import changes_answers, serve_argv

WARMUP_TOKENS = 16
# a probe sends at least this many requests; rates at which they would span more than 2 x --probe-seconds are not
# probed (too few requests for a percentile: such a candidate fails at any usable load; slow models: raise it)
MIN_PROBE_REQUESTS = 6
START_SECONDS = 45.0  # what a candidate's server start is budgeted (the bundled model starts in ~10-20 s)


def compact(summary: dict) -> dict:
    """The figures a candidate keeps of a probe (JSON, small)."""
    server = summary.get("server") or {}
    return {
        "rate": summary.get("rate"),
        "completed": summary.get("completed"),
        "failed": summary.get("failed"),
        "goodput": summary.get("goodput", 0.0),
        "request_throughput": summary.get("request_throughput"),
        "output_throughput": summary.get("output_throughput"),
        **{f"{m}_{s}": (summary.get(f"{m}_ms") or {}).get(s) for m in ("ttft", "tpot", "e2el") for s in ("p95", "p99")},
        "e2el_mean": (summary.get("e2el_ms") or {}).get("mean"),
        "kv_usage_max": (server.get("kv_usage") or {}).get("max"),
        "preemptions": server.get("preemptions"),
        "broken": summary.get("broken", []),
    }


async def rate_search(
    probe: Callable[[float], Awaitable[dict]],
    bounds: tuple[slo.Bound, ...],
    start: float,
    max_probes: int = 5,
    tol: float = 1.2,
    deadline: float = math.inf,
    clock: Callable[[], float] = time.monotonic,
    lose_fast: bool = False,
    min_rate: float = 1e-3,
    max_rate: float = math.inf,
) -> dict:
    """The highest rate meeting the SLO: `probe(rate)` returns a bench summary (with goodput). `lose_fast`: `start`
    is the best candidate's rate; one that fails it and its half is worse, and is not searched further. `max_rate`:
    the highest rate a probe can load the server at (passing there ends the search, `"ceiling": True`)."""
    lo: dict | None = None  # highest passing probe
    hi: dict | None = None  # lowest failing probe
    probes: list[dict] = []
    rate = min(max(start, min_rate), max_rate)
    for i in range(max_probes):
        if clock() >= deadline and probes:  # a started candidate gets one probe, however late
            break
        if rate < min_rate:  # too few requests fit a probe to read a percentile: it fails at a usable load
            break
        summary = await probe(rate)
        summary["rate"] = rate
        summary["broken"] = slo.check(summary, bounds)
        c = compact(summary)
        probes.append(c)
        if not c["broken"]:
            lo = c if lo is None or rate > lo["rate"] else lo
        else:
            hi = c if hi is None or rate < hi["rate"] else hi
        if lo and hi and hi["rate"] / lo["rate"] <= tol:
            break
        if lose_fast and i >= 1 and lo is None:  # failed the best rate so far and its half: a worse candidate
            break
        if lo and lo["rate"] >= max_rate:  # passing at the ceiling: no probe can load it harder
            break
        if lo and hi:
            rate = math.sqrt(lo["rate"] * hi["rate"])
        elif lo:
            rate = min(lo["rate"] * (4 if margin(summary, bounds) else 2), max_rate)
        else:
            rate = hi["rate"] / 2
    return {
        "goodput": lo["goodput"] if lo else 0.0,
        "rate": lo["rate"] if lo else 0.0,
        "best": lo,
        "fail": hi,
        "probes": probes,
        "ceiling": bool(lo and lo["rate"] >= max_rate),
        # the probes (or the time) ran out before the SLO broke: the goodput is a lower bound too
        "open": bool(lo and hi is None and lo["rate"] < max_rate),
    }


def margin(summary: dict, bounds: tuple[slo.Bound, ...]) -> bool:
    """Every bound's figure under half its limit, and no failed request: far from where the SLO breaks."""
    if summary.get("failed") or summary.get("broken"):
        return False
    return all((b.value(summary) or 0.0) < 0.5 * b.ms for b in bounds)


@dataclass
class Context:
    """What every candidate's measurement shares: the model, the machine, the traffic, the SLO."""

    model: str | None
    cores: int
    bounds: tuple[slo.Bound, ...]
    workload: object  # workload.Workload
    out_dir: str
    port: int
    probe_seconds: float = 20.0
    max_requests: int = 128
    max_probes: int = 5
    warmup: int = 4
    min_agreement: float = 0.9
    quality_prompts: int = 4
    quality_tokens: int = 32
    start_timeout: float = 300.0
    pool: list = field(default_factory=list)  # the workload's requests (built with the first server's tokenizer)
    reference: list | None = None  # the quality guard's float32 scores
    hint: float | None = None  # a rate to start the next search at (the best goodput so far)
    deadline: float = math.inf
    log: Callable[[str], None] = print


class Server:
    """A candidate's server process, stopped on exit (its replicas with it)."""

    def __init__(self, ctx: Context, params: dict, tag: str) -> None:
        from llmserve.testing.launcher import LAUNCH, SERVE, ServerProcess

        flags = ["--model", ctx.model] if ctx.model else []
        flags += serve_argv(params, ctx.cores)
        replicas = params["replicas"]
        if replicas > 1:
            flags += ["--base-port", str(ctx.port + 1), "--router-health-interval", "0.5"]
        os.makedirs(os.path.join(ctx.out_dir, "logs"), exist_ok=True)
        self.replicas = replicas
        self.proc = ServerProcess(
            *flags,
            cmd=LAUNCH if replicas > 1 else SERVE,
            port=ctx.port,
            log_path=os.path.join(ctx.out_dir, "logs", f"{tag}.log"),
        )
        self.url = self.proc.url
        self.timeout = ctx.start_timeout

    def __enter__(self) -> Server:
        try:
            self.proc.wait_ready(self.timeout)
            if self.replicas > 1:
                end = time.monotonic() + self.timeout
                while time.monotonic() < end:
                    if httpx.get(self.url + "/ready", timeout=5).json().get("healthy_backends") == self.replicas:
                        break
                    time.sleep(0.5)
                else:
                    raise TimeoutError(f"{self.replicas} replicas not healthy in {self.timeout}s")
        except BaseException:
            self.proc.kill()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.proc.stop()


def reference_params(defaults: dict) -> dict:
    """float32, unquantized, float32 KV cache: what the quality guard compares with."""
    return {**defaults, "replicas": 1, "dtype": "float32", "quantization": "none", "kv_cache_dtype": "auto"}


def measure_reference(ctx: Context, defaults: dict) -> list:
    """The float32 model's answers and scores on the workload's first prompts (once per run)."""
    with Server(ctx, reference_params(defaults), "reference-float32") as srv:
        model = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        if not ctx.pool:
            ctx.pool = asyncio.run(_build_pool(ctx, srv.url))
        prompts = quality.prompts_of(ctx.pool, ctx.quality_prompts)
        return asyncio.run(quality.reference(srv.url, model, prompts, ctx.quality_tokens))


async def _build_pool(ctx: Context, url: str) -> list:
    from llmserve.bench.datasets import pick_tokenizer

    client = OpenAIClient(url)
    try:
        model = await client.resolve_model()
        tok = await pick_tokenizer(client.http, model, "auto")
        return await ctx.workload.requests(tok)
    finally:
        await client.aclose()


def measure(ctx: Context, params: dict, tag: str, start: float | None = None) -> dict:
    """One candidate, measured: {"goodput", "rate", "best", "fail", "probes", "quality", "refused", "seconds",
    "load"} ("load": the 1-minute load average before and after, what the machine's other jobs were doing)."""
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    with Server(ctx, params, tag) as srv:
        if not ctx.pool:
            ctx.pool = asyncio.run(_build_pool(ctx, srv.url))
        result = asyncio.run(_measure(ctx, params, srv.url, start))
    result["seconds"] = time.monotonic() - t0
    result["load"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    return result


async def _measure(ctx: Context, params: dict, url: str, confirm_start: float | None = None) -> dict:
    client = OpenAIClient(url, timeout_per_token=0.5)
    try:
        model = await client.resolve_model()
        q = None
        if ctx.reference and changes_answers(params) and confirm_start is None:
            q = await quality.agreement(url, model, ctx.reference)
            if q["agreement"] < ctx.min_agreement:
                ctx.log(f"  refused: greedy agreement {q['agreement']:.3f} < --min-agreement {ctx.min_agreement}")
                return {
                    "goodput": 0.0,
                    "rate": 0.0,
                    "best": None,
                    "fail": None,
                    "probes": [],
                    "quality": q,
                    "refused": True,
                }
        # warm-up (not measured): short answers; their throughput guesses the first search's start
        short = [replace(r, output_len=min(r.output_len, WARMUP_TOKENS)) for r in ctx.pool[: ctx.warmup]]
        warm = summarize(await run_phase(client, LoadPhase("concurrency", 2, ctx.warmup), short))
        mean_out = sum(r.output_len for r in ctx.pool) / len(ctx.pool)
        guess = warm["request_throughput"] * min(1.0, WARMUP_TOKENS / mean_out)  # 2 streams at the asked length
        scraper = MetricsScraper(client.http, "/metrics", 1.0)
        use_scraper = await scraper.probe()
        rates_of_pool = ctx.workload.native_rate() if ctx.workload.replay else None
        offset = [ctx.warmup]

        async def probe(rate: float) -> dict:
            n = int(min(ctx.max_requests, max(MIN_PROBE_REQUESTS, math.ceil(rate * ctx.probe_seconds))))
            start = offset[0] % len(ctx.pool)
            reqs = (ctx.pool[start:] + ctx.pool[:start])[:n] if not rates_of_pool else ctx.pool
            offset[0] += n
            if rates_of_pool:
                phase = LoadPhase("replay", rate / rates_of_pool, n)
            else:
                phase = LoadPhase("rate", rate, n)
            if use_scraper:
                await scraper.start()
            run = await run_phase(client, phase, reqs, seed=offset[0])
            summary = summarize(run, slo.bench_slo(ctx.bounds))
            summary["server"] = await scraper.stop() if use_scraper else {}
            ctx.log(
                f"  rate {rate:.3g}/s: goodput {summary.get('goodput', 0):.3g}/s, "
                + ", ".join(f"{b.key} {b.value(summary) or 0:.0f}" for b in ctx.bounds)
            )
            return summary

        start = confirm_start or ctx.hint or max(0.01, guess)
        found = await rate_search(
            probe,
            ctx.bounds,
            start,
            ctx.max_probes,
            deadline=ctx.deadline,
            lose_fast=ctx.hint is not None and confirm_start is None,
            min_rate=MIN_PROBE_REQUESTS / (2 * ctx.probe_seconds),
            max_rate=ctx.max_requests / ctx.probe_seconds,
        )
        if found["ceiling"]:
            ctx.log(
                f"  meets the SLO at the probes' ceiling ({found['rate']:.3g}/s = --max-requests / --probe-seconds): "
                "its goodput is a lower bound"
            )
        elif found["open"]:
            ctx.log(f"  met the SLO at every probe up to {found['rate']:.3g}/s (--max-probes): a lower bound")
        found["quality"] = q
        found["refused"] = False
        return found
    finally:
        await client.aclose()
