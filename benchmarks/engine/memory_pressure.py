"""Memory pressure: 128 concurrent 512-token requests into a KV pool that holds 16 of them.
All must finish; reports preemptions and peak resident memory against the stated budget + weights.

    python -m benchmarks.engine.memory_pressure [--threads 2] [--requests 128] [--no-write]
"""

from __future__ import annotations

import argparse
import random
import threading
import time

import psutil

from benchmarks.common import write_section


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--fit", type=int, default=16, help="requests the KV pool holds at once")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    from llmserve import SamplingParams
    from llmserve.engine.engine import LLMEngine

    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    per_req_blocks = -(-(args.prompt_tokens + args.output_tokens) // 16)
    eng = LLMEngine(
        num_threads=args.threads,
        num_kv_blocks=per_req_blocks * args.fit,
        max_num_seqs=args.requests,
        max_num_batched_tokens=512,
        enable_prefix_caching=True,
    )
    budget = eng.runner.kv_caches[0].numel() * eng.runner.kv_caches[0].element_size() * len(eng.runner.kv_caches)
    weights = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    rss_loaded = proc.memory_info().rss
    peak = [rss_loaded]
    stop = threading.Event()

    def sample_rss():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.05)

    threading.Thread(target=sample_rss, daemon=True).start()
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    for _ in range(args.requests):
        eng.add_request(
            [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)],
            SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True),
        )
    t = time.perf_counter()
    finished = 0
    while eng.has_unfinished_requests():
        finished += sum(1 for o in eng.step() if o.finished)
    dt = time.perf_counter() - t
    stop.set()
    mib = 1 << 20
    assert finished == args.requests and eng.kv.num_free_blocks == eng.num_blocks
    body = (
        f"`python -m benchmarks.engine.memory_pressure --threads {args.threads}`: {args.requests} requests of "
        f"{args.prompt_tokens} random prompt tokens + {args.output_tokens} output tokens submitted at once, "
        f"`max_num_seqs` {args.requests}, into a KV pool of {eng.num_blocks} blocks (holds {args.fit} such "
        f"requests).\n\n"
        f"| figure | value |\n|---|---|\n"
        f"| requests finished | {finished} / {args.requests} |\n"
        f"| preemptions | {eng.scheduler.num_preemptions} |\n"
        f"| wall time | {dt:.1f} s |\n"
        f"| KV budget (stated) | {budget / mib:.0f} MiB |\n"
        f"| weights | {weights / mib:.0f} MiB |\n"
        f"| RSS before load / after load / peak | {rss0 / mib:.0f} / {rss_loaded / mib:.0f} / "
        f"{peak[0] / mib:.0f} MiB |\n"
        f"| peak RSS - RSS before load | {(peak[0] - rss0) / mib:.0f} MiB (budget + weights = "
        f"{(budget + weights) / mib:.0f} MiB) |\n\n"
        f"All blocks were back in the pool at the end. (RSS includes the Python runtime, torch and the "
        f"tokenizer, measured from before the engine was built.)\n"
    )
    print(body)
    if not args.no_write:
        write_section("Memory pressure (issue: KV cache management)", body)


if __name__ == "__main__":
    main()
