"""LoRA adapters: throughput of 16 concurrent requests spread over 4 adapters vs all on the base model.

The bundled model, random rank-16 adapters on all 7 projections (llmserve.testing.lora), 16 chat prompts
x 64 output tokens submitted at once to the offline engine, greedy. Rounds interleave the settings so that
the shared machine's load hits them alike; the median round counts. `uptime` is noted before and after.

    python benchmarks/lora.py [--threads 2] [--rounds 3] [--rank 16] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import chat_prompts, write_section  # noqa: E402


def run(engine, prompts, params, loras) -> tuple[float, float]:
    """(output tokens per second, the fastest step in which every request decoded) of `prompts` added at
    once (`loras`: one adapter name or None each). The fastest step is the least disturbed by other load."""
    t = time.perf_counter()
    for ids, lora in zip(prompts, loras):
        engine.add_request(ids, params, lora_request=lora)
    n, best = 0, float("inf")
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if len(outs) == len(prompts) and all(len(o.outputs[0].delta_token_ids) == 1 for o in outs):
            best = min(best, dt)
        for o in outs:
            if o.finished:
                n += len(o.outputs[0].token_ids)
    return n / (time.perf_counter() - t), best


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    from llmserve import SamplingParams
    from llmserve.engine.engine import LLMEngine
    from llmserve.testing.lora import write_random_adapter

    load_before = uptime()
    tmp = tempfile.mkdtemp(prefix="llmserve-lora-bench-")
    names = [f"a{i}" for i in range(args.adapters)]
    modules = [
        f"{n}={write_random_adapter(os.path.join(tmp, n), rank=args.rank, alpha=2 * args.rank, seed=i)}"
        for i, n in enumerate(names)
    ]
    # prefix caching off: rounds repeat the prompts, and no setting may reuse an earlier round's KV
    plain = LLMEngine(num_threads=args.threads, kv_cache_memory=1.0, enable_prefix_caching=False)
    lora = LLMEngine(
        num_threads=args.threads,
        kv_cache_memory=1.0,
        enable_prefix_caching=False,
        lora_modules=modules,
        max_loras=args.adapters,
        max_lora_rank=args.rank,
    )
    prompts = [plain.tokenizer.encode_chat(c) for c in chat_prompts(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    spread = [names[i % len(names)] for i in range(args.requests)]
    settings = {
        "base model, engine without --enable-lora": (plain, [None] * args.requests),
        "base model, engine with the adapters loaded": (lora, [None] * args.requests),
        f"{args.adapters} adapters x {args.requests // args.adapters} requests": (lora, spread),
    }
    run(lora, prompts[:2], SamplingParams(max_tokens=4), [None, names[0]])  # warm-up (kernels, caches)
    results: dict[str, list[float]] = {k: [] for k in settings}
    steps: dict[str, float] = {k: float("inf") for k in settings}
    for r in range(args.rounds):
        for what, (engine, loras) in settings.items():
            tput, step = run(engine, prompts, params, loras)
            results[what].append(tput)
            steps[what] = min(steps[what], step)
            print(f"round {r}: {what}: {tput:.1f} tok/s, fastest decode step {step * 1000:.1f} ms", flush=True)
    load_after = uptime()
    med = {k: statistics.median(v) for k, v in results.items()}
    base = "base model, engine without --enable-lora"
    ref = med[base]
    rows = "\n".join(
        f"| {k} | {med[k]:.1f} tok/s | {', '.join(f'{x:.1f}' for x in results[k])} | "
        f"{med[k] / ref:.2f} | {steps[k] * 1000:.1f} ms | {steps[base] / steps[k]:.2f} |"
        for k in settings
    )
    key = f"{args.adapters} adapters x {args.requests // args.adapters} requests"
    mixed, mixed_step = med[key], steps[base] / steps[key]
    body = (
        f"`python benchmarks/lora.py --threads {args.threads} --rounds {args.rounds} --rank {args.rank} "
        f"--max-tokens {args.max_tokens}`: "
        f"{args.requests} chat prompts x {args.max_tokens} output tokens (greedy, ignore_eos) added at once to the "
        f"offline engine (prefix caching off), bundled SmolLM2-135M float32; random rank-{args.rank} PEFT "
        f"adapters on all 7 projections (q/k/v/o/gate/up/down) of every layer. Rounds interleave the "
        "settings; the median round counts.\n\n"
        "| requests | throughput (median round) | rounds | vs base | fastest 16-row decode step | vs base |\n"
        "|---|---|---|---|---|---|\n"
        f"{rows}\n\n"
        f"{args.adapters} adapters vs all on the base model: **{mixed / ref:.2f}x** the throughput "
        f"(**{(1 - mixed / ref) * 100:.0f}%** cost; target: at most 20%); by the fastest decode step (the "
        f"least disturbed by other load) **{mixed_step:.2f}x**.\n\n"
        f"Load: before `{load_before}`; after `{load_after}` (2 cores shared with other engineers' runs).\n"
    )
    print(body)
    if not args.no_write:
        write_section("LoRA adapters: 4 adapters vs the base model (issue #23)", body)


if __name__ == "__main__":
    main()
