"""A GGUF file served as it comes: `llmserve serve --model FILE` (its defaults) against `llama-server -m FILE -np N`
on the same file, every server read by the same client (`llmserve bench`: chat, random prompts of --input-len
tokens, --output-len tokens out, EOS ignored). One server at a time; engines in turn, --rounds times over (ABAB),
so a machine whose speed drifts weighs on all; the table gives each run and the ratios of the medians. Never in CI.

    python -m benchmarks.peers.gguf_serving --gguf ~/ckpt/llama-1b-gguf/model-Q4_K_M.gguf --concurrency 1 16 \\
        --engines llama llmserve "llmserve:--quantization none" [--rounds 2] [--no-write] [--prefix-len 1000]

`--prefix-len 1000`: the chat mix, every prompt opening with the same 1,000 tokens (a system prompt) before its own.

Engines: `llama` (llama-server with -np = the concurrency, continuous batching, the threads given), `llmserve`
(serve's defaults) or `llmserve:FLAGS` (more serve flags). llama.cpp from shared/peers/llama-cpp.sh.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from benchmarks.common import ab_table, llmserve_bench, machine, peak_rss_gib, start_llama_server, write_section
from benchmarks.peers.servers import PEERS
from llmserve.testing.launcher import ServerProcess

LLAMA_SERVER = os.path.join(PEERS, "llama.cpp", "build", "bin", "llama-server")


def bench(url: str, a, c: int, out: str) -> dict:
    n = max(a.num_requests, 2 * c)
    extra = ["--tokenizer", a.tokenizer, "--warmup", "1"] + (["--timeout", str(a.timeout)] if a.timeout else [])
    if a.prefix_len:  # the chat mix: every prompt opens with the same --prefix-len tokens (a long system prompt)
        extra += ["--dataset", "prefix", "--prefix-len", str(a.prefix_len)]
    return llmserve_bench(url, c, n, a.input_len, a.output_len, out, *extra)


def run_engine(engine: str, a, c: int, out: str) -> dict:
    """One server, one `llmserve bench` run; the result gains its load time (start to ready) and peak RSS."""
    t0 = time.monotonic()
    if engine == "llama":
        # (a random prompt re-tokenized can grow; a template adds)
        ctx = c * (a.prefix_len + 2 * a.input_len + a.output_len + 256)
        extra = ("--jinja", "--chat-template-file", a.chat_template) if a.chat_template else ()
        proc, url = start_llama_server(LLAMA_SERVER, a.threads, c, ctx, model=a.gguf, extra=extra)
        try:
            load = time.monotonic() - t0
            return dict(bench(url, a, c, out), load_s=load, rss_gib=peak_rss_gib(proc.pid))
        finally:
            proc.terminate()
            proc.wait()
    flags = engine.partition(":")[2].split() + (["--chat-template", a.chat_template] if a.chat_template else [])
    with ServerProcess("--model", a.gguf, "--num-threads", str(a.threads), *flags) as srv:
        srv.wait_ready(timeout=1800)
        load = time.monotonic() - t0
        return dict(bench(srv.url, a, c, out), load_s=load, rss_gib=peak_rss_gib(srv.proc.pid))


def memory_lines(runs: dict, engines: list, size_gib: float) -> str:
    """Per engine: median load time and peak RSS over its runs, RSS against the file's size."""
    import statistics

    lines = [f"\nThe file: {size_gib:.2f} GiB. Load time (start to ready) and peak RSS (VmHWM), medians over runs:\n"]
    for e in engines:
        rs = [r for (name, _), v in runs.items() if name == e for r in v]
        load, rss = statistics.median(r["load_s"] for r in rs), statistics.median(r["rss_gib"] for r in rs)
        lines.append(f"- `{e}`: load {load:.1f} s, peak RSS {rss:.2f} GiB ({rss / size_gib:.2f}x the file)")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--engines", nargs="+", default=["llama", "llmserve"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="the chat mix: every prompt opens with the same N tokens (a long system prompt) before its "
        "--input-len own ones (llmserve bench's prefix dataset); 0: random prompts",
    )
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--timeout", type=float, default=None, help="per-request deadline of the client, s (default: bench's auto)"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer for the random prompts (default: the GGUF's folder)")
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja file both servers use (default: chat_template.jinja beside the GGUF, if there: a file written "
        "by make_checkpoint --gguf-only holds none, where llama-server would fall back to ChatML and llmserve refuse)",
    )
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    a.gguf = os.path.expanduser(a.gguf)
    a.tokenizer = a.tokenizer or os.path.dirname(a.gguf)
    beside = os.path.join(os.path.dirname(a.gguf), "chat_template.jinja")
    a.chat_template = a.chat_template or (beside if os.path.exists(beside) else None)
    runs: dict[tuple[str, int], list[dict]] = {}
    tmp = tempfile.mkdtemp()
    for rnd in range(a.rounds):
        for c in a.concurrency:
            for i, engine in enumerate(a.engines):
                r = run_engine(engine, a, c, os.path.join(tmp, f"{i}-{c}-{rnd}.json"))
                runs.setdefault((engine, c), []).append(r)
                print(engine, c, rnd, r, flush=True)
    # the ratios read llmserve against the peer whichever ran first (the peers' medians the base)
    table = ab_table(runs, sorted(a.engines, key=lambda e: e.startswith("llmserve")), a.concurrency, "engine")
    body = (
        f"`python -m benchmarks.peers.gguf_serving {' '.join(sys.argv[1:])}` on {machine()}: `llmserve bench` for "
        f"every server, chat, random {a.input_len} / {a.output_len} tokens"
        + (f" after a shared {a.prefix_len}-token prefix" if a.prefix_len else "")
        + ", EOS ignored, at least "
        f"{a.num_requests} requests a run (2 per user), engines in turn ({a.rounds} rounds).\n\n"
        + table
        + "\n"
        + memory_lines(runs, a.engines, os.path.getsize(a.gguf) / 2**30)
    )
    print(body)
    if not a.no_write:
        # (the folder names the model: every make_checkpoint shape writes a model-Q4_K_M.gguf)
        name = os.path.join(os.path.basename(os.path.dirname(a.gguf)), os.path.basename(a.gguf))
        mix = f", a shared {a.prefix_len}-token prefix" if a.prefix_len else ""
        write_section(f"GGUF served as it comes: {name} against llama-server{mix}", body)


if __name__ == "__main__":
    main()
