"""Tensor parallelism: decode tokens/s at TP=1 and TP=2, same run, same prompts, greedy.

On this machine TP=2 means two processes (gloo all-reduces over loopback) with one thread each, so the
fair TP=1 baselines are one process with 1 thread and one with as many threads as TP=2 uses in all.
Decode rate = output tokens after each request's first / time after the last first token (the
prefill is excluded). Writes a section into BENCHMARKS.md.

    python -m benchmarks.engine.tensor_parallel [--batches 1 16] [--tokens 64] [--device cpu|cuda] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import time

from benchmarks.common import chat_prompts, write_section


def decode_rate(llm, prompts, tokens: int) -> float:
    from llmserve import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in prompts]
    first = {}
    while len(first) < len(ids):  # prefill, and the first token of each
        for out in eng.step():
            first.setdefault(out.request_id, len(out.outputs[0].token_ids))
    n0 = sum(first.values())
    t0 = time.perf_counter()
    done = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done += len(out.outputs[0].token_ids)
    return (done - n0) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    from llmserve import LLM

    cores = len(os.sched_getaffinity(0))
    setups = [
        ("TP=1, 1 thread", dict(tensor_parallel_size=1, num_threads=1)),
        (f"TP=1, {min(2, cores)} threads", dict(tensor_parallel_size=1, num_threads=min(2, cores))),
        ("TP=2, 1 thread per rank", dict(tensor_parallel_size=2, num_threads=1)),
    ]
    if a.device == "cuda":
        setups = [("TP=1", dict(tensor_parallel_size=1)), ("TP=2", dict(tensor_parallel_size=2))]
    rows, outputs = [], {}
    for name, kw in setups:
        llm = LLM(device=a.device, kv_cache_memory=0.5, **kw)
        tok = llm.get_tokenizer()
        prompts = [tok.encode_chat(m) for m in chat_prompts(max(a.batches))]
        decode_rate(llm, prompts[:2], 4)  # warm-up
        rates = [decode_rate(llm, prompts[:b], a.tokens) for b in a.batches]
        from llmserve import SamplingParams

        outs = llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        outputs[name] = [o.outputs[0].token_ids for o in outs]
        llm.engine.shutdown()
        rows.append((name, rates))
        print(name, ["%.1f" % r for r in rates], flush=True)
    same = len({repr(v) for v in outputs.values()}) == 1
    head = "| setup | " + " | ".join(f"decode tok/s, batch {b}" for b in a.batches) + " |"
    lines = [head, "|" + "---|" * (len(a.batches) + 1)]
    base = rows[0][1]
    for name, rates in rows:
        lines.append(f"| {name} | " + " | ".join(f"{r:.1f} ({r / b0:.2f}x)" for r, b0 in zip(rates, base)) + " |")
    body = (
        f"`python -m benchmarks.engine.tensor_parallel` on the bundled SmolLM2-135M-Instruct (fp32, {a.device}), "
        f"{a.tokens} output tokens per request after the first, greedy; ratios against the first row.\n\n"
        + "\n".join(lines)
        + f"\n\nGreedy outputs of all setups identical: {'yes' if same else 'NO'}.\n\n"
        "On a 2-core CPU tensor parallelism gains nothing: the two ranks split each matmul but add two "
        "gloo all-reduces per layer (60 per step for 30 layers) over loopback plus a pickled broadcast "
        "of the step, and one process with two threads already uses both cores. Tensor parallelism is "
        "for models that do not fit one device, or for GPUs joined by NVLink; on CUDA (NCCL) it was "
        "not measured here (no GPU in this session)."
    )
    print(body)
    if not a.no_write:
        write_section("Tensor parallelism (TP=1 vs TP=2)", body)


if __name__ == "__main__":
    main()
