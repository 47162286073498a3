"""GGUF K-quant layers in the fused decode stack, AVX-512 VNNI K-quant dots: A/B within one process.

1. `kernels`: one decode row through a Q4_K and a Q6_K matrix (8B shapes: 4096x4096, 14336x4096 and
   4096x14336), AVX2 vs AVX-512 VNNI dots, next to llmserve's int4 kernel (`q4_linear`, Q4_1-style
   blocks) on a same-size layer: ms a call and GB/s of weight bytes. Copies of each matrix (over 256 MB
   in all) are used in turn, so every call streams its weights from memory as a decode step does.
2. `model`: single-stream decode steps (one request, context 200, greedy: the model's forward called
   directly, as benchmarks/kernels/decode_step.py) of a GGUF file under `--quantization int4`, four ways: the module
   path (one Python call per projection, before this change) or the fused stack (every layer in one C++
   call), each with the AVX2 or the AVX-512 dots. `--profile` adds torch.profiler's op table of one step
   per path.

Every variant is timed in turn, round after round, and the best round kept (the machine is shared: read
the ratios, and quote the load average). `--clock cpu` times the process's CPU time instead of the wall
clock: with `--threads 1` on a loaded machine, the time the work itself took, not the time others held the core.

    python -m benchmarks.kernels.gguf_stack kernels [--threads 1 2] [--rounds 7]
    python -m benchmarks.kernels.gguf_stack model [--model ~/ckpt/llama-8b/model-Q4_K_M.gguf] [--steps 16]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.common import CKPT
from llmserve.model.kernels import gguf_kernels as gk
from llmserve.model.kernels import ops

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (N out, K in)
STREAM_BYTES = 256 << 20


CLOCK = time.perf_counter


def best_of(variants: dict, rounds: int, calls) -> dict:
    """name -> the best over rounds of ms a call; each round runs every variant in turn (`calls` calls)."""
    best = {name: float("inf") for name in variants}
    for r in range(rounds + 1):
        for name, (setup, fn) in variants.items():
            setup()
            t = CLOCK()
            for i in range(calls(name)):
                fn(i)
            ms = (CLOCK() - t) / calls(name) * 1e3
            if r:  # the first round warms up
                best[name] = min(best[name], ms)
    return best


def kernels(threads: list[int], rounds: int) -> None:
    from llmserve import envs
    from llmserve.model.formats.quant import pack_int4, quantize_int4

    cpu = ops.cpu_kernels()
    gg = gk.gguf_kernels()
    print(f"AVX-512 VNNI K-quant dots available: {cpu.set_avx512(True) and gg.uses_avx512()}")
    print("\n| shape (N x K) | threads | kernel | MB | ms a call | GB/s | vs int4 |\n|---|---|---|---|---|---|---|")
    for n, k in SHAPES:
        mats = {}
        for qt in ("Q4_K", "Q6_K"):
            size = gk.row_bytes(qt, k) * n
            copies = [gk.random_blocks(qt, n, k, seed=i) for i in range(max(1, -(-STREAM_BYTES // size)))]
            mats[qt] = (size, copies, gk.qtype_number(qt))
        q, scale, lo = quantize_int4(torch.randn(n, k) * 0.02)
        int4 = (pack_int4(q), scale.half(), lo.half())
        size4 = sum(t.numel() * t.element_size() for t in int4)
        int4_copies = [tuple(t.clone() for t in int4) for _ in range(max(1, -(-STREAM_BYTES // size4)))]
        x = torch.randn(1, k)
        for t in threads:
            torch.set_num_threads(t)
            variants = {
                "int4 (q4_linear)": (
                    lambda: cpu.set_avx512(True),
                    lambda i, x=x, c=int4_copies: cpu.q4_linear(x, *c[i % len(c)], 2),
                )
            }
            sizes = {"int4 (q4_linear)": size4}
            for qt, (size, copies, num) in mats.items():
                for isa in ("avx2", "avx512"):
                    name = f"{qt} {isa}"
                    variants[name] = (
                        lambda isa=isa: cpu.set_avx512(isa == "avx512"),
                        lambda i, x=x, c=copies, num=num, k=k: gg.linear(x, c[i % len(c)], num, k, 2),
                    )
                    sizes[name] = size
            ms = best_of(variants, rounds, lambda name: 40)
            for name, v in ms.items():
                gbs = sizes[name] / v / 1e6
                print(
                    f"| {n}x{k} | {t} | {name} | {sizes[name] / 1e6:.1f} | {v:.3f} | {gbs:.1f} | "
                    f"{ms['int4 (q4_linear)'] / v * sizes[name] / sizes['int4 (q4_linear)']:.2f}x |"
                )
    cpu.set_avx512(bool(envs.LLMSERVE_AVX512))
    print("\n(vs int4: the layer's GB/s over q4_linear's on the same shape)")


def model_ab(path: str, threads: int, steps: int, rounds: int, profile: bool) -> None:
    from llmserve import LLM, envs
    from llmserve.model.attention import AttentionMetadata, DecodeGroup

    t0 = time.perf_counter()
    llm = LLM(model=path, num_threads=threads, quantization="int4", kv_cache_memory=0.25, max_model_len=1024)
    print(
        f"{path}: loaded in {time.perf_counter() - t0:.1f} s, {threads} threads, load average {os.getloadavg()[0]:.1f}"
    )
    m, kv = llm.engine.model, llm.engine.runner.kv_caches
    cpu = ops.cpu_kernels()
    ctx = 200
    table = torch.arange(-(-ctx // llm.engine.block_size)).unsqueeze(0)

    def step(_=0):
        p = torch.tensor([ctx - 1])
        meta = AttentionMetadata(slot_mapping=p, decode_groups=[DecodeGroup(0, 1, table, torch.tensor([ctx]))])
        with torch.inference_mode():
            m(torch.tensor([42]), p, kv, meta, torch.zeros(1, dtype=torch.long), argmax=True)

    step()
    stack = m._decode_stack
    assert stack, "the GGUF model must fit the fused stack"

    def use(fused: bool, isa: str):
        def setup():
            cpu.set_avx512(isa == "avx512")
            m._decode_stack = stack if fused else False

        return setup

    variants = {
        f"{'stack' if fused else 'module path'}, {isa}": (use(fused, isa), step)
        for fused in (False, True)
        for isa in ("avx2", "avx512")
    }
    ms = best_of(variants, rounds, lambda name: steps)
    old = ms["module path, avx2"]
    print("\n| path | ms a token | tok/s | vs module path, AVX2 |\n|---|---|---|---|")
    for name, v in ms.items():
        print(f"| {name} | {v:.1f} | {1e3 / v:.2f} | {old / v:.2f}x |")
    print(f"(best of {rounds} rounds of {steps} steps; load average after: {os.getloadavg()[0]:.1f})")
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        for name in ("module path, avx512", "stack, avx512"):
            variants[name][0]()
            with prof(activities=[ProfilerActivity.CPU]) as p:
                for _ in range(3):
                    step()
            print(f"\n{name}, 3 steps:")
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    cpu.set_avx512(bool(envs.LLMSERVE_AVX512))
    m._decode_stack = stack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("kernels", "model"))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--model", default=f"{CKPT}/llama-8b/model-Q4_K_M.gguf")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    a = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    print(f"clock: {a.clock}")
    if a.what == "kernels":
        kernels(a.threads, a.rounds)
    else:
        torch.set_num_threads(a.threads[-1])
        model_ab(a.model, a.threads[-1], a.steps, a.rounds, a.profile)


if __name__ == "__main__":
    main()
