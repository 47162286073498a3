"""int8's many-rows path (`KernelConfig.int8_gemm`): the integer GEMM (torch's _int_mm, oneDNN's int8 matmul,
activations rounded per token in two int8 levels) against fbgemm's float16 GEMM on float16 copies (the older
path), two engines on the same model stepped in alternation in one process:

  * the time to first token of a --prompt-len prompt (prefix caching off: every round prefills it all);
  * offline throughput: --requests random prompts of --input-len tokens, --output-len tokens each (EOS ignored),
    submitted together, output tok/s;
  * resident memory each engine's layers hold (the float16 copies are 2 bytes a weight).

    python -m benchmarks.kernels.int8_gemm [--model PATH] [--rounds 3] [--threads 2] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import random
import time

from benchmarks.common import write_section

PATHS = {"integer GEMM": True, "fbgemm float16": False}


def layer_bytes(model) -> int:
    from llmserve.model.formats.quant import QuantLinear

    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += sum(b.numel() * b.element_size() for b in m.buffers() if b is not None)
            if m._packed is not None:
                total += m.in_features * m.out_features * 2  # fbgemm's float16 copy
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()

    from llmserve import LLM, SamplingParams
    from llmserve.config import KernelConfig
    from llmserve.model.kernels import ops

    llms = {}
    for name, on in PATHS.items():
        k = KernelConfig(int8_gemm=on)
        llms[name] = (
            LLM(model=a.model, quantization="int8", num_threads=a.threads, enable_prefix_caching=False, kernels=k),
            k,
        )
    rng = random.Random(0)
    long_prompt = [rng.randrange(100, 40000) for _ in range(a.prompt_len)]
    batch = [[rng.randrange(100, 40000) for _ in range(a.input_len)] for _ in range(a.requests)]
    one = SamplingParams(max_tokens=1, temperature=0)
    many = SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True)
    ttft: dict[str, list[float]] = {p: [] for p in PATHS}
    tput: dict[str, list[float]] = {p: [] for p in PATHS}
    for llm, k in llms.values():
        ops.configure(k)
        llm.generate([long_prompt[:64]], one, use_tqdm=False)
    for _ in range(a.rounds):
        for name, (llm, k) in llms.items():
            ops.configure(k)
            t = time.perf_counter()
            llm.generate([long_prompt], one, use_tqdm=False)
            ttft[name].append(time.perf_counter() - t)
            t = time.perf_counter()
            out = llm.generate(batch, many, use_tqdm=False)
            tput[name].append(sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - t))
            print(name, f"TTFT {ttft[name][-1] * 1e3:.0f} ms, {tput[name][-1]:.1f} tok/s", flush=True)
    mem = {n: layer_bytes(llm.engine.runner.model) / 2**20 for n, (llm, _) in llms.items()}
    load = round(os.getloadavg()[0], 1)
    model = a.model or "bundled SmolLM2-135M"
    first, second = PATHS
    lines = [
        f"`python -m benchmarks.kernels.int8_gemm{' --model ' + a.model if a.model else ''}` on {model}, "
        "--quantization int8, "
        f"{a.threads} threads, {time.strftime('%Y-%m-%d %H:%M')}, load average {load} at the end. Best of {a.rounds} "
        f"alternated rounds: TTFT of a {a.prompt_len}-token prompt (prefix caching off), {a.requests} requests x "
        f"{a.input_len} / {a.output_len} tokens submitted together (output tok/s), the layers' memory:",
        "",
        "| int8 many-rows path | TTFT ms | output tok/s | quantized layers MiB |",
        "|---|---|---|---|",
        *(f"| {p} | {min(ttft[p]) * 1e3:.0f} | {max(tput[p]):.1f} | {mem[p]:.0f} |" for p in PATHS),
        "",
        f"{first} vs {second}: TTFT {min(ttft[second]) / min(ttft[first]):.2f}x faster, throughput "
        f"{max(tput[first]) / max(tput[second]):.2f}x.",
    ]
    print("\n".join(lines[-5:]))
    if not a.no_write:
        write_section(f"int8 many-rows path: integer GEMM vs fbgemm float16 ({model})", "\n".join(lines))


if __name__ == "__main__":
    main()
