"""What paged attention costs at long context: decode step time with 2k-token contexts vs short ones.

8 requests decode together, with prompts of ~100 and of ~2,000 tokens (a repeated text, prefix caching
off so every prompt is its own); the decode-only steps are timed from the engine's step loop, and the
time spent inside attention (`paged_attention`: the KV write, and either the in-place decode kernel or
the block gathers + SDPA) with a timer around it. Both attention paths run in the same process, one
after the other: llmserve's in-place kernel (llmserve/csrc/attention_decode.cpp) and gather + SDPA (the PyTorch
path, used where the kernels are not).

    python -m benchmarks.engine.long_context [--threads 2] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import ALICE, write_section

TEXT = ALICE


def decode_steps(llm, prompts, n_steps: int = 24) -> tuple[float, float, int]:
    """(median decode step seconds, share of it in attention, rows) for `prompts` decoding together."""
    import llmserve.model.layers.attention as attention
    from llmserve import SamplingParams

    eng = llm.engine
    spent = [0.0]
    inner = attention.paged_attention

    def timed(*a, **k):
        t0 = time.perf_counter()
        out = inner(*a, **k)
        spent[0] += time.perf_counter() - t0
        return out

    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=n_steps + 8, temperature=0, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()  # prefill
    rows = len(eng.scheduler.running)
    times = []
    for _ in range(n_steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    attention.paged_attention = timed
    try:
        t = time.perf_counter()
        for _ in range(4):
            eng.step()
        total = time.perf_counter() - t
    finally:
        attention.paged_attention = inner
    while eng.has_unfinished_requests():
        eng.step()
    return statistics.median(times), spent[0] / total, rows


def use_kernel(llm, on: bool) -> None:
    """Switch decode attention between the in-place kernel and gather + SDPA."""
    from llmserve.config import KernelConfig
    from llmserve.model.kernels import ops

    llm.engine.runner.in_place_decode = on and ops.cpu_kernels() is not None
    ops.configure(KernelConfig(in_place_decode=on))
    llm.engine.model._decode_stack = False  # the module path for both, so the timer sees attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    from llmserve import LLM

    llm = LLM(num_threads=args.threads, enable_prefix_caching=False, kv_cache_memory=1.0)
    tok = llm.get_tokenizer()
    with open(TEXT) as f:
        ids = tok.encode(f.read() * 4)
    rows = [
        "| context per request | requests | attention | decode step (median) | per token | share in attention |",
        "|---|---|---|---|---|---|",
    ]
    for length in (100, 500, 2000):
        prompts = [ids[i * 7 : i * 7 + length] for i in range(8)]
        for name, on in (("in-place kernel", True), ("gather + SDPA", False)):
            use_kernel(llm, on)
            step, share, n = decode_steps(llm, prompts)
            rows.append(f"| {length} | {n} | {name} | {step * 1000:.0f} ms | {step / 8 * 1000:.1f} ms | {share:.0%} |")
            print(rows[-1], flush=True)
    use_kernel(llm, True)
    llm.engine.model._decode_stack = None
    body = (
        f"`python -m benchmarks.engine.long_context --threads {args.threads}`: 8 requests decoding together, float32, "
        "prefix caching off; decode-only steps timed; attention share = time inside `paged_attention` (KV "
        "write + attention) over 4 steps. Both attention paths in one process.\n\n" + "\n".join(rows) + "\n"
    )
    print(body)
    if not args.no_write:
        write_section("Long context: paged attention at 2k tokens (issue: performance)", body)


if __name__ == "__main__":
    main()
