"""The step-time budget (`--max-step-ms`) against the token budget alone, one server at a time, the same load.

Each setting gets a fresh `llmserve serve` on the model and `llmserve bench` (chat, random prompts, EOS ignored)
at each concurrency: output tok/s, median TTFT, p99 ITL. Settings are run in turn, twice over (ABAB), so a
machine whose speed drifts weighs on both; the table gives each run and the ratio of the medians.

    python -m benchmarks.serving.step_budget --model ~/ckpt/llama-1b --concurrency 16 \\
        --settings 0,1000 --input-len 512 --output-len 64 --num-requests 32
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from benchmarks.common import ab_table, llmserve_bench, machine, write_section
from llmserve.testing.launcher import ServerProcess


def bench(url: str, a, c: int, out: str) -> dict:
    return llmserve_bench(url, c, a.num_requests, a.input_len, a.output_len, out, "--warmup", "2")


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
    table = ab_table(runs, settings, a.concurrency, "--max-step-ms")
    body = (
        f"`python -m benchmarks.serving.step_budget {' '.join(sys.argv[1:])}` on {machine()}: chat, random "
        f"{a.input_len} / {a.output_len} tokens, EOS ignored, {a.num_requests} requests a run, settings in turn "
        f"({a.rounds} rounds).\n\n" + table + "\n"
    )
    print(body)
    if not a.no_write:
        write_section(f"Step-time budget (--max-step-ms): {os.path.basename((a.model or 'bundled').rstrip('/'))}", body)


if __name__ == "__main__":
    main()
