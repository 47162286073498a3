"""vLLM's auto_tune method (benchmarks/auto_tune/auto_tune.sh) with llmserve's server: a grid over --max-num-seqs x
--max-num-batched-tokens only, each point's highest throughput whose p99 end-to-end latency is under a cap, the best
point written as a YAML `llmserve serve --config` reads; for comparing with `llmserve tune` on the same time budget.

    python -m benchmarks.serving.auto_tune_grid --budget 15m --max-latency-ms 30000 --output-len 512 --out grid.yaml

As auto_tune.sh: per point, first all requests at once (rate inf); if the p99 E2E latency is over the cap, the rate
is lowered from the measured throughput step by step until it is under, or the point gives up. Its defaults are
auto_tune.sh's lists (128 256 x 512 1024 2048 4096). The points run in order until the budget is spent.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
import tempfile
import time

import yaml

from llmserve.testing.launcher import ServerProcess
from llmserve.tune.cli import parse_budget


def run_bench(url: str, rate: float, n: int, output_len: str, out: str) -> dict:
    cmd = [sys.executable, "-m", "llmserve.cli", "bench", "--base-url", url, "--num-requests", str(n),
           "--request-rate", "inf" if math.isinf(rate) else f"{rate:.4g}", "--output-len", output_len,
           "--warmup", "2", "--output-json", out, "--no-progress"]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.load(open(out))["phases"][0]["summary"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-seqs", default="128,256")
    ap.add_argument("--num-batched-tokens", default="512,1024,2048,4096")
    ap.add_argument("--max-latency-ms", type=float, default=30000.0, help="the cap on p99 E2E latency")
    ap.add_argument("--output-len", default="512")
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--max-steps", type=int, default=3, help="lower rates tried per point")
    ap.add_argument("--budget", default="15m")
    ap.add_argument("--port", type=int, default=18390)
    ap.add_argument("--out", default="grid.yaml")
    args = ap.parse_args()
    deadline = time.monotonic() + parse_budget(args.budget)
    grid = list(itertools.product(map(int, args.num_seqs.split(",")), map(int, args.num_batched_tokens.split(","))))
    best, rows = None, []
    with tempfile.TemporaryDirectory() as tmp:
        for seqs, tokens in grid:
            if time.monotonic() >= deadline:
                print(f"budget spent: {len(rows)} of {len(grid)} points measured")
                break
            flags = (["--model", args.model] if args.model else []) + [
                "--max-num-seqs", str(seqs), "--max-num-batched-tokens", str(tokens)]  # fmt: skip
            with ServerProcess(*flags, port=args.port, log_path=f"{tmp}/serve.log") as srv:
                srv.wait_ready(600)
                rate, found = math.inf, None
                for _ in range(args.max_steps + 1):
                    s = run_bench(srv.url, rate, args.num_requests, args.output_len, f"{tmp}/b.json")
                    p99 = s["e2el_ms"]["p99"] or math.inf
                    print(f"seqs {seqs} tokens {tokens} rate {rate:.3g}: {s['request_throughput']:.3g} req/s, "
                          f"p99 e2el {p99:.0f} ms", flush=True)  # fmt: skip
                    if p99 <= args.max_latency_ms and not s["failed"]:
                        found = s
                        break
                    if time.monotonic() >= deadline:
                        break
                    rate = (s["request_throughput"] if math.isinf(rate) else rate) * 0.8
            row = {"max_num_seqs": seqs, "max_num_batched_tokens": tokens,
                   "throughput": found["request_throughput"] if found else 0.0}  # fmt: skip
            rows.append(row)
            if found and (best is None or row["throughput"] > best["throughput"]):
                best = row
    print(json.dumps(rows))
    if best:
        settings = ({"model": args.model} if args.model else {}) | {
            "max_num_seqs": best["max_num_seqs"], "max_num_batched_tokens": best["max_num_batched_tokens"]}  # fmt: skip
        text = f"# auto_tune grid: {best['throughput']:.3g} req/s under p99 e2el {args.max_latency_ms:g} ms\n"
        open(args.out, "w").write(text + yaml.safe_dump(settings, sort_keys=False))
        print(f"best: {best}; wrote {args.out}")
    else:
        print("no grid point met the latency cap")


if __name__ == "__main__":
    main()
