"""Offline throughput: llmserve LLM.generate vs transformers generate, same weights, same run.

64 chat prompts of varied length, 128 output tokens each (EOS ignored so both make the same count),
fp32, on the bundled SmolLM2-135M-Instruct. transformers runs one request at a time and in static
left-padded batches of 8/16/32. Writes the table into BENCHMARKS.md.

    python -m benchmarks.engine.offline_throughput [--threads 2] [--serial-requests 6] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.common import chat_prompts, write_section


def run_llmserve(prompts, max_tokens, threads, **engine_kwargs):
    from llmserve import LLM, SamplingParams

    llm = LLM(num_threads=threads, **engine_kwargs)
    ids = [llm.get_tokenizer().encode_chat(p) for p in prompts]
    llm.generate(ids[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    t = time.perf_counter()
    single = llm.generate(
        ids[:1], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False
    )
    dt1 = time.perf_counter() - t
    return llm, ids, n / dt, len(single[0].outputs[0].token_ids) / dt1


def run_transformers(model, tok_ids, max_tokens, batch, limit=None):
    pad = 2
    ids = tok_ids[:limit] if limit else tok_ids
    n_out, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(ids), batch):
            group = ids[i : i + batch]
            width = max(len(g) for g in group)
            x = torch.tensor([[pad] * (width - len(g)) + g for g in group])
            mask = torch.tensor([[0] * (width - len(g)) + [1] * len(g) for g in group])
            out = model.generate(
                x,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
            n_out += (out.shape[1] - width) * len(group)
    return n_out / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--serial-requests", type=int, default=6, help="transformers one-at-a-time requests timed")
    ap.add_argument("--batches", default="8,16,32")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = chat_prompts(args.num_prompts)

    llm, ids, ours, ours_single = run_llmserve(prompts, args.max_tokens, args.threads)
    print(f"llmserve LLM.generate: {ours:.1f} tok/s (64 requests), single request {ours_single:.1f} tok/s", flush=True)
    from transformers import AutoModelForCausalLM

    from llmserve.model.loader import bundled_model_path

    path = bundled_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32
    ).eval()
    rows = []
    serial = run_transformers(model, ids, args.max_tokens, 1, args.serial_requests)
    print(f"transformers one at a time: {serial:.1f} tok/s", flush=True)
    rows.append(("transformers, one at a time", serial))
    for b in [int(x) for x in args.batches.split(",")]:
        r = run_transformers(model, ids, args.max_tokens, b)
        print(f"transformers static batch {b}: {r:.1f} tok/s", flush=True)
        rows.append((f"transformers, static batch {b} (left padded)", r))
    best = max(r for _, r in rows[1:]) if len(rows) > 1 else serial
    table = [
        "| engine | output tok/s | llmserve ratio |",
        "|---|---|---|",
        f"| **llmserve `LLM.generate`, 64 requests** | **{ours:.1f}** | 1.0 |",
    ]
    table += [f"| {name} | {r:.1f} | {ours / r:.1f}x |" for name, r in rows]
    table += [
        f"| llmserve, one request alone | {ours_single:.1f} | vs transformers alone: {ours_single / serial:.1f}x |"
    ]
    body = (
        f"`python -m benchmarks.engine.offline_throughput --threads {args.threads}`: {args.num_prompts} chat prompts "
        f"of varied length, {args.max_tokens} output tokens each (EOS ignored), fp32, {args.threads} threads, "
        f"bundled SmolLM2-135M-Instruct; transformers one-at-a-time timed on {args.serial_requests} requests.\n\n"
        + "\n".join(table)
        + f"\n\nllmserve vs transformers one at a time: **{ours / serial:.1f}x** (bar: 15x); vs its best static "
        f"batch: **{ours / best:.1f}x** (bar: 2x); single request: **{ours_single / serial:.1f}x**.\n"
    )
    print(body)
    if not args.no_write:
        write_section("Offline throughput (issue: engine core)", body)


if __name__ == "__main__":
    main()
