"""GGUF's blocks times a batch of rows on AVX-512 VNNI: the row-by-row integer dots against the many-row kernels,
one projection at a time, on a 1B-class Llama's shapes in a Q4_K_M file's types (Q4_K for q/k/v/o and gate/up,
Q6_K for down), a Q8_0 file's, and the bundled SmolLM2-135M's:
  * K-quants: the panels (csrc/gguf_panels.cpp: the weights packed per call into panels of 16 rows, vpdpbusd over
    4 values of 16 rows); both paths round x per 256 values as llama.cpp's Q8_K;
  * Q4_K / Q6_K also repacked at load (csrc/gguf_repacked.cpp: panels of 16 rows kept, one kernel at every row count);
  * Q8_0: the block GEMM (q8b_vnni_gemm: 64 channels widened per call); both round x per 32 (Q8_0 x Q8_0);
  * MXFP4 (gpt-oss-20b's expert shapes): repacked at load only (no per-call panels), E8M0 scales all normal as
    in real files (a subnormal scale costs the float multiply a microcode assist on both paths).
The same integers, the float sums in another order. CPU time of the calling thread (--threads 1; robust to a
loaded machine), best of --repeats, alternated; the speed-up per row count decides KernelConfig.kquant_panel_rows
and q8_block_gemm_rows.

    python -m benchmarks.kernels.kquant_panels [--threads 1] [--repeats 7] [--no-write]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import write_section

SHAPES = {  # name -> (qtype, out, in)
    "SmolLM2 gate_up Q4_K": ("Q4_K", 3072, 768),
    "1B qkv Q4_K": ("Q4_K", 3072, 2048),
    "1B gate_up Q4_K": ("Q4_K", 16384, 2048),
    "1B down Q6_K": ("Q6_K", 2048, 8192),
    "1B qkv Q8_0": ("Q8_0", 3072, 2048),
    "1B down Q8_0": ("Q8_0", 2048, 8192),
    "gpt-oss-20b expert gate_up MXFP4": ("MXFP4", 5760, 2880),
    "gpt-oss-20b expert down MXFP4": ("MXFP4", 2880, 2880),
}
ROWS = (1, 4, 8, 16, 64, 256)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from llmserve.model.kernels import cpu_ext, ops
    from llmserve.model.kernels import gguf_kernels as gk

    ext = ops.cpu_kernels()
    assert ext is not None and ext.uses_vnni(), "needs the C++ kernels on a CPU with AVX-512 VNNI"
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    lines = []
    with torch.inference_mode():
        for name, (qtype, n, k) in SHAPES.items():
            raw = gk.random_blocks(qtype, n, k, seed=1)
            if qtype == "MXFP4":  # (normal scales, 2^-6 .. 2^-3, as a real file's)
                raw.view(n, k // 32, 17)[:, :, 0] = torch.randint(121, 125, (n, k // 32), dtype=torch.uint8)
            if qtype == "Q8_0":  # (the packed int8 layout a Q8_0 file's tensors load into)
                _, ts = gk.repack(raw, gk.qtype_number(qtype))

                def call(x, ts=ts):
                    return ext.q8_linear(x, *ts, 1 << 62, 8)

                switch = ext.set_q8_block_rows
            else:

                def call(x, raw=raw, qtype=qtype, k=k):
                    return gk.linear(x, raw, qtype, k)

                switch = ext.set_kquant_panels
            packed = gk.repack_panels(raw, qtype, k) if qtype in ("Q4_K", "Q6_K", "MXFP4") else None
            for m in ROWS:
                x = torch.randn(m, k)
                paths = [("dots", 1 << 62, call)] + ([] if qtype == "MXFP4" else [("panels", 1, call)])
                if packed:
                    paths.append(("repacked", 1 << 62, lambda x, p=packed: gk.packed_linear(x, *p)))
                best = {path: float("inf") for path, _, _ in paths}
                for _ in range(a.repeats):
                    for path, rows, fn in paths:
                        switch(rows)
                        t0 = clock()
                        fn(x)
                        best[path] = min(best[path], clock() - t0)
                cpu_ext._set_kquant_panels(cpu_ext.kernel_config())
                best.setdefault("panels", float("nan"))  # (MXFP4: no per-call panels)
                ratio = best["dots"] / best["panels"]
                rep = (
                    f"{best['repacked'] * 1e3:.2f} | **{best['dots'] / best['repacked']:.2f}x** / "
                    f"{best['panels'] / best['repacked']:.2f}x"
                    if packed
                    else "- | -"
                )
                dots, gemm = best["dots"] * 1e3, best["panels"] * 1e3
                line = f"| {name} | {m} | {dots:.2f} | {gemm:.2f} | **{ratio:.2f}x** | {rep} |"
                lines.append(line.replace("nan", "-").replace("**-x**", "-").replace("-x", "-"))
                print(lines[-1], flush=True)
    body = (
        f"`python -m benchmarks.kernels.kquant_panels --threads {a.threads} --repeats {a.repeats}`: one projection "
        f"of random K-quant blocks times m rows of x, {a.threads} thread(s), "
        f"{'CPU time of the thread' if a.threads == 1 else 'wall time'}, best of {a.repeats} (alternated). dots: "
        "the row-by-row integer dots (K-quants: kquant_dot_avx512, each weight row unpacked once per 4 rows of x, the "
        "float epilogue per row pair and super-block; Q8_0: q8_rows); GEMM: the K-quant panels (16 weight rows packed "
        "per call, 4 values of 16 rows a vpdpbusd, the epilogue once per 16 rows: csrc/gguf_panels.cpp) or Q8_0's "
        "block GEMM (q8b_vnni_gemm). The defaults take them from 12 rows (`KernelConfig.kquant_panel_rows`; 36 for "
        "Q6_K) and 4 (`q8_block_gemm_rows`). repacked: Q4_K's / Q6_K's panels kept from load "
        "(`KernelConfig.kquant_repack`, csrc/gguf_repacked.cpp), the default on VNNI CPUs at every row count: its "
        "speed-up over the dots / the panels; MXFP4 (gpt-oss-20b's experts, normal E8M0 scales) has the dots "
        "(block32_dot) and the repacked panels only.\n\n"
        "| projection | rows | dots ms | GEMM ms | GEMM's speed-up | repacked ms | repacked vs dots / panels |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(lines)
    )
    if not a.no_write:
        write_section("GGUF blocks times many rows: row-by-row dots against the VNNI GEMMs", body)


if __name__ == "__main__":
    main()
