"""How many decode rows the fused C++ path should take (`llama.FUSED_DECODE_ROWS`, with the float32
GEMV's `ops.GEMV_ROWS`): decode tok/s of a batch of N requests with each limit, alternated round by round
in one process (the machine drifts ±25% minute to minute).

Each round queues N chat prompts (48 output tokens, EOS ignored), runs the prefill unmeasured, then times
the decode steps. Above the limit a step takes the module path: at::linear / fbgemm per projection.

    python benchmarks/decode_rows.py [--modes none int8 int4] [--requests 32 64] [--limits 16 32 64]
                                     [--rounds 4] [--threads 2] [--no-write]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import chat_prompts, write_section  # noqa: E402


def measure(mode: str, n: int, limits: list[int], rounds: int, threads: int) -> dict[int, list[float]]:
    from llmserve import LLM, SamplingParams
    from llmserve.model import llama, ops
    llm = LLM(num_threads=threads, quantization=None if mode == "none" else mode)
    eng = llm.engine
    ids = [llm.get_tokenizer().encode_chat(p) for p in chat_prompts(n)]
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    saved = llama.FUSED_DECODE_ROWS, ops.GEMV_ROWS

    def run(limit: int) -> float:
        llama.FUSED_DECODE_ROWS = ops.GEMV_ROWS = limit
        for i in ids:
            eng.add_request(i, sp)
        while eng.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                               for r in eng.scheduler.running):
            eng.step()
        t, k = time.perf_counter(), 0
        while eng.has_unfinished_requests():
            k += sum(len(o.outputs[0].delta_token_ids) for o in eng.step())
        return k / (time.perf_counter() - t)

    try:
        run(limits[0])   # warm-up
        res: dict[int, list[float]] = {lim: [] for lim in limits}
        for _ in range(rounds):
            for lim in limits:
                res[lim].append(run(lim))
    finally:
        llama.FUSED_DECODE_ROWS, ops.GEMV_ROWS = saved
    print(mode, n, {k: [round(v, 1) for v in vs] for k, vs in res.items()}, flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", nargs="+", default=["none", "int8", "int4"])
    ap.add_argument("--requests", nargs="+", type=int, default=[32, 64])
    ap.add_argument("--limits", nargs="+", type=int, default=[16, 32, 64])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    head = " | ".join(f"limit {lim}" for lim in args.limits)
    rows = [f"| mode | requests | {head} |", "|---|---|" + "---|" * len(args.limits)]
    for mode in args.modes:
        for n in args.requests:
            res = measure(mode, n, args.limits, args.rounds, args.threads)
            cells = " | ".join(f"{statistics.median(v):.1f} ({min(v):.0f}-{max(v):.0f})" for v in res.values())
            rows.append(f"| {mode} | {n} | {cells} |")
    body = (f"`python benchmarks/decode_rows.py --rounds {args.rounds} --threads {args.threads}`: decode tok/s "
            "(median, range) of N requests decoding together, 48 tokens each, each fused-path row limit in turn "
            "every round. Chosen: `llama.FUSED_DECODE_ROWS = ops.GEMV_ROWS = 64` (better or even in every row "
            "here).\n\n" + "\n".join(rows) + "\n")
    print(body)
    if not args.no_write:
        write_section("Decode rows through the fused path (issue: performance)", body)


if __name__ == "__main__":
    main()
