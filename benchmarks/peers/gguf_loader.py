"""Loading and serving GGUF files as they come: llmserve against llama.cpp's llama-server on the same file.

For each run, one server at a time (never in CI): the server process is started, its resident memory
(RSS, with its children) sampled every 0.1 s with psutil from start to exit; load time is start to the
first 200 on /health (llama-server) or /ready (llmserve); then single-stream and 4-concurrent decode
tok/s over /v1/completions (short prompts, EOS ignored, greedy); and what llmserve wrote to its cache
(~/.cache/llmserve) during the run.

    python -m benchmarks.peers.gguf_loader --runs 1b-int8 1b 1b-llama 8b-int4 8b-llama [--tokens 64] [--no-write]

Runs: `1b*` use ~/ckpt/llama-1b/model-Q8_0.gguf, `8b*` ~/ckpt/llama-8b/model-Q4_K_M.gguf, `oss20b*`
~/ckpt/gpt-oss-20b/model-MXFP4_MOE.gguf (random weights, made by benchmarks/make_checkpoint.py); the suffix is
llmserve's --quantization (none: the float32-exact default) or `llama` for llama-server. Check `free -g` before
an 8B or 20b run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import threading
import time

import httpx
import psutil

from benchmarks.common import CKPT, write_section
from llmserve.testing.launcher import ServerProcess, free_port

FILES = {
    "1b": f"{CKPT}/llama-1b/model-Q8_0.gguf",
    "8b": f"{CKPT}/llama-8b/model-Q4_K_M.gguf",
    "oss20b": f"{CKPT}/gpt-oss-20b/model-MXFP4_MOE.gguf",  # make_checkpoint --shape gpt-oss-20b
}
LLAMA_SERVER = os.path.expanduser("~/.cache/llmserve-peers/llama.cpp/build/bin/llama-server")
CACHE = os.path.expanduser(os.environ.get("LLMSERVE_CACHE_DIR", "~/.cache/llmserve"))
PROMPT = "The history of the city begins with"


class PeakRSS(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0, False

    def run(self) -> None:
        while not self.stop:
            try:
                p = psutil.Process(self.pid)
                rss = p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
                self.peak = max(self.peak, rss)
            except psutil.Error:
                pass
            time.sleep(0.1)


def cache_bytes() -> int:
    total = 0
    for root, _, names in os.walk(CACHE):
        for n in names:
            try:
                total += os.path.getsize(os.path.join(root, n))
            except OSError:
                pass
    return total


async def decode_rate(url: str, concurrency: int, tokens: int) -> float:
    async def one(client, i):
        r = await client.post(
            url + "/v1/completions",
            json={
                "model": "m",
                "prompt": f"{PROMPT} {i}",
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
                "n_predict": tokens,
            },
        )
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=3600) as client:
        t = time.perf_counter()
        n = sum(await asyncio.gather(*(one(client, i) for i in range(concurrency))))
        return n / (time.perf_counter() - t)


def run(name: str, tokens: int, threads: int, kv_gib: float) -> dict:
    size, _, mode = name.partition("-")
    path = FILES[size]
    before = cache_bytes()
    t0 = time.perf_counter()
    if mode == "llama":
        port = free_port()
        proc = subprocess.Popen(
            [LLAMA_SERVER, "-m", path, "--port", str(port), "-np", "4", "-cb", "-t", str(threads), "-c", str(4 * 1024)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url, pid, stop = f"http://127.0.0.1:{port}", proc.pid, proc.terminate
        ready = "/health"
    else:
        flags = [
            "--model",
            path,
            "--kv-cache-memory",
            str(kv_gib),
            "--num-threads",
            str(threads),
            "--log-level",
            "warning",
            "--max-model-len",
            "1024",
            "--served-model-name",
            "m",
        ]
        if mode:
            flags += ["--quantization", mode]
        srv = ServerProcess(*flags)
        url, pid, stop, ready = srv.url, srv.proc.pid, srv.stop, "/ready"
    sampler = PeakRSS(pid)
    sampler.start()
    try:
        while True:
            try:
                if httpx.get(url + ready, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > 3600:
                raise TimeoutError(name)
            time.sleep(0.1)
        load_s = time.perf_counter() - t0
        rss_loaded = sampler.peak
        asyncio.run(decode_rate(url, 1, 4))  # warm-up
        single = asyncio.run(decode_rate(url, 1, tokens))
        c4 = asyncio.run(decode_rate(url, 4, tokens))
    finally:
        sampler.stop = True
        stop()
    res = dict(
        run=name,
        kv_gib=None if mode == "llama" else kv_gib,
        file=path,
        file_gib=os.path.getsize(path) / 2**30,
        load_s=load_s,
        peak_rss_gib=sampler.peak / 2**30,
        rss_after_load_gib=rss_loaded / 2**30,
        single_tok_s=single,
        c4_tok_s=c4,
        cache_written_mib=(cache_bytes() - before) / 2**20,
    )
    print(json.dumps(res), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", default=["1b-int8", "1b", "1b-llama", "8b-int4", "8b-llama"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-gib", type=float, default=0.5, help="llmserve's --kv-cache-memory (llama-server: -c 4096)")
    ap.add_argument("--out", default=None, help="append each run's JSON line to this file")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument(
        "--table",
        nargs="*",
        default=None,
        metavar="JSONL",
        help="write the BENCHMARKS.md table from runs saved with --out (no new runs)",
    )
    ap.add_argument("--note", default="", help="text under the table (BENCHMARKS.md)")
    a = ap.parse_args()
    if a.table is not None:
        rows = [json.loads(line) for path in a.table for line in open(path) if line.strip()]
        write_table(rows, a.note)
        return
    rows = []
    for name in a.runs:
        rows.append(run(name, a.tokens, a.threads, a.kv_gib))
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    if not a.no_write:
        write_table(rows, a.note)


def write_table(rows: list[dict], note: str) -> None:
    lines = [
        "| run | file (GiB) | KV (GiB) | load (s) | peak RSS (GiB) | single stream (tok/s) | "
        "4 concurrent (tok/s) | cache written (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['run']} | {os.path.basename(r['file'])} ({r['file_gib']:.2f}) | "
            f"{r.get('kv_gib') or '-c 4096'} | {r['load_s']:.1f} | "
            f"{r['peak_rss_gib']:.2f} | {r['single_tok_s']:.2f} | {r['c4_tok_s']:.2f} | "
            f"{r['cache_written_mib']:.0f} |"
        )
    write_section("GGUF loading and serving vs llama-server", "\n".join(lines) + "\n\n" + note)


if __name__ == "__main__":
    main()
