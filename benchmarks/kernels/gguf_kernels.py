"""GGUF block kernels (llmserve/csrc/gguf_*.cpp) next to llmserve's int4 and float32 kernels, on an
8B model's MLP shapes (gate/up 4096 -> 14336, down 14336 -> 4096).

1. Single-row `linear` (decode): GB/s of weight bytes streamed, Q4_K and Q6_K read from their blocks
   next to llmserve's int4 (`q4_linear`, Q4_1-style 32-value blocks, 5 bits a weight) and float32
   (`f32_linear`). Several copies of each matrix (over 128 MB in all) are used in turn, so that every
   call streams its weights from memory as a decode step does.
2. Rows 1 / 4 / 16 / 64 / 256: ms per call of the integer dots and of the dequantized tiles + at::mm
   (where MANY_ROWS belongs), the int4 kernel's two paths and float32.

The kernels are timed in turn, round after round, and the median of each is kept (the machine is
shared: ratios between columns are steadier than the absolute figures). `--clock cpu` times the
process's CPU time instead of the wall clock: with `--threads 1` on a loaded machine, the time the
kernel itself took (stalls on memory included), not the time others held the core. The weights are
random valid blocks (the gguf package cannot quantize to K-quants; the speed does not depend on the
values).

3. `--gguf FILE`: one decode token's matmuls on a real file (every 2-D tensor, read in place from the
   memory map, one row of x each; the embeddings only where they are also the LM head): ms a token and
   GB/s. With `--threads 1 --clock cpu` this compares with llama.cpp's CPU time a token, e.g.
   `/usr/bin/time llama-bench -m FILE -p 0 -n N -t 1 -r 2` for two N: user time difference / (2 * dN).

    python -m benchmarks.kernels.gguf_kernels [--threads 2] [--rounds 5] [--clock wall|cpu] [--rows 1,4,16,64,256]
    python -m benchmarks.kernels.gguf_kernels --gguf model-Q4_K_M.gguf --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmserve.model.kernels import gguf_kernels as gk
from llmserve.model.kernels import ops

SHAPES = {"gate/up 4096->14336": (14336, 4096), "down 14336->4096": (4096, 14336)}
STREAM_BYTES = 128 << 20


def copies_of(make, nbytes: int) -> list:
    return [make(i) for i in range(max(1, -(-STREAM_BYTES // nbytes)))]


def weights(n: int, k: int, types: tuple[str, ...] = ("Q4_K", "Q6_K")) -> dict:
    """name -> (bytes of one matrix, [copies], fn(x, weights, many_rows))."""
    gg, cpu = gk.gguf_kernels(), ops.cpu_kernels()
    out = {}
    for qt in types:
        size = gk.row_bytes(qt, k) * n
        out[qt] = (
            size,
            copies_of(lambda i, qt=qt: gk.random_blocks(qt, n, k, seed=i), size),
            lambda x, w, mr, qt=qt: gg.linear(x, w, gk.qtype_number(qt), k, mr),
        )
    from llmserve.model.formats.quant import pack_int4, quantize_int4

    q, scale, lo = quantize_int4(torch.randn(n, k) * 0.02)
    int4 = (pack_int4(q), scale.half(), lo.half())
    size = sum(t.numel() * t.element_size() for t in int4)
    out["int4"] = (
        size,
        copies_of(lambda i: tuple(t.clone() for t in int4), size),
        lambda x, w, mr: cpu.q4_linear(x, *w, mr),
    )
    out["float32"] = (n * k * 4, [torch.randn(n, k) * 0.02], lambda x, w, mr: cpu.f32_linear(x, w, mr))
    return out


CLOCK = time.perf_counter


def timed(fn, seconds: float) -> float:
    """ms per call: at least 2 calls and `seconds`."""
    n, t = 0, CLOCK()
    while n < 2 or CLOCK() - t < seconds:
        fn(n)
        n += 1
    return (CLOCK() - t) / n * 1e3


def measure(cases: dict, rounds: int, seconds: float) -> dict:
    """case -> median ms over rounds; each round times every case in turn."""
    for fn in cases.values():
        fn(0)
    ms = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            ms[name].append(timed(fn, seconds))
    return {name: statistics.median(v) for name, v in ms.items()}


def file_token(path: str, rounds: int) -> None:
    import gguf

    reader = gguf.GGUFReader(path)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    mats = [gk.from_reader(t) for t in reader.tensors if len(t.shape) == 2 and (t.name != "token_embd.weight" or tied)]
    xs = {k: torch.randn(1, k) for _, _, k in mats}
    size = sum(raw.numel() for raw, _, _ in mats)

    def token(_):
        for raw, num, k in mats:
            gk.linear(xs[k], raw, num, k)

    ms = measure({"token": token}, rounds, 1.0)["token"]
    print(f"{path}: {len(mats)} matrices, {size / 1e6:.0f} MB a token: {ms:.1f} ms a token, {size / ms / 1e6:.1f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default="1,4,16,64,256")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--gguf", help="time one decode token's matmuls on this file instead")
    ap.add_argument("--types", default="Q4_K,Q6_K", help="the GGUF types timed, e.g. Q2_K,Q3_K,Q4_K,IQ4_NL,IQ4_XS")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    if args.gguf:
        file_token(args.gguf, args.rounds)
        return
    huge = 1 << 40
    print(f"threads {args.threads}, {args.clock} clock, median of {args.rounds} rounds\n")
    print("| shape | kernel | bits/weight | MB | ms, 1 row | GB/s |\n|---|---|---|---|---|---|")
    for shape, (n, k) in SHAPES.items():
        w = weights(n, k, tuple(args.types.split(",")))
        x = torch.randn(1, k)
        cases = {name: (lambda i, c=cs, f=fn, x=x: f(x, c[i % len(c)], huge)) for name, (_, cs, fn) in w.items()}
        res = measure(cases, args.rounds, 0.3)
        for name, (size, _, _) in w.items():
            print(
                f"| {shape} | {name} | {size * 8 / (n * k):.3g} | {size / 1e6:.1f} | {res[name]:.2f} | "
                f"{size / res[name] / 1e6:.1f} |"
            )
        del w
    rows = [int(r) for r in args.rows.split(",")]
    print(
        "\nms per call (dots: integer dot products, each weight pass serving 4 rows; tiles: dequantized to "
        "float32 + at::mm)\n"
    )
    print("| shape | kernel | " + " | ".join(f"M={m}" for m in rows) + " |\n|---|---|" + "---|" * len(rows))
    for shape, (n, k) in SHAPES.items():
        w = weights(n, k, tuple(args.types.split(",")))
        table = {}
        for m in rows:
            x = torch.randn(m, k)
            cases = {}
            for name, (_, cs, fn) in w.items():
                paths = {"float32": {"": m + 1 if m <= 64 else 0}}.get(name, {" dots": m + 1, " tiles": 0})
                for path, mr in paths.items():
                    cases[name + path] = lambda i, c=cs, f=fn, mr=mr, x=x: f(x, c[i % len(c)], mr)
            for name, v in measure(cases, max(1, args.rounds // 2), 0.2).items():
                table.setdefault(name, {})[m] = v
        for name, by_m in table.items():
            print(f"| {shape} | {name} | " + " | ".join(f"{by_m[m]:.1f}" for m in rows) + " |")
        del w


if __name__ == "__main__":
    main()
