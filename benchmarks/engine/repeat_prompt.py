"""A prompt sent again (a regenerated answer, a retried request, a fixed benchmark prompt): the repeat's TTFT
against the cold one, for a prompt of whole blocks and one with a partial last block. The cached prefix spares
every token but the last (copy on write of the block holding it); before that, a repeat computed up to a block.

    python -m benchmarks.engine.repeat_prompt [--model M] [--threads 2] [--lengths 1024,1000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks.common import machine, write_section


def ttft(engine, ids, params) -> tuple[float, int]:
    """(seconds to the first token, prompt tokens served from the cache)."""
    rid = engine.add_request(ids, params)
    while True:
        done = [o for o in engine.step() if o.request_id == rid and o.finished]
        if done:
            m = done[0].metrics
            return m.first_token_time - m.arrival_time, done[0].num_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="as serve takes it (default: the bundled model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", default="1024,1000")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    from llmserve import SamplingParams
    from llmserve.engine.engine import LLMEngine

    kw = {"model": a.model} if a.model else {}
    eng = LLMEngine(num_threads=a.threads, kv_cache_memory=1.0, **kw)
    # the first answer is 16 tokens (its last block, the prompt's tail and the answer's start, fills and is named:
    # what a repeat's tail is found in); each repeat answers 1
    first, params = (SamplingParams(max_tokens=k, temperature=0, ignore_eos=True) for k in (16, 1))
    rows = []
    for n, length in enumerate(int(x) for x in a.lengths.split(",")):
        ids = [1000 + (7919 * (i + 1000 * n)) % 20000 for i in range(length)]
        cold, _ = ttft(eng, ids, first)
        again = [ttft(eng, ids, params) for _ in range(a.repeats)]
        rep = statistics.median(t for t, _ in again)
        rows.append((length, again[-1][1], cold, rep))
        print(rows[-1], flush=True)
    table = "\n".join(
        f"| {n} | {n % eng.block_size or eng.block_size} | {c} | {n - c} | {cold * 1000:.0f} | {rep * 1000:.1f} | "
        f"{rep / cold:.3f}x |"
        for n, c, cold, rep in rows
    )
    body = (
        f"`python -m benchmarks.engine.repeat_prompt {' '.join(sys.argv[1:])}` on {machine()}: one request at a time,"
        f" the first answered with 16 tokens, each repeat with 1, its TTFT the median of {a.repeats}; block size "
        f"{eng.block_size}.\n\n"
        "| prompt tokens | in its last block | cached on repeat | computed on repeat | cold TTFT ms | repeat TTFT ms "
        "| repeat / cold |\n|---|---|---|---|---|---|---|\n" + table + "\n"
    )
    print(body)
    if not a.no_write:
        name = (a.model or "bundled").rstrip("/").rsplit("/", 1)[-1]
        write_section(f"A repeated prompt computes one token: {name}", body)


if __name__ == "__main__":
    main()
