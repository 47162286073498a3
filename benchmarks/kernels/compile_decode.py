"""Does torch.compile (inductor, CPU) pay for the decode step here? The model's forward for a step of
decode rows (context 200), three ways, each in its own process:
  * fused: llmserve's path (all layers in one call into llmserve/csrc/decode_stack.cpp);
  * eager: the module path with PyTorch ops only (LLMSERVE_CPU_KERNELS=0: what torch.compile can see);
  * compiled: that forward under `torch.compile(dynamic=False)` (inductor's C++/OpenMP code on CPU).
Reports the step time (50 steps after a warm-up) and the warm-up (compilation) time.

    python -m benchmarks.kernels.compile_decode [--rows 1 16] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.common import ROOT, write_section


def one(mode: str, rows: int, ctx: int = 200) -> dict:
    import torch

    from llmserve import LLM
    from llmserve.model.attention import AttentionMetadata, DecodeGroup

    llm = LLM(num_threads=2, kv_cache_memory=0.25)
    m, kv, bs = llm.engine.model, llm.engine.runner.kv_caches, llm.engine.block_size
    nb = -(-ctx // bs)
    table = torch.stack([torch.arange(nb) + i * nb for i in range(rows)])
    fwd = torch.compile(m.forward, dynamic=False) if mode == "compiled" else m.forward

    def step():
        slots = table[:, -1] * bs + (ctx - 1) % bs
        meta = AttentionMetadata(
            slot_mapping=slots, decode_groups=[DecodeGroup(0, rows, table, torch.full((rows,), ctx))]
        )
        with torch.inference_mode():
            return fwd(torch.full((rows,), 42), torch.full((rows,), ctx - 1), kv, meta, torch.arange(rows))

    t = time.perf_counter()
    for _ in range(3):
        step()
    warm = time.perf_counter() - t
    for _ in range(10):
        step()
    t = time.perf_counter()
    for _ in range(50):
        step()
    return {"mode": mode, "rows": rows, "warmup_s": warm, "step_ms": (time.perf_counter() - t) / 50 * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one(args.child[0], int(args.child[1]))))
        return
    table = ["| rows | fused C++ step | eager PyTorch ops | torch.compile | compile warm-up |", "|---|---|---|---|---|"]
    for rows in args.rows:
        res = {}
        for mode in ("fused", "eager", "compiled"):
            env = dict(os.environ, **({} if mode == "fused" else {"LLMSERVE_CPU_KERNELS": "0"}))
            out = subprocess.run(
                [sys.executable, "-m", __spec__.name, "--child", mode, str(rows)],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            res[mode] = json.loads(out.strip().splitlines()[-1])
            print(res[mode], flush=True)
        table.append(
            f"| {rows} | {res['fused']['step_ms']:.1f} ms | {res['eager']['step_ms']:.1f} ms | "
            f"{res['compiled']['step_ms']:.1f} ms | {res['compiled']['warmup_s']:.0f} s |"
        )
    body = (
        "`python -m benchmarks.kernels.compile_decode`: one decode step's model forward (context 200, float32), each "
        "way "
        "in its own process: llmserve's fused C++ path, the module path with PyTorch ops only "
        "(`LLMSERVE_CPU_KERNELS=0`), and that forward under `torch.compile(dynamic=False)` (inductor, CPU).\n\n"
        + "\n".join(table)
        + "\n\nOn this CPU compilation does not pay: the compiled step is slower than the "
        "fused path (and than eager: the paged attention's per-step gather is not a static graph; not chased) and "
        "costs minutes of warm-up, so llmserve does not compile (CUDA graphs: untested, no GPU).\n"
    )
    print(body)
    if not args.no_write:
        write_section("torch.compile of the decode step (issue: performance)", body)


if __name__ == "__main__":
    main()
