"""The roofline of this machine and where llmserve sits under it, measured in one run.

Bounds, measured first in this process (both cores):
  * memory bandwidth: the best of several sums over a 1 GiB float32 array (decode reads every weight once a step);
  * GEMM peaks at a prefill shape (--rows x 2048 x 8192): float32 and bfloat16 through `torch.nn.functional.linear`
    (bfloat16: oneDNN's AVX512-BF16 / AMX kernel where the CPU has it); int8 the best of `torch._int_mm` (oneDNN's)
    and llmserve's `q8_vnni_gemm` (AMX tiles or VNNI) at one int8 level per token, and `int8_two_level` that GEMM
    at `--quantization int8`'s two levels (~15-bit activations: twice the integer work; that mode's own bound).

Then each weight mode runs the engine in its own process (`LLM.generate`, EOS ignored) and reports:
  * single stream decode tok/s against its bandwidth bound: bandwidth / (bytes its layers hold + KV bytes read a
    token), so the fraction is how close a decode step comes to reading the weights once at full speed;
  * prefill tok/s (--prefill-requests prompts of --prompt-len tokens, one output token each) against its compute
    bound: the mode's GEMM peak / (2 x matmul weights a token), attention left out of the bound (small at these
    lengths), so the fraction is the share of the peak the whole prefill reaches (w8a8: its one-level layers at the
    int8 peak, its two-level ones at int8_two_level's);
  * decode tok/s at --batch rows against the lower of the two bounds for a step of that many rows.

    python -m benchmarks.kernels.roofline [--model DIR_OR_GGUF] [--modes bfloat16,int8,w8a8,int4,auto] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.common import ROOT, machine, write_section

MODES = {  # name -> (LLM keyword arguments, the GEMM peak that bounds its prefill)
    "float32": (dict(dtype="float32"), "float32"),
    "bfloat16": (dict(dtype="bfloat16"), "bfloat16"),
    "int8": (dict(dtype="float32", quantization="int8"), "int8_two_level"),
    # one int8 level but at the layers that keep two (quant.TWO_LEVEL_LAYERS): bounded by both peaks, by weights
    "w8a8": (dict(dtype="float32", quantization="w8a8"), "int8"),
    "int4": (dict(dtype="float32", quantization="int4"), "int8"),
    "auto": ({}, "int8"),  # serve's defaults (a quantized GGUF: its own blocks, integer dots)
}


def best_of(fn, runs: int) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def probe(rows: int, runs: int) -> dict:
    """Bandwidth (GB/s) and GEMM peaks (GFLOP/s) of this process's threads."""
    import torch
    import torch.nn.functional as F

    big = torch.ones(256 * 1024 * 1024)  # 1 GiB
    bw = big.numel() * 4 / best_of(big.sum, runs) / 1e9
    del big
    k, n = 2048, 8192
    flop = 2 * rows * k * n
    from llmserve.model.formats import bf16
    from llmserve.model.kernels import ops
    from llmserve.model.kernels.cpu_ext import cpu_has_int8_dots

    peaks = {}
    dtypes = (("float32", torch.float32),) + ((("bfloat16", torch.bfloat16),) if bf16.supported() else ())
    for name, dt in dtypes:  # bfloat16 only where the CPU multiplies it natively (else minutes of emulation)
        a, w = torch.randn(rows, k, dtype=dt), torch.randn(n, k, dtype=dt)
        peaks[name] = flop / best_of(lambda a=a, w=w: F.linear(a, w), runs) / 1e9
        if dt is torch.bfloat16 and (packed := bf16._pack(w)) is not None:  # BF16Linear's own: oneDNN's packed weight
            bp = flop / best_of(
                lambda a=a, p=packed, f=torch.ops.mkldnn._linear_pointwise: f(a, p, None, "none", [], ""), runs
            )
            bp /= 1e9
            peaks[name] = max(peaks[name], bp)
    # float32 through llmserve's own GEMM (ops.linear: its engine, MKL or oneDNN on a packed weight), the best of both
    a, w = torch.randn(rows, k), torch.randn(n, k)
    packed, replaces = ops.pack_weight(w)
    w, packed = (packed, None) if replaces else (w, packed)
    peaks["float32"] = max(peaks["float32"], flop / best_of(lambda: ops.linear(a, w, packed), runs) / 1e9)
    if cpu_has_int8_dots():  # elsewhere llmserve's int8 / int4 prefill widens weights to float32 tiles
        a8 = torch.randint(-127, 127, (rows, k), dtype=torch.int8)
        w8 = torch.randint(-127, 127, (k, n), dtype=torch.int8)
        peaks["int8"] = flop / best_of(lambda: torch._int_mm(a8, w8), runs) / 1e9
    ext = ops.cpu_kernels()
    wv = None if ext is None else ops.vnni_pack(torch.randint(-127, 127, (n, k), dtype=torch.int8))
    if wv is not None:  # llmserve's own integer GEMM (AMX tiles where the CPU has them, else VNNI)
        x, scale = torch.randn(rows, k), torch.rand(n)
        one = flop / best_of(lambda: ext.q8_vnni_gemm(x, *wv, scale, 8), runs) / 1e9  # one int8 level per token
        peaks["int8"] = max(peaks.get("int8", 0.0), one)
        # `--quantization int8`'s activations: two int8 levels per token (~15 bits), twice the integer work for the
        # same product: its own bound, counted in the product's flops
        peaks["int8_two_level"] = flop / best_of(lambda: ext.q8_vnni_gemm(x, *wv, scale, 16), runs) / 1e9
    return {"bandwidth_gbs": bw, "peak_gflops": peaks}


def layer_bytes(model) -> tuple[int, int]:
    """(bytes the projection layers hold, in every layout they keep; weights a token multiplies by). Norms and the
    embedding table (one row a token) are left out; a tied head counts once, as a projection."""
    import torch

    seen, nbytes, nweights = set(), 0, 0
    for m in model.modules():
        i, o = getattr(m, "in_features", None), getattr(m, "out_features", None)
        if not (isinstance(i, int) and isinstance(o, int)) or list(m.children()):
            continue
        nweights += i * o
        held = [getattr(m, a, None) for a in ("packed", "_plain")]  # BF16Linear's weight (a plain attribute)
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)) + held:
            if not isinstance(t, torch.Tensor):
                continue
            if t.is_mkldnn:  # a oneDNN-packed weight: no storage to read, its elements are its bytes
                key, size = id(t), t.numel() * t.element_size()
            else:
                key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            if key not in seen:
                seen.add(key)
                nbytes += size
    return nbytes, nweights


def child(args) -> None:
    """One weight mode in this process: prints one JSON line."""
    from llmserve import LLM, SamplingParams

    kwargs, _ = MODES[args.child]
    llm = LLM(args.model, num_threads=args.threads, kv_cache_memory=2, max_model_len=2048, **kwargs)
    eng = llm.engine
    nbytes, nweights = layer_bytes(eng.model)
    from llmserve.model.formats.quant import QuantLinear

    two_level = sum(  # weights multiplied by activations at two int8 levels (int8 mode's; w8a8's LM head)
        m.in_features * m.out_features
        for m in eng.model.modules()
        if isinstance(m, QuantLinear) and m.kind == "int8" and m.act_bits > 8
    )
    cfg = eng.model.cfg
    kv_elem = eng.kv_dtype.itemsize
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_elem
    greedy = dict(temperature=0, ignore_eos=True)
    prompt = [[(7 * j) % 40000 + 100 for j in range(32)]]
    llm.generate(prompt, SamplingParams(max_tokens=8, **greedy), use_tqdm=False)
    t = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=args.decode_tokens, **greedy), use_tqdm=False)
    single = args.decode_tokens / (time.perf_counter() - t)
    prompts = [[(7 * i + 13 * j) % 40000 + 100 for j in range(args.prompt_len)] for i in range(args.prefill_requests)]
    eng.kv.reset_prefix_cache() if hasattr(eng.kv, "reset_prefix_cache") else None
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    prefill = len(prompts) * args.prompt_len / (time.perf_counter() - t)
    rows = [[(11 * i + 3 * j) % 40000 + 100 for j in range(32)] for i in range(args.batch)]
    llm.generate(rows, SamplingParams(max_tokens=4, **greedy), use_tqdm=False)
    t = time.perf_counter()
    llm.generate(rows, SamplingParams(max_tokens=args.decode_tokens, **greedy), use_tqdm=False)
    batched = args.batch * args.decode_tokens / (time.perf_counter() - t)
    ctx = 32 + args.decode_tokens / 2  # the mean context a decode step reads
    res = dict(
        layer_bytes=nbytes,
        matmul_weights=nweights,
        two_level_weights=two_level,
        kv_bytes_per_token=kv_per_token * ctx,
        single=single,
        prefill=prefill,
        batched=batched,
    )
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a Hugging Face folder or GGUF file (default: the bundled model)")
    p.add_argument(
        "--modes", default=None, help="default: bfloat16,int8,int4 (float32 for bfloat16 without AVX512-BF16)"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=256, help="rows of the GEMM peak probe")
    p.add_argument("--runs", type=int, default=15, help="best of this many calls per GEMM peak (fewer swing 2x here)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--prefill-requests", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if args.child:
        return child(args)
    import torch

    from llmserve.model.formats import bf16

    torch.set_num_threads(args.threads)
    args.modes = args.modes or ("bfloat16" if bf16.supported() else "float32") + ",int8,int4"
    bounds = probe(args.rows, args.runs)
    bw, peaks = bounds["bandwidth_gbs"], bounds["peak_gflops"]
    print(f"bandwidth {bw:.1f} GB/s; GEMM peaks " + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()) + " GFLOP/s")
    rows = [
        "| mode | layer bytes | single stream tok/s (bound, share) | prefill tok/s (bound, share) "
        f"| {args.batch} rows decode tok/s (bound, share) |",
        "|---|---|---|---|---|",
    ]
    env = dict(os.environ, LLMSERVE_CPU_BF16="1")
    for mode in args.modes.split(","):
        cmd = [sys.executable, "-m", __spec__.name, "--child", mode, "--threads", str(args.threads)]
        cmd += ["--prompt-len", str(args.prompt_len), "--prefill-requests", str(args.prefill_requests)]
        cmd += ["--decode-tokens", str(args.decode_tokens), "--batch", str(args.batch)]
        cmd += ["--model", args.model] if args.model else []
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{mode}: failed\n{res.stderr[-3000:]}")
        r = json.loads(line[7:])
        peak = peaks.get(MODES[mode][1], peaks["float32"]) * 1e9
        flop_token = 2 * r["matmul_weights"]
        b_single = bw * 1e9 / (r["layer_bytes"] + r["kv_bytes_per_token"])
        b_prefill = peak / flop_token
        if mode == "w8a8" and "int8_two_level" in peaks:  # its two-level layers at that GEMM's own peak
            w2 = r["two_level_weights"]
            b_prefill = 1 / (2 * (r["matmul_weights"] - w2) / peak + 2 * w2 / (peaks["int8_two_level"] * 1e9))
        step_bytes = r["layer_bytes"] + args.batch * r["kv_bytes_per_token"]
        b_batched = min(bw * 1e9 / step_bytes * args.batch, b_prefill)

        def cell(v, b):
            return f"{v:.1f} ({b:.0f}, {v / b:.0%})"

        rows.append(
            f"| {mode} | {r['layer_bytes'] / 2**20:.0f} MiB | {cell(r['single'], b_single)} | "
            f"{cell(r['prefill'], b_prefill)} | {cell(r['batched'], b_batched)} |"
        )
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    if not args.no_write:
        model = os.path.basename(str(args.model or "bundled SmolLM2-135M-Instruct").rstrip("/"))
        body = (
            f"`python -m benchmarks.kernels.roofline {' '.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d %H:%M')}, "
            f"{machine()}, model {model}). Bounds measured in the same run: bandwidth {bw:.1f} GB/s (sum over 1 GiB), "
            f"GEMM peaks at {args.rows} x 2048 x 8192: "
            + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items())
            + " GFLOP/s. Single stream: bound = bandwidth / (layer bytes + KV read a token). Prefill: "
            f"{args.prefill_requests} x {args.prompt_len} tokens, bound = the mode's GEMM peak (int4 prefills through "
            "int8 VNNI where the CPU has it, else float32 tiles) / 2 flop a matmul weight. Batched decode: the lower "
            "of the bandwidth bound for a step "
            f"of {args.batch} rows and the compute bound.\n\n{table}\n"
        )
        write_section(f"Roofline: {model}", body)


if __name__ == "__main__":
    main()
