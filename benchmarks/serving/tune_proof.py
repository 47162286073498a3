"""`llmserve tune`'s proof: the configs it compares measured afterwards by `llmserve bench`, each in a fresh server,
in one run (the same requests, the same rates, the configs alternating rate by rate's sweep).

    python -m benchmarks.serving.tune_proof --configs defaults,tuned.yaml[,grid.yaml] \\
        --slo ttft_p95=2000,tpot_p95=100 --output-len 512 --rates 0.1,0.2,0.3,0.5 --num-requests 24

A config is `defaults` (`llmserve serve` with no flags) or a YAML `llmserve tune` (or auto_tune_grid.py) wrote; one
with `replicas: N` starts with `llmserve launch --config`. Each config's goodput is bench's goodput at the highest
rate whose percentiles meet the SLO (no failed request), as `llmserve tune` defines it. `--write` puts the table into
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import yaml

from benchmarks.common import write_section
from llmserve.testing.launcher import LAUNCH, SERVE, ServerProcess
from llmserve.tune import slo


def start(config: str, model: str | None, port: int, log_dir: str) -> ServerProcess:
    flags = ["--model", model] if model else []
    replicas = 1
    if config != "defaults":
        flags += ["--config", config]
        replicas = int((yaml.safe_load(open(config)) or {}).get("replicas") or 1)
    if replicas > 1:
        flags += ["--base-port", str(port + 1)]
    name = os.path.basename(config).replace(".", "_")
    srv = ServerProcess(*flags, cmd=LAUNCH if replicas > 1 else SERVE, port=port, log_path=f"{log_dir}/{name}.log")
    srv.wait_ready(600)
    if replicas > 1:
        import time

        import httpx

        for _ in range(600):
            if httpx.get(srv.url + "/ready").json().get("healthy_backends") == replicas:
                break
            time.sleep(1)
    return srv


def bench(url: str, rates: str, n: int, output_len: str, bounds, out: str, seed: int) -> list[dict]:
    cmd = [sys.executable, "-m", "llmserve.cli", "bench", "--base-url", url, "--request-rate", rates,
           "--num-requests", str(n), "--output-len", output_len, "--warmup", "2", "--seed", str(seed),
           "--goodput", *[f"{k}:{v:g}" for k, v in slo.bench_slo(bounds).items()], "--output-json", out,
           "--no-progress"]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [p["summary"] for p in json.load(open(out))["phases"]]


def goodput(phases: list[dict], bounds) -> tuple[float, float]:
    ok = [p for p in phases if not slo.check(p, bounds)]
    best = max(ok, key=lambda p: p["level"]) if ok else None
    return (best["goodput"], best["level"]) if best else (0.0, 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="defaults,tuned.yaml")
    ap.add_argument("--model", default=None)
    ap.add_argument("--slo", default="ttft_p95=2000,tpot_p95=100")
    ap.add_argument("--output-len", default="512")
    ap.add_argument("--rates", default="0.1,0.2,0.3,0.5")
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--port", type=int, default=18380)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON of every figure")
    ap.add_argument("--write", default=None, metavar="TITLE", help="write the table into BENCHMARKS.md")
    args = ap.parse_args()
    bounds = slo.parse_slo(args.slo)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs.split(","):
            with start(config, args.model, args.port, tmp) as srv:
                phases = bench(
                    srv.url, args.rates, args.num_requests, args.output_len, bounds, f"{tmp}/b.json", args.seed
                )
            g, rate = goodput(phases, bounds)
            results[config] = {"goodput": g, "rate": rate, "phases": [
                {"rate": p["level"], "goodput": p.get("goodput"), "failed": p["failed"],
                 **{b.key: b.value(p) for b in bounds}, "broken": slo.check(p, bounds)} for p in phases]}  # fmt: skip
            print(f"{config}: goodput {g:.3g} req/s (at {rate:g} req/s)", flush=True)
            for p in results[config]["phases"]:
                figures = ", ".join(f"{b.key} {p[b.key] or 0:.0f}" for b in bounds)
                print(f"  rate {p['rate']:g}: goodput {p['goodput']:.3g}, {figures}  {p['broken'] or ''}")
    base = results.get("defaults", {}).get("goodput")
    lines = ["| config | goodput (req/s) | at rate | vs defaults |", "|---|---|---|---|"]
    for config, r in results.items():
        ratio = f"{r['goodput'] / base:.2f}x" if base else "-"
        lines.append(f"| {config} | {r['goodput']:.3g} | {r['rate']:g} | {ratio} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        json.dump(results, open(args.out, "w"), indent=1)
    if args.write:
        cmd = "python -m benchmarks.serving.tune_proof " + " ".join(sys.argv[1:])
        write_section(args.write, f"`{cmd}` (SLO {args.slo}, max_tokens {args.output_len}, EOS honoured)\n\n{table}\n")


if __name__ == "__main__":
    main()
