"""How many decode rows the fused C++ path should take (`KernelConfig.fused_decode_rows`, with the float32
GEMV's `gemv_rows`): decode tok/s of a batch of N requests with each limit, alternated round by round
in one process (the machine drifts ±25% minute to minute).

Each round queues N chat prompts (or random ones of --prompt-len tokens; 48 output tokens, EOS ignored),
runs the prefill unmeasured, then times the decode steps. Above the limit a step takes the module path:
at::linear / fbgemm per projection. `auto` is the default setting: the float32 GEMV/GEMM crossover
measured per weight shape (ops.gemm_rows).

    python -m benchmarks.engine.decode_rows [--modes none int8 int4] [--requests 32 64] [--limits 64 auto]
                                     [--model PATH] [--prompt-len 128] [--rounds 4] [--threads 2] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from benchmarks.common import chat_prompts, write_section


def kernels_for(limit: str):
    """`auto`: the defaults (fused stack to 64 rows, float32 GEMV/GEMM crossover measured per shape);
    a number N: fused stack and float32 GEMV both up to N rows (the fixed limit before the calibration)."""
    from llmserve.config import KernelConfig

    return KernelConfig() if limit == "auto" else KernelConfig(fused_decode_rows=int(limit), gemv_rows=int(limit))


def measure(
    mode: str,
    n: int,
    limits: list[str],
    rounds: int,
    threads: int,
    model: str | None = None,
    prompt_len: int = 0,
    max_tokens: int = 48,
) -> dict[str, list[float]]:
    import random

    from llmserve import LLM, SamplingParams
    from llmserve.model.kernels import cpu_ext, ops

    llm = LLM(model=model, num_threads=threads, quantization=None if mode == "none" else mode)
    eng = llm.engine
    if prompt_len:  # random token ids, as `vllm bench serve --dataset-name random`
        ids = [[random.Random(i).randrange(100, 40000) for _ in range(prompt_len)] for i in range(n)]
    else:
        ids = [llm.get_tokenizer().encode_chat(p) for p in chat_prompts(n)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    saved = ops.kernel_config()

    def run(limit: str) -> float:
        ops.configure(kernels_for(limit))
        eng.runner.model._decode_stack = None  # rebuilt with this setting's per-projection row limits
        for i in ids:
            eng.add_request(i, sp)
        while eng.scheduler.num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running
        ):
            eng.step()
        t, k = time.perf_counter(), 0
        while eng.has_unfinished_requests():
            k += sum(len(o.outputs[0].delta_token_ids) for o in eng.step())
        return k / (time.perf_counter() - t)

    try:
        run(limits[0])  # warm-up
        res: dict[str, list[float]] = {lim: [] for lim in limits}
        for _ in range(rounds):
            for lim in limits:
                res[lim].append(run(lim))
    finally:
        ops.configure(saved)
    print(
        mode,
        n,
        {k: [round(v, 1) for v in vs] for k, vs in res.items()},
        "crossovers",
        cpu_ext._CROSSOVERS,
        "load",
        os.getloadavg()[0],
        flush=True,
    )
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", nargs="+", default=["none", "int8", "int4"])
    ap.add_argument("--requests", nargs="+", type=int, default=[32, 64])
    ap.add_argument(
        "--limits",
        nargs="+",
        default=["64", "auto"],
        help="N: fused stack and float32 GEMV up to N rows; auto: the defaults (measured crossovers)",
    )
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--prompt-len", type=int, default=0, help="random prompts of this many tokens (default: chat)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    head = " | ".join(f"limit {lim}" for lim in args.limits)
    rows = [f"| mode | requests | {head} |", "|---|---|" + "---|" * len(args.limits)]
    for mode in args.modes:
        for n in args.requests:
            res = measure(mode, n, args.limits, args.rounds, args.threads, args.model, args.prompt_len, args.max_tokens)
            cells = " | ".join(f"{statistics.median(v):.1f} ({min(v):.0f}-{max(v):.0f})" for v in res.values())
            rows.append(f"| {mode} | {n} | {cells} |")
    cmd = " ".join(sys.argv[1:])
    body = (
        f"`python -m benchmarks.engine.decode_rows {cmd}` (load average {os.getloadavg()[0]:.1f} at the end): decode "
        f"tok/s (median, range) of N requests decoding together, {args.max_tokens} tokens each, each setting in "
        "turn every round. N: fused stack and float32 GEMV up to N rows; auto: the defaults (fused stack to "
        "64 rows, float32 GEMV/GEMM crossover measured per shape).\n\n" + "\n".join(rows) + "\n"
    )
    print(body)
    if not args.no_write:
        write_section("Decode rows through the fused path (issue: performance)", body)


if __name__ == "__main__":
    main()
