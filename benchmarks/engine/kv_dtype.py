"""--kv-cache-dtype float16 against the default float32 KV cache, side by side in one run.

1. `llmserve serve --quantization int4 --kv-cache-memory 1`, 64 chat prompts x 128 tokens at 16
   concurrent (as `benchmarks.peers.compare bars`): throughput and resident memory after the load. The RSS that
   the load adds is the KV pool's pages written (the pool is mapped lazily), so float16 halves it.
   With `--llama-server PATH`, llama-server (Q4_1, f16 KV) in the same run for the RSS ratio.
2. Offline float32 model, single stream, decode speed at a long context (the attention reads the
   whole context every token): each KV type in turn, rounds alternated.

    python -m benchmarks.engine.kv_dtype [--llama-server PATH] [--context 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics

from benchmarks.common import chat_prompts, write_section
from benchmarks.peers.engines import llama_numbers, serve_numbers


def long_context_decode(context: int, rounds: int, new_tokens: int = 64) -> dict[str, list[float]]:
    from llmserve import LLM, SamplingParams

    engines = {
        d: LLM(kv_cache_memory=1.0, kv_cache_dtype=d, enable_prefix_caching=False) for d in ("float32", "float16")
    }
    tok = engines["float32"].get_tokenizer()
    text = " ".join(
        f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(400)
    )
    ids = tok.encode(text)[:context]
    speeds: dict[str, list[float]] = {d: [] for d in engines}
    for _ in range(rounds):
        for d, llm in engines.items():
            (out,) = llm.generate(
                [ids], SamplingParams(max_tokens=new_tokens + 1, temperature=0, ignore_eos=True), use_tqdm=False
            )
            m = out.metrics  # decode only: from the first token to the last
            speeds[d].append(new_tokens / (m.last_token_time - m.first_token_time))
    return speeds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", default=None, help="path of a llama-server binary (optional)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    prompts = chat_prompts(64)

    srv = {
        d: serve_numbers(["--quantization", "int4", "--kv-cache-dtype", d], args.threads, prompts, 128)
        for d in ("float32", "float16")
    }
    ll = llama_numbers(args.llama_server, args.threads, prompts, 128) if args.llama_server else None
    dec = long_context_decode(args.context, args.rounds)
    med = {d: statistics.median(v) for d, v in dec.items()}

    rows = [
        "| KV cache | server int4, 16 concurrent tok/s | server RSS after the load |"
        + (" vs llama-server |" if ll else ""),
        "|---|---|---|" + ("---|" if ll else ""),
    ]
    for d, r in srv.items():
        rows.append(
            f"| {d} | {r['c16']:.1f} | {r['rss_mib']:.0f} MiB |"
            + (f" {r['rss_mib'] / ll['rss_mib']:.2f}x |" if ll else "")
        )
    if ll:
        rows.append(f"| llama-server Q4_1 (f16 KV, 16 slots x 1k) | {ll['c16']:.1f} | {ll['rss_mib']:.0f} MiB | 1x |")
    body = "\n".join(
        [
            f"`python -m benchmarks.engine.kv_dtype{' --llama-server PATH' if ll else ''} --context {args.context} "
            f"--rounds {args.rounds}`: `llmserve serve --quantization int4 --kv-cache-memory 1`, 64 chat prompts x "
            "128 tokens at 16 concurrent, each KV type in turn; then the float32 model offline, single stream, "
            f"decode of 64 tokens after a {args.context}-token prompt, KV types alternated round by round.",
            "",
            *rows,
            "",
            f"- long-context decode, single stream (median of {args.rounds}): float32 KV {med['float32']:.1f} tok/s, "
            f"float16 KV {med['float16']:.1f} tok/s = {med['float16'] / med['float32']:.2f}x "
            f"(rounds: {', '.join(f'{a:.1f}/{b:.1f}' for a, b in zip(dec['float32'], dec['float16']))}).",
            f"- server RSS with float16 KV = {srv['float16']['rss_mib'] / srv['float32']['rss_mib']:.2f}x float32's "
            "(what the load adds is the pool's pages written: the same tokens in half the bytes).",
        ]
    )
    print(body)
    if not args.no_write:
        write_section("KV cache dtype (float16 vs float32)", body)


if __name__ == "__main__":
    main()
