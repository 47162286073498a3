"""LoRA adapters: throughput of 16 concurrent requests spread over 4 adapters vs all on the base model.

The bundled model, random rank-16 adapters on all 7 projections (llmserve.testing.lora), 16 chat prompts
x 64 output tokens submitted at once to the offline engine, greedy. Each setting has its own engine and
the settings advance in lockstep, one engine step each in turn, so that the shared machine's load hits
them alike; a setting's throughput is its output tokens over the time of its own steps. Settings: the base
model on an engine without adapters, the base model on an engine with the adapters loaded, the adapters
in the fused C++ decode stack (DecodeStack.run_lora, the default), and the adapters on the module path
(llmserve.model.lora.FUSED off: the per-projection hooks). The median round counts. `uptime` is noted
before and after.

    python -m benchmarks.engine.lora [--threads 2] [--rounds 3] [--rank 16] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time

from benchmarks.common import chat_prompts, write_section


def lockstep(settings: dict, prompts, params) -> dict[str, tuple[float, float, float]]:
    """Per setting (engine, one adapter name or None per prompt, LoRA in the fused stack or not): (output
    tokens per second of its own steps, median and fastest step in which every request decoded)."""
    from llmserve.model import lora as lora_mod

    for engine, loras, _ in settings.values():
        for ids, lora in zip(prompts, loras):
            engine.add_request(ids, params, lora_request=lora)
    busy = {k: 0.0 for k in settings}
    tokens = {k: 0 for k in settings}
    steps: dict[str, list[float]] = {k: [] for k in settings}
    try:
        while any(e.has_unfinished_requests() for e, _, _ in settings.values()):
            for what, (engine, _, fused) in settings.items():
                if not engine.has_unfinished_requests():
                    continue
                lora_mod.FUSED = fused
                t0 = time.perf_counter()
                outs = engine.step()
                dt = time.perf_counter() - t0
                busy[what] += dt
                if len(outs) == len(prompts) and all(len(o.outputs[0].delta_token_ids) == 1 for o in outs):
                    steps[what].append(dt)
                tokens[what] += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
    finally:
        lora_mod.FUSED = True
    return {k: (tokens[k] / busy[k], statistics.median(steps[k]), min(steps[k])) for k in settings}


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
    kw = dict(num_threads=args.threads, kv_cache_memory=1.0, enable_prefix_caching=False)
    lora_kw = dict(kw, lora_modules=modules, max_loras=args.adapters, max_lora_rank=args.rank)
    plain = LLMEngine(**kw)
    prompts = [plain.tokenizer.encode_chat(c) for c in chat_prompts(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    spread = [names[i % len(names)] for i in range(args.requests)]
    mixed = f"{args.adapters} adapters x {args.requests // args.adapters} requests"
    settings = {
        "base model, engine without --enable-lora": (plain, [None] * args.requests, True),
        "base model, engine with the adapters loaded": (LLMEngine(**lora_kw), [None] * args.requests, True),
        f"{mixed}, fused decode stack": (LLMEngine(**lora_kw), spread, True),
        f"{mixed}, module path (FUSED off)": (LLMEngine(**lora_kw), spread, False),
    }
    for engine, _, _ in settings.values():  # warm-up (kernels, caches, the decode stack)
        for ids, lora in zip(prompts[:2], [None, names[0]] if engine is not plain else [None, None]):
            engine.add_request(ids, SamplingParams(max_tokens=4), lora_request=lora)
        while engine.has_unfinished_requests():
            engine.step()
    results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in settings}
    for r in range(args.rounds):
        for what, res in lockstep(settings, prompts, params).items():
            results[what].append(res)
            print(
                f"round {r}: {what}: {res[0]:.1f} tok/s, decode step median {res[1] * 1000:.1f} ms, "
                f"fastest {res[2] * 1000:.1f} ms",
                flush=True,
            )
    load_after = uptime()
    base = "base model, engine without --enable-lora"
    med = {k: statistics.median(x[0] for x in v) for k, v in results.items()}
    step = {k: statistics.median(x[1] for x in v) for k, v in results.items()}
    best = {k: min(x[2] for x in v) for k, v in results.items()}
    rows = "\n".join(
        f"| {k} | {med[k]:.1f} tok/s | {', '.join(f'{x[0]:.1f}' for x in results[k])} | {med[k] / med[base]:.2f} | "
        f"{step[k] * 1000:.1f} ms | {step[base] / step[k]:.2f} | {best[k] * 1000:.1f} ms |"
        for k in settings
    )
    fused = f"{mixed}, fused decode stack"
    cost, step_cost = 1 - med[fused] / med[base], 1 - step[base] / step[fused]
    body = (
        f"`python -m benchmarks.engine.lora --threads {args.threads} --rounds {args.rounds} --rank {args.rank} "
        f"--max-tokens {args.max_tokens}`: "
        f"{args.requests} chat prompts x {args.max_tokens} output tokens (greedy, ignore_eos) added at once to the "
        f"offline engine (prefix caching off), bundled SmolLM2-135M float32; random rank-{args.rank} PEFT "
        f"adapters on all 7 projections (q/k/v/o/gate/up/down) of every layer. One engine per setting, the "
        "settings stepped in lockstep (one step each in turn: the machine's load hits them alike); throughput "
        "is a setting's output tokens over its own steps' time; the median round counts.\n\n"
        "| setting | throughput (median round) | rounds | vs base | median 16-row decode step | vs base "
        "| fastest decode step |\n"
        "|---|---|---|---|---|---|---|\n"
        f"{rows}\n\n"
        f"{args.adapters} adapters (fused decode stack) vs all on the base model: **{med[fused] / med[base]:.2f}x** "
        f"the throughput (**{cost * 100:.0f}%** cost; target: at most 20%); by the median 16-row decode step "
        f"**{step_cost * 100:.0f}%** slower.\n\n"
        f"Load: before `{load_before}`; after `{load_after}` (2 cores shared with other engineers' runs).\n"
    )
    print(body)
    if not args.no_write:
        write_section("LoRA adapters: 4 adapters vs the base model (issue #23)", body)


if __name__ == "__main__":
    main()
