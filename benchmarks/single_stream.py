"""Single-stream decode and prefill, every engine in turn, round after round: the machine's speed drifts
±25% from one minute to the next, so engines measured minutes apart (as in vs_peers.py) cannot be
compared closely.

All servers are started at once and stay up (an idle server takes no CPU): `llmserve serve` with
--quantization int4 / int8 / none and, with `--llama-server PATH`, llama.cpp's llama-server on the bundled
GGUF (the same Q4_1 file llmserve's int4 mode keeps as it is); transformers float32 runs in this process.
Each round sends every engine the same chat prompt (one of 8, in turn), 128 output tokens with EOS
ignored, one request at a time; tok/s = output tokens / request time (prefill included, as vs_peers.py);
then a 512-token prompt (a window of tests/data/alice.txt starting 40 tokens later each round, so no
prefix cache helps) with one output token: its time is the time to first token (TTFT).
Reported: per engine the median over rounds, and the median of the per-round ratios.

    python benchmarks/single_stream.py [--rounds 7] [--threads 2] [--llama-server PATH] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import chat_prompts, start_llama_server, write_section  # noqa: E402
from llmserve.testing.launcher import ServerProcess  # noqa: E402

TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data", "alice.txt")


def http_single(url: str, model: str, msgs, max_tokens: int) -> float:
    t = time.perf_counter()
    r = httpx.post(
        url + "/v1/chat/completions",
        timeout=600,
        json={"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    )
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"] / (time.perf_counter() - t)


def http_ttft(url: str, model: str, ids: list[int]) -> float:
    t = time.perf_counter()
    r = httpx.post(
        url + "/v1/completions", timeout=600, json={"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}
    )
    r.raise_for_status()
    return time.perf_counter() - t


class Transformers:
    def __init__(self, threads: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from llmserve.model.loader import bundled_model_path

        torch.set_num_threads(threads)
        path = bundled_model_path()
        kw = dict(gguf_file=os.path.basename(path))
        self.model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), torch_dtype=torch.float32, **kw).eval()
        self.tok = AutoTokenizer.from_pretrained(os.path.dirname(path), **kw)

    def single(self, msgs, max_tokens: int) -> float:
        text = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        x = torch.tensor([self.tok.encode(text, add_special_tokens=False)])
        with torch.inference_mode():
            t = time.perf_counter()
            out = self.model.generate(x, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            return (out.shape[1] - x.shape[1]) / (time.perf_counter() - t)

    def ttft(self, ids: list[int]) -> float:
        with torch.inference_mode():
            t = time.perf_counter()
            self.model.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False)
            return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    prompts = chat_prompts(8)
    th, mt = args.threads, args.max_tokens
    servers = {
        q: ServerProcess(
            "--num-threads",
            str(th),
            "--log-level",
            "warning",
            "--kv-cache-memory",
            "0.5",
            *([] if q == "none" else ["--quantization", q]),
        )
        for q in ("int4", "int8", "none")
    }
    llama = start_llama_server(args.llama_server, th, slots=1, context=4096) if args.llama_server else None
    try:
        for s in servers.values():
            s.wait_ready(timeout=600)
        engines = {
            f"llmserve {q}": (
                lambda m, s=s: http_single(s.url, "SmolLM2-135M-Instruct", m, mt),
                lambda ids, s=s: http_ttft(s.url, "SmolLM2-135M-Instruct", ids),
            )
            for q, s in servers.items()
        }
        if llama:
            engines["llama.cpp Q4_1"] = (
                lambda m: http_single(llama[1], "any", m, mt),
                lambda ids: http_ttft(llama[1], "any", ids),
            )
        hf = Transformers(th)
        engines["transformers float32"] = (lambda m: hf.single(m, mt), hf.ttft)
        with open(TEXT) as f:
            text = hf.tok.encode(f.read() * 2, add_special_tokens=False)
        for single, ttft in engines.values():  # warm-up
            single(prompts[0])
            ttft(text[-512:])
        runs: dict[str, list[float]] = {k: [] for k in engines}
        ttfts: dict[str, list[float]] = {k: [] for k in engines}
        for r in range(args.rounds):
            for name, (single, ttft) in engines.items():
                runs[name].append(single(prompts[r % len(prompts)]))
                ttfts[name].append(ttft(text[40 * r : 40 * r + 512]))
            print({k: (round(v[-1], 1), round(ttfts[k][-1], 2)) for k, v in runs.items()}, flush=True)
    finally:
        for s in servers.values():
            s.terminate()
        if llama:
            llama[0].terminate()
            llama[0].wait()

    def ratio(a: str, b: str, d=runs) -> float:
        return statistics.median(x / y for x, y in zip(d[a], d[b]))

    rows = [
        "| engine | decode tok/s (median) | min | max | TTFT 512 tokens (median) | min | max |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, v in runs.items():
        t = ttfts[k]
        rows.append(
            f"| {k} | {statistics.median(v):.1f} | {min(v):.1f} | {max(v):.1f} | "
            f"{statistics.median(t):.2f} s | {min(t):.2f} | {max(t):.2f} |"
        )
    ref = "llama.cpp Q4_1" if llama else None
    bars = []
    if ref:
        bars += [
            f"- llmserve {q} / llama.cpp: median of per-round ratios **{ratio(f'llmserve {q}', ref):.2f}x** (bar 1x)"
            for q in ("int4", "int8")
        ]
    bars.append(
        f"- llmserve none / transformers float32: **{ratio('llmserve none', 'transformers float32'):.2f}x** (bar 3x)"
    )
    bars.append(
        "- TTFT of a 512-token prompt, llmserve none / transformers float32: median of per-round ratios "
        f"**{ratio('llmserve none', 'transformers float32', ttfts):.2f}** (bar: at most 1)"
        + (f"; llama.cpp / transformers {ratio(ref, 'transformers float32', ttfts):.2f}" if ref else "")
    )
    cmd = f"python benchmarks/single_stream.py --rounds {args.rounds} --threads {th}" + (
        " --llama-server PATH" if llama else ""
    )
    body = (
        f"`{cmd}`: one request at a time, {mt} output tokens (EOS ignored), every engine once per round "
        f"on the same prompt, then a 512-token prompt for its TTFT, {args.rounds} rounds; through each "
        "server's HTTP API (transformers: `generate` in process).\n\n"
        + "\n".join(rows)
        + "\n\n"
        + "\n".join(bars)
        + "\n"
    )
    print(body)
    if not args.no_write:
        write_section("Single stream, engines interleaved (issue: performance)", body)


if __name__ == "__main__":
    main()
