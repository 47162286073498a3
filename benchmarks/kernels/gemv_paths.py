"""The few-rows kernels against torch's GEMM, per weight shape and row count, with the AVX2 and the AVX-512
kernels (LLMSERVE_AVX512=0 / 1, each in its own process, alternated round by round).

For each projection shape of a model (SmolLM2-135M's or a 1B-class Llama's) and each row count: at::linear
(MKL / oneDNN), llmserve's float32 GEMV (`f32_linear`), its int8 x int16 integer dots (`q8_linear`) and
int8 tiles widened to float32 for at::mm (`q8_linear` past its row limit); best of --repeats, ms. Where the
float32 GEMV and at::linear cross is what `ops.gemm_rows` measures at start-up.

    python -m benchmarks.kernels.gemv_paths [--shapes 135m 1b] [--rows 1 4 8 16 32 64] [--rounds 2] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.common import ROOT, write_section

SHAPES = {  # (N, K) of qkv, o, gate_up, down and the LM head
    "135m": [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)],
    "1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (49152, 2048)],
}


def child(shapes: list[str], rows: list[int], repeats: int) -> None:
    import torch
    import torch.nn.functional as F

    from llmserve.model.kernels import ops

    ext = ops.cpu_kernels()

    def best(f) -> float:
        f()
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return 1e3 * min(ts)

    out = {"avx512": bool(ext.uses_avx512()), "t": {}}
    for name in shapes:
        for n, k in SHAPES[name]:
            w = torch.randn(n, k)
            q, s = ops.quantize_int8_per_channel(w)
            s = s[:, None].contiguous()
            for m in rows:
                x = torch.randn(m, k)
                out["t"][f"{name} {n}x{k} {m}"] = {
                    "at::linear": best(lambda: F.linear(x, w)),  # noqa: B023
                    "f32 GEMV": best(lambda: ext.f32_linear(x, w, 1 << 30)),  # noqa: B023
                    "int8 dots": best(lambda: ext.q8_linear(x, q, s, 1 << 30, 16)),  # noqa: B023
                    "int8 tiles": best(lambda: ext.q8_linear(x, q, s, 0, 16)),  # noqa: B023
                }
    print("RESULT " + json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["135m", "1b"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    if a.child:
        return child(a.shapes, a.rows, a.repeats)
    runs: dict[str, list[dict]] = {"0": [], "1": []}
    for _ in range(a.rounds):
        for flag in ("0", "1"):
            cmd = [
                sys.executable,
                "-m",
                __spec__.name,
                "--child",
                "--shapes",
                *a.shapes,
                "--rows",
                *map(str, a.rows),
                "--repeats",
                str(a.repeats),
            ]
            p = subprocess.run(
                cmd, capture_output=True, text=True, env={**os.environ, "LLMSERVE_AVX512": flag}, cwd=ROOT
            )
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(p.stderr[-2000:])
            runs[flag].append(json.loads(line[7:]))
    avx512 = runs["1"][0]["avx512"]
    kinds = ["at::linear", "f32 GEMV", "int8 dots", "int8 tiles"]

    def best_of(flag: str, key: str, kind: str) -> float:
        return min(r["t"][key][kind] for r in runs[flag])

    head = (
        "| shape, rows | "
        + " | ".join(f"{k} AVX2" + (" / AVX-512" if avx512 and k != "at::linear" else "") for k in kinds)
        + " |"
    )
    rows = [head, "|---|" + "---|" * len(kinds)]
    for key in runs["0"][0]["t"]:
        cells = []
        for kind in kinds:
            c = f"{best_of('0', key, kind):.2f}"
            if avx512 and kind != "at::linear":
                c += f" / {best_of('1', key, kind):.2f}"
            cells.append(c)
        rows.append(f"| {key} | " + " | ".join(cells) + " |")
    body = (
        f"`python -m benchmarks.kernels.gemv_paths {' '.join(sys.argv[1:])}` (load average {os.getloadavg()[0]:.1f} at "
        "the end; ms, best of each process's repeats and of the rounds; each kernel set in its own process, "
        "alternated). The AVX-512 kernels read the weights once per 8 rows (AVX2: 4).\n\n" + "\n".join(rows) + "\n"
    )
    print(body)
    if not a.no_write:
        write_section("Few-rows kernels vs torch's GEMM, per shape (issue #21)", body)


if __name__ == "__main__":
    main()
