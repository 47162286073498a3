"""The step-time budget (`--max-step-ms`) against the token budget alone, one server at a time, the same load.

Each setting gets a fresh `llmserve serve` on the model and `llmserve bench` (chat, random prompts, EOS ignored)
at each concurrency: output tok/s, median TTFT, p99 ITL. Settings are run in turn, twice over (ABAB), so a
machine whose speed drifts weighs on both; the table gives each run and the ratio of the medians.

    python -m benchmarks.serving.step_budget --model ~/ckpt/llama-1b --concurrency 16 \\
        --settings 0,1000 --input-len 512 --output-len 64 --num-requests 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import machine, write_section
from llmserve.testing.launcher import ServerProcess


def bench(url: str, a, c: int, out: str) -> dict:
    subprocess.run(
        [sys.executable, "-m", "llmserve.cli", "bench", "--base-url", url, "--concurrency", str(c)]
        + ["--num-requests", str(a.num_requests), "--dataset", "random", "--input-len", str(a.input_len)]
        + ["--output-len", str(a.output_len), "--ignore-eos", "--temperature", "0", "--no-progress"]
        + ["--warmup", "2", "--output-json", out],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    s = json.load(open(out))["phases"][0]["summary"]
    return {
        "tok_s": s["output_throughput"],
        "ttft_median": s["ttft_ms"]["median"],
        "itl_p99": s["itl_ms"]["p99"],
        "failed": s.get("failed", 0),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="what serve takes (default: the bundled model)")
    p.add_argument("--settings", default="0,1000", help="--max-step-ms values, comma-separated (0: no target)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--extra", default="", help="more serve flags, space-separated")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    settings = a.settings.split(",")
    runs: dict[tuple[str, int], list[dict]] = {}
    tmp = tempfile.mkdtemp()
    for rnd in range(a.rounds):
        for ms in settings:
            flags = (["--model", a.model] if a.model else []) + [
                "--num-threads",
                str(a.threads),
                "--max-step-ms",
                ms,
                *a.extra.split(),
            ]
            with ServerProcess(*flags) as srv:
                srv.wait_ready(timeout=1200)
                for c in a.concurrency:
                    r = bench(srv.url, a, c, os.path.join(tmp, f"{ms}-{c}-{rnd}.json"))
                    runs.setdefault((ms, c), []).append(r)
                    print(ms, c, rnd, r, flush=True)
    lines = [
        "| --max-step-ms | concurrency | output tok/s (each run) | median TTFT ms | p99 ITL ms |",
        "|---|---|---|---|---|",
    ]
    med = {
        k: {f: statistics.median(r[f] for r in v) for f in ("tok_s", "ttft_median", "itl_p99")} for k, v in runs.items()
    }
    for (ms, c), v in runs.items():
        tok, ttft, itl = (
            " / ".join(f"{r[f]:.{d}f}" for r in v) for f, d in (("tok_s", 2), ("ttft_median", 0), ("itl_p99", 0))
        )
        lines.append(f"| {ms} | {c} | {tok} | {ttft} | {itl} |")
    base = settings[0]
    ratios = []
    for ms in settings[1:]:
        for c in a.concurrency:
            m, b = med[(ms, c)], med[(base, c)]
            ratios.append(
                f"- {ms} ms against {base} at {c} concurrent (medians): throughput {m['tok_s'] / b['tok_s']:.2f}x, "
                f"median TTFT {m['ttft_median'] / b['ttft_median']:.2f}x, p99 ITL {m['itl_p99'] / b['itl_p99']:.2f}x"
            )
    body = (
        f"`python -m benchmarks.serving.step_budget {' '.join(sys.argv[1:])}` on {machine()}: chat, random "
        f"{a.input_len} / {a.output_len} tokens, EOS ignored, {a.num_requests} requests a run, settings in turn "
        f"({a.rounds} rounds).\n\n" + "\n".join(lines) + "\n\n" + "\n".join(ratios) + "\n"
    )
    print(body)
    if not a.no_write:
        write_section(f"Step-time budget (--max-step-ms): {os.path.basename((a.model or 'bundled').rstrip('/'))}", body)


if __name__ == "__main__":
    main()
