"""Which float32 GEMM the many-rows paths should use (`KernelConfig.gemm`, ops.gemm_engine): at::linear (MKL's
sgemm in torch's CPU build) or oneDNN's matmul (torch's mkldnn::_linear_pointwise), alternated round by round in
one process, on a model's own weight shapes and end to end:

  * per shape and row count: at::linear, oneDNN, and the extension's GEMV (best of --repeats);
  * the time to first token of a --prompt-len prompt (prefix caching off: every round prefills it all);
  * offline throughput: --requests random prompts of --input-len tokens, --output-len tokens each (EOS ignored),
    submitted together (prefill and decode), output tok/s.

    python -m benchmarks.kernels.gemm_engine [--model PATH] [--rounds 3] [--threads 2] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
import torch.nn.functional as F

from benchmarks.common import write_section

ENGINES = ("aten", "onednn")


def best_of(repeats: int, fn, *args) -> float:
    fn(*args)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t)
    return best


def shapes_table(model, rows: list[int], repeats: int) -> list[str]:
    from llmserve.model.kernels import cpu_ext, ops

    ext = ops.cpu_kernels()
    layer = model.layers[0]
    lines = [
        "| weight (N x K) | rows | at::linear ms | oneDNN ms | GEMV ms | oneDNN vs at::linear |",
        "|---|---|---|---|---|---|",
    ]
    for name, lin in (
        ("qkv", layer.self_attn.qkv_proj),
        ("o", layer.self_attn.o_proj),
        ("gate_up", layer.mlp.gate_up_proj),
        ("down", layer.mlp.down_proj),
        ("lm_head", model.lm_head),
    ):
        w = lin.weight.detach()
        for m in rows:
            x = torch.randn(m, w.shape[1])
            a = best_of(repeats, F.linear, x, w)
            o = best_of(repeats, cpu_ext._onednn_linear, x, w)
            g = best_of(repeats, ext.f32_linear, x, w, m + 1) if m <= 64 else None
            gs = f"{g * 1e3:.3f}" if g is not None else "-"
            lines.append(
                f"| {name} {w.shape[0]} x {w.shape[1]} | {m} | {a * 1e3:.3f} | {o * 1e3:.3f} | {gs} | {a / o:.2f}x |"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()

    from llmserve import LLM, SamplingParams
    from llmserve.config import KernelConfig
    from llmserve.model.kernels import cpu_ext, ops

    llm = LLM(model=a.model, num_threads=a.threads, enable_prefix_caching=False)
    model = llm.engine.runner.model
    with torch.inference_mode():
        table = shapes_table(model, [1, 16, 64, 256, 512], a.repeats)
    print("\n".join(table))

    rng = random.Random(0)
    long_prompt = [rng.randrange(100, 40000) for _ in range(a.prompt_len)]
    batch = [[rng.randrange(100, 40000) for _ in range(a.input_len)] for _ in range(a.requests)]
    one = SamplingParams(max_tokens=1, temperature=0)
    many = SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True)
    ttft: dict[str, list[float]] = {e: [] for e in ENGINES}
    tput: dict[str, list[float]] = {e: [] for e in ENGINES}
    for _ in range(a.rounds):
        for engine in ENGINES:
            ops.configure(KernelConfig(gemm=engine))
            cpu_ext._CROSSOVERS.clear()  # the GEMV/GEMM crossovers were measured against the other engine
            model._decode_stack = None
            llm.generate([long_prompt[:64]], one, use_tqdm=False)  # re-measures the crossovers
            t = time.perf_counter()
            llm.generate([long_prompt], one, use_tqdm=False)
            ttft[engine].append(time.perf_counter() - t)
            t = time.perf_counter()
            out = llm.generate(batch, many, use_tqdm=False)
            tput[engine].append(sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - t))
            print(engine, f"TTFT {ttft[engine][-1] * 1e3:.0f} ms, {tput[engine][-1]:.1f} tok/s", flush=True)
    ops.configure(KernelConfig())
    load = round(os.getloadavg()[0], 1)
    name = a.model or "bundled SmolLM2-135M"
    lines = [
        f"`python -m benchmarks.kernels.gemm_engine{' --model ' + a.model if a.model else ''}` on {name}, "
        f"{a.threads} threads, {time.strftime('%Y-%m-%d')}, load average {load} at the end; "
        f"CPU: {open('/proc/cpuinfo').read().split('model name')[1].split(':')[1].splitlines()[0].strip()}. "
        "Per shape (best of 5):",
        "",
        *table,
        "",
        f"End to end, best of {a.rounds} alternated rounds: TTFT of a {a.prompt_len}-token prompt (prefix caching "
        f"off), and {a.requests} requests x {a.input_len} / {a.output_len} tokens submitted together (output tok/s):",
        "",
        "| GEMM | TTFT ms | output tok/s |",
        "|---|---|---|",
        *(f"| {e} | {min(ttft[e]) * 1e3:.0f} | {max(tput[e]):.1f} |" for e in ENGINES),
        "",
        f"oneDNN vs at::linear: TTFT {min(ttft['aten']) / min(ttft['onednn']):.2f}x faster, throughput "
        f"{max(tput['onednn']) / max(tput['aten']):.2f}x.",
    ]
    print("\n".join(lines[-4:]))
    if not a.no_write:
        write_section(f"Float32 GEMM engine: MKL vs oneDNN ({name})", "\n".join(lines))


if __name__ == "__main__":
    main()
