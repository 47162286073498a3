"""The seed articles' procedure against `llmserve serve`: 10 requests one after another, then 5 at once, then 20
at once. Two modes:

`procedure`: the articles' own question ("What is Docker? Answer in one sentence.", max_tokens 50) through HTTP,
judged against the machine: the same concurrency offline (LLM.generate) for the cost of the HTTP layer, and the
FLOPs of the tokens computed over the wall time as a share of the fp32 matmul rate measured in the same run. With
`--llama-server PATH/TO/llama-server --llama-model GGUF` the same runs go against llama.cpp's server too. Writes
its section into BENCHMARKS.md unless --no-write.

`sweep`: the same sweep through `llmserve bench` (the sample dataset, its answers' lengths unless --output-len),
against a `llmserve serve` it starts on a free port (extra flags: --serve-args) or a server already running
(--base-url). Writes OUTPUT_DIR/{bench.json, report.md, *.png, server.log} and prints a Markdown section for
BENCHMARKS.md (the articles' table: concurrency, total time, mean per request, req/s, and more).

    python -m benchmarks.serving.articles procedure [--threads 2] [--no-write]
    python -m benchmarks.serving.articles sweep                         # starts `llmserve serve` on a free port
    python -m benchmarks.serving.articles sweep --serve-args "--max-num-seqs 8"
    python -m benchmarks.serving.articles sweep --base-url http://127.0.0.1:8000   # a server already running
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import httpx
import torch

from benchmarks.common import start_llama_server, write_section
from llmserve.bench import report
from llmserve.cli import main as llmserve_main
from llmserve.testing.launcher import ServerProcess

QUESTION = [{"role": "user", "content": "What is Docker? Answer in one sentence."}]
# SmolLM2-135M: ~106 M parameters outside the embedding/LM head, 28 M in the LM head.
FLOP_PER_TOKEN = 2 * 106e6
FLOP_LM_HEAD = 2 * 28.3e6


def matmul_rate(threads: int) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(1024, 576), torch.randn(576, 1536)
    for _ in range(5):
        a @ b
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < 2.0:
        a @ b
        n += 1
    return n * 2 * 1024 * 576 * 1536 / (time.perf_counter() - t)


async def one(client: httpx.AsyncClient, url: str, model: str) -> dict:
    r = await client.post(
        url + "/v1/chat/completions", json={"model": model, "messages": QUESTION, "max_tokens": 50, "temperature": 0}
    )
    r.raise_for_status()
    return r.json()["usage"]


async def phase(url: str, model: str, concurrency: int, total: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        t = time.perf_counter()
        usages = []
        if concurrency == 1:
            for _ in range(total):
                usages.append(await one(client, url, model))
        else:
            usages = await asyncio.gather(*(one(client, url, model) for _ in range(total)))
        wall = time.perf_counter() - t
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages)
    out = sum(u["completion_tokens"] for u in usages)
    flops = (prompt - cached + out) * FLOP_PER_TOKEN + out * FLOP_LM_HEAD
    return dict(concurrency=concurrency, requests=total, wall=wall, prompt=prompt, cached=cached, out=out, flops=flops)


def offline(threads: int, n: int) -> dict:
    from llmserve import LLM, SamplingParams

    llm = LLM(num_threads=threads)
    ids = llm.get_tokenizer().encode_chat(QUESTION)
    llm.generate([ids], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate([ids] * n, SamplingParams(max_tokens=50, temperature=0), use_tqdm=False)
    wall = time.perf_counter() - t
    return dict(wall=wall, out=sum(len(o.outputs[0].token_ids) for o in outs))


def run_server_phases(url: str, model: str) -> list[dict]:
    asyncio.run(phase(url, model, 1, 1))  # warm-up
    return [asyncio.run(phase(url, model, c, n)) for c, n in ((1, 10), (5, 5), (20, 20))]


def table(name: str, rows: list[dict], rate: float) -> str:
    lines = [
        f"**{name}**",
        "",
        "| concurrency | requests | total time | mean per request | req/s | output tok/s | "
        "computed tokens (prompt not cached + output) | share of fp32 matmul rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = r["flops"] / r["wall"] / rate
        lines.append(
            f"| {r['concurrency']} | {r['requests']} | {r['wall']:.2f} s | "
            f"{r['wall'] / r['requests'] * 1000:.0f} ms"
            f" | {r['requests'] / r['wall']:.2f} | {r['out'] / r['wall']:.1f} | "
            f"{r['prompt'] - r['cached']} + {r['out']} | {share:.0%} |"
        )
    return "\n".join(lines)


def run_procedure(args) -> int:
    rate = matmul_rate(args.threads)
    print(f"fp32 matmul rate: {rate / 1e9:.1f} GFLOP/s", flush=True)
    srv = ServerProcess("--num-threads", str(args.threads), "--log-level", "warning")
    try:
        srv.wait_ready()
        ours = run_server_phases(srv.url, "SmolLM2-135M-Instruct")
    finally:
        srv.terminate()
    for r in ours:
        print(r, flush=True)
    off = offline(args.threads, 20)
    http20 = ours[-1]
    overhead = 1 - (http20["out"] / http20["wall"]) / (off["out"] / off["wall"])
    sections = [table("llmserve serve", ours, rate)]
    if args.llama_server:
        proc, url = start_llama_server(args.llama_server, args.threads, slots=20, context=20480, model=args.llama_model)
        try:
            theirs = run_server_phases(url, "any")
            sections.append(table("llama.cpp llama-server (Q4_1)", theirs, rate))
        finally:
            proc.terminate()
    body = (
        f"`python -m benchmarks.serving.articles procedure --threads {args.threads}`: the seed articles' procedure "
        f'("What is Docker? Answer in one sentence.", max_tokens 50, temperature 0, non-streaming) over '
        f"HTTP on loopback. FLOPs = (prompt tokens not served from the prefix cache + output tokens) x 2 x "
        f"106 M + output tokens x 2 x 28 M (LM head); fp32 matmul rate measured in the same run: "
        f"**{rate / 1e9:.0f} GFLOP/s**.\n\n"
        + "\n\n".join(sections)
        + f"\n\nHTTP layer: 20 concurrent requests through the server made {http20['out'] / http20['wall']:.1f} "
        f"output tok/s; the same 20 requests offline (`LLM.generate`) {off['out'] / off['wall']:.1f} tok/s: "
        f"the server costs **{overhead:.1%}** (bar: at most 10%).\n"
    )
    print(body)
    if not args.no_write:
        write_section("Serving: the seed articles' procedure (issue: OpenAI-compatible server)", body)
    return 0


def run_sweep(a) -> int:
    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    srv, url = None, a.base_url
    try:
        if url is None:
            srv = ServerProcess(*shlex.split(a.serve_args), log_path=str(out / "server.log"))
            url = srv.wait_ready(300).url
        args = [
            "bench",
            "--base-url",
            url,
            "--concurrency",
            a.concurrency,
            "--num-requests",
            a.num_requests,
            "--output-dir",
            str(out),
            *a.bench_args,
        ]
        if a.output_len:
            args += ["--output-len", a.output_len]
        rc = llmserve_main(args)
    finally:
        if srv is not None:
            srv.stop()
    if rc:
        return rc
    result = json.loads((out / "bench.json").read_text())
    summaries = [ph["summary"] for ph in result["phases"]]
    cfg = result["config"]
    print("\n" + "-" * 72 + "\nMarkdown for BENCHMARKS.md:\n")
    print(
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"model `{cfg['model']}`; endpoint `{cfg['endpoint']}`; dataset `{cfg['dataset']}`"
        f"{' (' + a.serve_args + ')' if a.serve_args else ''}.\n"
    )
    print(report.markdown_table(*report.comparison_rows(summaries)))
    if result.get("advice"):
        print("\n" + "\n".join(f"- {t}" for t in result["advice"]))
    print(f"\n![throughput]({out}/throughput.png)\n![latency]({out}/latency_percentiles.png)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("procedure", help="the articles' question over HTTP and offline, FLOPs against the machine")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-server", default=None, help="path to llama.cpp's llama-server binary")
    p.add_argument("--llama-model", default=None, help="GGUF for llama-server (default: the bundled one)")
    p.add_argument("--no-write", action="store_true")
    p = sub.add_parser("sweep", help="the sweep through `llmserve bench`: report, plots, the articles' table")
    p.add_argument("--base-url", default=None, help="bench this server instead of starting one")
    p.add_argument("--serve-args", default="", help="extra `llmserve serve` flags")
    p.add_argument("--concurrency", default="1,5,20")
    p.add_argument("--num-requests", default="10,5,20")
    p.add_argument("--output-len", default=None, help="default: the sample answers' lengths")
    p.add_argument("--output-dir", default="bench-out/sweep")
    p.add_argument("bench_args", nargs="*", help="more `llmserve bench` flags, after --")
    args = ap.parse_args()
    return {"procedure": run_procedure, "sweep": run_sweep}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
