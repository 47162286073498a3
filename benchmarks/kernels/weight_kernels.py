"""Which matmul kernel for quantized weights: every CPU option torch offers, on SmolLM2's shapes.

float32 `F.linear` (the reference), fbgemm's float16-weight GEMM (`--quantization int8` on batches of 5+
rows), fbgemm's int8 GEMM with dynamic 7-bit activations, torch's weight-only `_weight_int8pack_mm` and
`_weight_int4pack_mm_for_cpu`, and llmserve's own kernels (llmserve/csrc/linear.cpp) as QuantLinear calls
them: int4 (Q4_1 blocks, int8 activations) and int8 (int16 activations), integer dots up to 48 / 16 rows
and float32 tiles beyond (`--quantization int4`; int8 hands 5+ rows to fbgemm). Times per call in ms,
batch rows M = 1 (single stream), 4, 16 and 64.
Weights are re-used call after call, so they sit in cache: a real decode step streams them from
memory, where smaller weights gain more (see "Against the peers" for end-to-end figures).

    python -m benchmarks.kernels.weight_kernels [--threads 2] [--no-write]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.nn.functional as F

from benchmarks.common import write_section

SHAPES = {"gate_up 576->3072": (3072, 576), "down 1536->576": (576, 1536), "lm_head 576->49152": (49152, 576)}


def bench(fn, seconds: float = 0.5) -> float:
    for _ in range(3):
        fn()
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        fn()
        n += 1
    return (time.perf_counter() - t) / n * 1e3


def kernels(w: torch.Tensor):
    from llmserve.model.formats.quant import quantize_int8_per_channel

    q, scale = quantize_int8_per_channel(w)
    n, k = w.shape
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp16 = torch.ops.quantized.linear_prepack_fp16(w, None)
        qw = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros(n, dtype=torch.long), 0)
        i8 = torch.ops.quantized.linear_prepack(qw, None)
    g = 32
    grp = w.reshape(n, k // g, g)
    lo, hi = grp.amin(-1), grp.amax(-1)
    s4 = (hi - lo) / 15
    q4 = torch.clamp(torch.round((grp - lo[..., None]) / s4[..., None]), 0, 15).to(torch.int32).reshape(n, k)
    packed4 = torch._convert_weight_to_int4pack_for_cpu(q4, 1)
    sz = torch.stack([s4.t(), (lo + 8 * s4).t()], -1).contiguous()
    from llmserve.model.formats.quant import QuantLinear

    ours4 = QuantLinear.from_float(w, None, "int4", fp16_gemm=False)
    ours8 = QuantLinear.from_float(w, None, "int8", fp16_gemm=False)
    return {
        "float32 F.linear": lambda x: F.linear(x, w),
        "fbgemm fp16 weights (int8 mode, 5+ rows)": lambda x: torch.ops.quantized.linear_dynamic_fp16(x, fp16),
        "fbgemm int8, 7-bit dynamic activations": lambda x: torch.ops.quantized.linear_dynamic(x, i8, True),
        "torch _weight_int8pack_mm": lambda x: torch._weight_int8pack_mm(x, q, scale),
        "torch _weight_int4pack_mm_for_cpu": lambda x: torch._weight_int4pack_mm_for_cpu(x, packed4, g, sz),
        "llmserve int4": ours4,
        "llmserve int8 (no fp16 copy)": ours8,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lines = ["| shape | M | " + " | ".join(kernels(torch.randn(64, 64)).keys()) + " |", "|---|---|" + "---|" * 7]
    for name, (n, k) in SHAPES.items():
        ks = kernels(torch.randn(n, k) * 0.05)
        for m in (1, 4, 16, 64):
            x = torch.randn(m, k)
            times = [bench(lambda f=f, x=x: f(x)) for f in ks.values()]
            lines.append(f"| {name} | {m} | " + " | ".join(f"{t:.3f}" for t in times) + " |")
            print(lines[-1], flush=True)
    body = (
        f"`python -m benchmarks.kernels.weight_kernels --threads {args.threads}`: ms per call (lower is better), "
        "weights in cache (a real decode step streams them from memory, where fewer bytes gain more). "
        "torch's weight-only int8/int4 kernels are far slower than float32 on AVX2, and fbgemm's int8 GEMM "
        "is fast but its per-tensor 7-bit activations cost SmolLM2 3.7x perplexity (22.8 -> 85); hence "
        "llmserve's own kernels for few rows, and fbgemm's fp16 GEMM (int8 mode) or float32 tiles (int4 mode) "
        "for many.\n\n" + "\n".join(lines) + "\n"
    )
    print(body)
    if not args.no_write:
        write_section("Weight kernels (issue: performance, quantization)", body)


if __name__ == "__main__":
    main()
