"""`llmserve serve --models-dir` with two models and --models-max 1: what a model costs on its first request,
what a swap between two models costs, and what memory comes back when a model is unloaded.

    python -m benchmarks.serving.models_dir                        # the bundled GGUF under two names
    python -m benchmarks.serving.models_dir --model PATH --swaps 3 --out bench-out/models_dir.json

Figures (one server process, 1-token chat requests, greedy):
  first request    a request for a model not loaded: the load, then one token
  warm request     the same request once the model is loaded (the load's cost is the difference)
  swap             a request for the other model, which unloads the first (--models-max 1) and loads itself
  RSS              the server process's resident memory with no model, with one loaded, and after the last
                   one is unloaded (Ollama's keep_alive 0, then /api/ps empty)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import httpx
import psutil

from llmserve.testing.launcher import ServerProcess, wait_until

MiB = 1 << 20


def chat(url: str, model: str) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=1800)
    r.raise_for_status()
    return time.perf_counter() - t0


def run(model: str, swaps: int, threads: int, kv: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        for name in ("a", "b"):
            os.symlink(model, os.path.join(d, name + os.path.splitext(model)[1]))
        flags = ["--models-dir", d, "--models-max", "1", "--num-threads", str(threads), "--kv-cache-memory", str(kv)]
        with ServerProcess(*flags) as srv:
            srv.wait_ready()
            proc = psutil.Process(srv.proc.pid)
            rss_empty = proc.memory_info().rss
            first = chat(srv.url, "a")
            rss_loaded = proc.memory_info().rss
            warm = statistics.median(chat(srv.url, "a") for _ in range(3))
            swap_times = []
            for k in range(swaps):
                swap_times.append(chat(srv.url, "b" if k % 2 == 0 else "a"))
            last = "b" if swaps % 2 else "a"
            httpx.post(srv.url + "/api/generate", json={"model": last, "prompt": "", "keep_alive": 0}, timeout=60)
            wait_until(lambda: not httpx.get(srv.url + "/api/ps").json()["models"], timeout=120)
            time.sleep(1.0)
            rss_after = proc.memory_info().rss
    return {
        "model": model,
        "threads": threads,
        "kv_cache_gib": kv,
        "first_request_s": round(first, 2),
        "warm_request_s": round(warm, 3),
        "load_s": round(first - warm, 2),
        "swap_s": [round(s, 2) for s in swap_times],
        "swap_median_s": round(statistics.median(swap_times), 2) if swap_times else None,
        "rss_mib": {
            "no_model": round(rss_empty / MiB),
            "one_loaded": round(rss_loaded / MiB),
            "after_unload": round(rss_after / MiB),
        },
    }


def main() -> None:
    from llmserve.model.loader import bundled_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a GGUF file or HF folder, served as 'a' and 'b' (default: bundled)")
    p.add_argument("--swaps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-memory", type=float, default=0.25)
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    a = p.parse_args()
    model = os.path.abspath(a.model or bundled_model_path())
    res = run(model, a.swaps, a.threads, a.kv_cache_memory)
    res.update(date=time.strftime("%Y-%m-%d"), machine=platform.processor() or platform.machine(), load=os.getloadavg())
    print(json.dumps(res, indent=2))
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
