"""Prefill attention: the C++ paged kernel (ops.paged_prefill_attention, reading K/V in place from the blocks)
against the SDPA path it replaced (`KernelConfig(in_place_prefill=False)`: SDPA on the chunk itself, or on the
prefix gathered out of the blocks under a boolean mask), alternated in one process:

  * one layer's attention call (attention.paged_attention, the model's head shapes, float32 cache of 16-token
    blocks in shuffled order): a fresh --prompt-len chunk, and a --chunk-len chunk after a cached --prefix-len
    prefix; the kernel's AVX-512 and AVX2 variants and the SDPA path, best of --repeats;
  * end to end: time to first token of a --prompt-len prompt (LLM(...), max_tokens=1, prefix caching off:
    every round prefills it all, in --max-num-batched-tokens chunks), best of --rounds alternated rounds.

    python -m benchmarks.kernels.prefill_attention [--model PATH] [--threads 2] [--rounds 5] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

from benchmarks.common import write_section


def layer_call(cfg, ctx: int, n: int, block_size: int = 16):
    """A closure running one layer's paged_attention for a chunk of n queries ending at position ctx."""
    from llmserve.model.attention import AttentionMetadata, PrefillChunk, paged_attention

    H, Hk, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    nb = (ctx + block_size - 1) // block_size
    kv = torch.randn(2, nb + 8, block_size, Hk, D)
    table = torch.randperm(nb + 8)[:nb]
    q, k, v = torch.randn(n, H, D), torch.randn(n, Hk, D), torch.randn(n, Hk, D)
    meta = AttentionMetadata(slot_mapping=torch.zeros(n, dtype=torch.long), prefills=[PrefillChunk(0, n, ctx, table)])
    return lambda: paged_attention(q, k, v, kv[0], kv[1], meta, D**-0.5, kv_written=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--chunk-len", type=int, default=256)
    ap.add_argument("--prefix-len", type=int, default=768)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()

    from llmserve import LLM, SamplingParams
    from llmserve.config import KernelConfig
    from llmserve.model.kernels import ops

    llm = LLM(model=a.model, num_threads=a.threads, enable_prefix_caching=False)
    cfg = llm.engine.runner.model.cfg
    ext = ops.cpu_kernels()
    assert ext is not None, "the C++ kernels did not build"
    has_avx512 = ext.uses_avx512()
    variants = [("kernel, AVX-512", True, True)] if has_avx512 else []
    variants += [("kernel, AVX2", True, False), ("SDPA (before)", False, False)]
    cases = [
        (f"{a.prompt_len} fresh", a.prompt_len, a.prompt_len),
        (f"{a.chunk_len} after {a.prefix_len}", a.prefix_len + a.chunk_len, a.chunk_len),
    ]
    best = {(c, v): float("inf") for c, *_ in cases for v, *_ in variants}
    with torch.inference_mode():
        calls = {c: layer_call(cfg, ctx, n) for c, ctx, n in cases}
        for rep in range(a.repeats + 1):
            for c, *_ in cases:
                for v, in_place, avx512 in variants:
                    ops.configure(KernelConfig(in_place_prefill=in_place))
                    ext.set_avx512(avx512)
                    t = time.perf_counter()
                    calls[c]()
                    if rep:  # the first round warms up
                        best[c, v] = min(best[c, v], time.perf_counter() - t)
    ops.configure(KernelConfig())
    ext.set_avx512(has_avx512)
    for (c, v), t in best.items():
        print(f"{c}: {v} {t * 1e3:.2f} ms", flush=True)

    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(a.prompt_len)]
    one = SamplingParams(max_tokens=1, temperature=0)
    ttft: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[int]] = {}
    llm.generate([prompt[:64]], one, use_tqdm=False)  # warm-up: crossovers, oneDNN primitives
    for _ in range(a.rounds):
        for in_place in (True, False):
            ops.configure(KernelConfig(in_place_prefill=in_place))
            t = time.perf_counter()
            out = llm.generate([prompt], one, use_tqdm=False)
            ttft[in_place].append(time.perf_counter() - t)
            tokens[in_place] = out[0].outputs[0].token_ids
            print(f"in_place_prefill={in_place}: TTFT {ttft[in_place][-1] * 1e3:.0f} ms", flush=True)
    ops.configure(KernelConfig())
    load = round(os.getloadavg()[0], 1)
    name = a.model or "bundled SmolLM2-135M"
    chunk = llm.engine.max_num_batched_tokens
    head = variants[0][0]
    lines = [
        f"`python -m benchmarks.kernels.prefill_attention{' --model ' + a.model if a.model else ''}` on {name} "
        f"({cfg.num_heads} heads, {cfg.num_kv_heads} KV heads, head size {cfg.head_dim}), {a.threads} threads, "
        f"load average {load} at the end. One layer's attention call (best of {a.repeats}, alternated):",
        "",
        "| chunk | " + " | ".join(v for v, *_ in variants) + f" | SDPA / {head} |",
        "|---|" + "---|" * (len(variants) + 1),
        *(
            f"| {c} | "
            + " | ".join(f"{best[c, v] * 1e3:.2f} ms" for v, *_ in variants)
            + f" | {best[c, 'SDPA (before)'] / best[c, head]:.2f}x |"
            for c, *_ in cases
        ),
        "",
        f"End to end: TTFT of a {a.prompt_len}-token prompt (max_tokens=1, prefix caching off, chunks of {chunk} "
        f"tokens), best of {a.rounds} alternated rounds: kernel {min(ttft[True]) * 1e3:.0f} ms, SDPA "
        f"{min(ttft[False]) * 1e3:.0f} ms ({min(ttft[False]) / min(ttft[True]):.2f}x); same first token: "
        f"{tokens[True] == tokens[False]}.",
    ]
    print("\n".join(lines))
    if not a.no_write:
        write_section(f"Prefill attention: paged C++ kernel vs SDPA ({name})", "\n".join(lines))


if __name__ == "__main__":
    main()
