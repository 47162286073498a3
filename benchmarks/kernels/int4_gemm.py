"""int4 (Q4_1 blocks) times a batch of rows: the three paths of `q4_linear`, one projection at a time, on the
shapes of the bundled SmolLM2-135M and of a 1B-class Llama:

  * the integer dots (q4_block: activations rounded per 32 values to int8, AVX2 vpmaddubsw, 4 rows a pass);
  * the VNNI integer GEMM (q4_vnni_gemm, `KernelConfig.int4_vnni`: the same rounding, vpdpbusd, the nibbles
    widened per call 64 channels at a time);
  * float32 tiles (the weights widened to float32, then the float32 GEMM; exact in float32).

Best of --repeats calls each, alternated; the VNNI GEMM's speed-up over the other two per row count.

    python -m benchmarks.kernels.int4_gemm [--threads 2] [--repeats 20] [--no-write]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import write_section

SHAPES = {  # (out, in) of each projection
    "SmolLM2 qkv": (960, 576),
    "SmolLM2 gate_up": (3072, 576),
    "SmolLM2 down": (576, 1536),
    "1B qkv": (3072, 2048),
    "1B gate_up": (16384, 2048),
    "1B down": (2048, 8192),
}
ROWS = (1, 4, 16, 64, 512)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from llmserve.model.formats.quant import pack_int4, quantize_int4
    from llmserve.model.kernels import ops

    ext = ops.cpu_kernels()
    assert ext is not None and ext.uses_vnni(), "needs the C++ kernels on a CPU with AVX-512 VNNI"
    paths = {  # name -> (VNNI switch, many_rows)
        "dots": (True, 1 << 30),
        "VNNI GEMM": (True, 1),
        "float32 tiles": (False, 1),
    }
    rows_out = []
    torch.manual_seed(0)
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            q, scale, lo = quantize_int4(torch.randn(n, k))
            qw, s, mn = pack_int4(q), scale.half().contiguous(), lo.half().contiguous()
            for m in ROWS:
                x = torch.randn(m, k)
                best = dict.fromkeys(paths, float("inf"))
                for rep in range(a.repeats + 1):
                    for p, (vnni, many) in paths.items():
                        ext.set_q4_vnni(vnni)
                        t = time.perf_counter()
                        ext.q4_linear(x, qw, s, mn, many)
                        if rep:
                            best[p] = min(best[p], time.perf_counter() - t)
                ext.set_q4_vnni(ops.kernel_config().int4_vnni)
                v = best["VNNI GEMM"]
                cells = " | ".join(f"{best[p] * 1e3:.3f}" for p in paths)
                line = (
                    f"| {name} {n} x {k} | {m} | {cells} | {best['dots'] / v:.2f}x | {best['float32 tiles'] / v:.2f}x |"
                )
                print(line, flush=True)
                rows_out.append(line)
    body = (
        f"`python -m benchmarks.kernels.int4_gemm --threads {a.threads}`: one int4 projection (Q4_1 blocks, random "
        "weights) "
        f"times m rows through each path of `q4_linear`, best of {a.repeats} alternated calls, ms; the VNNI GEMM's "
        "speed-up over the dots and over the float32 tiles.\n\n"
        "| projection | rows | dots | VNNI GEMM | float32 tiles | dots / VNNI | tiles / VNNI |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(rows_out)
    )
    if not a.no_write:
        write_section("int4 GEMM paths: integer dots, VNNI GEMM, float32 tiles", body)


if __name__ == "__main__":
    main()
