"""int8's integer GEMM on AMX tiles against the AVX-512 VNNI kernel it replaces from 16 rows (`q8_vnni_gemm`,
llmserve/csrc/amx.h), with oneDNN's int8 matmul (`torch._int_mm`) and the bf16 projections' packed matmul beside
them, at the row counts of decoding batches and prefill chunks, on a 3B model's projection shapes:

  * each kernel's time, the best of --runs interleaved calls (the VM's neighbours move single calls by 20-50%);
  * the two llmserve paths' outputs compared bit for bit (the same integer sums, the same epilogue).

    python -m benchmarks.kernels.amx_gemm [--rows 1 8 16 32 64 256 1000] [--runs 15] [--no-write]
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import machine, write_section

SHAPES = ((3072, 5120), (3072, 16384), (8192, 3072))  # qkv, gate_up, down (Llama-3.2-3B's widths)


def best_of(fns: dict, runs: int) -> dict:
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(runs):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def measure(ext, m, k, wv, csum, scale, plain, packed, runs) -> tuple[bool, dict]:
    """(whether the AMX and VNNI paths give the same bits, each kernel's best time) at m rows."""
    import torch

    x = torch.randn(m, k)
    xb, x8 = x.bfloat16(), torch.randint(-127, 128, (max(m, 17), k), dtype=torch.int8)  # (_int_mm: > 16 rows)

    def amx():
        ext.set_amx(True, False)
        return ext.q8_vnni_gemm(x, wv, csum, scale, 16)

    def vnni():
        ext.set_amx(False, False)
        return ext.q8_vnni_gemm(x, wv, csum, scale, 16)

    def int_mm():
        return torch._int_mm(x8, plain)

    def bf16():
        return torch.ops.mkldnn._linear_pointwise(xb, packed, None, "none", [], "")

    same = torch.equal(amx(), vnni())
    return same, best_of({"amx": amx, "vnni": vnni, "int_mm": int_mm, "bf16": bf16}, runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 256, 1000])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    import torch

    from llmserve import envs
    from llmserve.model.kernels import ops

    torch.set_num_threads(args.threads)
    ext = ops.cpu_kernels()
    if ext is None or not ext.vnni_real():
        raise SystemExit("needs the CPU kernels on AVX-512 VNNI")
    if not ext.set_amx(True, False) or not ext.amx_real():
        raise SystemExit("no AMX-INT8 tiles on this CPU (or Linux refused the tile state)")
    torch.manual_seed(0)
    lines = [
        "| rows | K x N | AMX tiles ms (int8 TOP/s) | VNNI kernel ms | AMX / VNNI | oneDNN _int_mm ms | "
        "bf16 packed ms | same bits |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, n in SHAPES:
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        wv, csum = ops.vnni_pack(q)
        scale = torch.rand(n) * 0.01
        plain = q.t().contiguous()
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).bfloat16(), 32)
        for m in args.rows:
            same, t = measure(ext, m, k, wv, csum, scale, plain, packed, args.runs)
            tops = 2 * 2 * m * k * n / t["amx"] / 1e12  # two int8 levels a row (act_bits 16: `--quantization int8`)
            lines.append(
                f"| {m} | {k} x {n} | {t['amx'] * 1e3:.3f} ({tops:.2f}) | {t['vnni'] * 1e3:.3f} | "
                f"{t['vnni'] / t['amx']:.2f}x | {t['int_mm'] * 1e3:.3f} | {t['bf16'] * 1e3:.3f} | {same} |"
            )
            print(lines[-1], flush=True)
    ext.set_amx(envs.LLMSERVE_AMX != "0", envs.LLMSERVE_AMX == "twin")
    if not args.no_write:
        body = (
            f"`python -m benchmarks.kernels.amx_gemm` ({time.strftime('%Y-%m-%d %H:%M')}, {machine()}, "
            f"{args.threads} threads). `q8_vnni_gemm` at `--quantization int8`'s two int8 levels of activations a row "
            "(act_bits 16), on AMX tiles and on the VNNI kernel (the same call, `set_amx` switched); oneDNN's "
            "`_int_mm` (one level, at least 17 rows) and the bf16 projections' packed matmul for scale. Best of "
            f"{args.runs} interleaved calls. The AMX path runs from 16 rows by default (amx.h's kAmxRows); below "
            "that the VNNI kernel runs whichever is asked.\n\n" + "\n".join(lines) + "\n"
        )
        write_section("int8 GEMM on AMX tiles (issue #53)", body)


if __name__ == "__main__":
    main()
