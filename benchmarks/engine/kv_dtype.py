"""--kv-cache-dtype float16 against the default float32 KV cache, side by side in one run (and int8 vs float16).

1. `llmserve serve --quantization int4 --kv-cache-memory 1`, 64 chat prompts x 128 tokens at 16
   concurrent (as `benchmarks.peers.compare bars`): throughput and resident memory after the load. The RSS that
   the load adds is the KV pool's pages written (the pool is mapped lazily), so float16 halves it.
   With `--llama-server PATH`, llama-server (Q4_1, f16 KV) in the same run for the RSS ratio.
2. Offline float32 model, single stream, decode speed at a long context (the attention reads the
   whole context every token): each KV type in turn, rounds alternated.

3. With `--int8`, only: `llmserve serve --quantization int8 --kv-cache-memory 1`, 64 chat prompts x 128
   tokens at 64 concurrent, float16 KV then int8 KV (one run each): throughput, RSS, and the pool's blocks.

    python -m benchmarks.engine.kv_dtype [--llama-server PATH] [--context 2000] [--rounds 3]
    python -m benchmarks.engine.kv_dtype --int8 [--concurrency 64] [--offline]

   `--offline`: the engine (LLM.generate, default weights), the prompts x 32 tokens, prefill included, instead.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

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


def int8_offline(concurrency: int) -> dict[str, float]:
    """The engine offline (default weights): `concurrency` chat prompts x 32 tokens (EOS ignored), prefill
    included, float16 then int8 KV, one run each: output tok/s per KV type."""
    import time

    from llmserve import LLM, SamplingParams

    engines = {d: LLM(kv_cache_memory=1.0, kv_cache_dtype=d) for d in ("float16", "int8")}
    tok = engines["int8"].get_tokenizer()
    ids = [tok.encode_chat(m) for m in chat_prompts(concurrency)]
    for e in engines.values():  # warm-up
        e.generate(ids[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    out = {}
    for d, e in engines.items():
        t = time.perf_counter()
        res = e.generate(ids, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
        out[d] = sum(len(o.outputs[0].token_ids) for o in res) / (time.perf_counter() - t)
        print(f"offline, {concurrency} prompts, {d} KV: {out[d]:.1f} tok/s", flush=True)
    return out


def int8_vs_float16(threads: int, concurrency: int, write: bool) -> None:
    """Part 3: the server at `concurrency` with float16 and int8 KV in turn; the section 'KV cache dtype (int8)'."""
    from llmserve.engine.kv_plan import bytes_per_block, config_kinds
    from llmserve.model.loader import load_model_config, resolve_model

    prompts = chat_prompts(64)
    srv = {
        d: serve_numbers(
            ["--quantization", "int8", "--kv-cache-dtype", d], threads, prompts, 128, concurrency=concurrency
        )
        for d in ("float16", "int8")
    }
    mc = load_model_config(resolve_model(None))[0]
    dtypes = {d: torch.int8 if d == "int8" else torch.float16 for d in srv}
    blocks = {d: (1 << 30) // bytes_per_block(config_kinds(mc, mc.num_kv_heads, dtypes[d]), 16) for d in srv}
    key = f"c{concurrency}"
    rows = [f"| KV cache | server int8, {concurrency} concurrent tok/s | RSS after the load | blocks in 1 GiB |"]
    rows.append("|---|---|---|---|")
    rows += [f"| {d} | {r[key]:.1f} | {r['rss_mib']:.0f} MiB | {blocks[d]} |" for d, r in srv.items()]
    body = "\n".join(
        [
            f"`python -m benchmarks.engine.kv_dtype --int8 --concurrency {concurrency}`: `llmserve serve "
            f"--quantization int8 --kv-cache-memory 1`, 64 chat prompts x 128 tokens at {concurrency} concurrent, "
            "float16 then int8 KV, one run each (the machine was shared with other jobs: the ratio, not the figures).",
            "",
            *rows,
            "",
            f"- int8 KV throughput = {srv['int8'][key] / srv['float16'][key]:.2f}x float16 KV's; the same GiB holds "
            f"{blocks['int8'] / blocks['float16']:.2f}x the blocks (each token's head row carries a 4-byte scale).",
        ]
    )
    print(body)
    if write:
        write_section("KV cache dtype (int8 vs float16)", body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", default=None, help="path of a llama-server binary (optional)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--int8", action="store_true", help="only int8 vs float16 KV at --concurrency")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--offline", action="store_true", help="with --int8: the engine offline instead of the server")
    args = ap.parse_args()
    if args.int8 and args.offline:
        return int8_offline(args.concurrency)
    if args.int8:
        return int8_vs_float16(args.threads, args.concurrency, not args.no_write)
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
