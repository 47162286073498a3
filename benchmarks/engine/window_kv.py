"""Sliding-window layers that give their passed blocks back: the KV bytes one 8k-token sequence holds, with the
window layers' own pool (the default) and with every block kept (--disable-hybrid-kv-cache-manager, as before).

The model is a random Gemma 3 text checkpoint written by transformers with Gemma 3 1B's attention shape (26
layers, 1 full : 5 window layers, a 512-token window, 1 KV head of 256, float32 KV) and small other sizes (the
KV bytes do not depend on them; prefill stays cheap). One request of `--context` prompt tokens and 4 greedy
tokens runs alone; after every step the blocks held in each pool are counted, and the peak times each pool's
bytes per block is the sequence's KV memory. Memory, not time: the machine's load does not change it. Both
runs' greedy tokens must be the same; the prefill time of each (one sample) is printed too.

    python -m benchmarks.engine.window_kv [--context 8192] [--window 512] [--threads 2] [--no-write]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time

from benchmarks.common import write_section

MiB = 1 << 20


def write_checkpoint(folder: str, window: int, context: int) -> None:
    import torch
    import transformers

    from llmserve.model.loader import bundled_model_path
    from llmserve.tokenizer import Tokenizer

    layers = 26
    cfg = transformers.Gemma3TextConfig(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=window,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        max_position_embeddings=max(32768, context + 64),
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    Tokenizer(bundled_model_path(), gguf=True).hf.save_pretrained(folder)


def run(folder: str, context: int, threads: int, **kw) -> dict:
    import torch

    from llmserve import SamplingParams
    from llmserve.engine.engine import LLMEngine

    eng = LLMEngine(
        model=folder,
        num_threads=threads,
        kv_cache_memory=1.5,
        max_model_len=context + 16,
        max_num_batched_tokens=512,
        **kw,
    )
    mc, bs = eng.model.cfg, eng.block_size
    layer_block = eng.plan.bytes_per_block // mc.num_layers
    kv, group = eng.kv, eng.kv.window
    nw = sum(eng.plan.window_layers)
    nf = mc.num_layers - nw
    ids = torch.randint(3, 49152, (context,), generator=torch.Generator().manual_seed(1)).tolist()
    eng.add_request(ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    peak, tokens, t0, prefill = 0, [], time.perf_counter(), None
    while eng.has_unfinished_requests():
        for o in eng.step():
            tokens = list(o.outputs[0].token_ids)
            if prefill is None and tokens:
                prefill = time.perf_counter() - t0
        held = (kv.num_blocks - kv.num_free_blocks) * nf * layer_block
        if group is not None:
            held += (group.num_blocks - group.pool.num_free) * nw * layer_block
        peak = max(peak, held)
    # how many sequences of this length the same budget holds at once
    if group is None:
        fits = kv.num_blocks // -(-(context + 4) // bs)
        pools = f"{kv.num_blocks} blocks x {mc.num_layers} layers"
    else:
        fits = min(kv.num_blocks // -(-(context + 4) // bs), group.num_blocks // group.blocks_per_sequence(512))
        pools = f"{kv.num_blocks} x {nf} layers + {group.num_blocks} x {nw} layers"
    out = dict(peak=peak, tokens=tokens, prefill=prefill, fits=fits, pools=pools)
    out.update(window_layers=nw, layers=mc.num_layers)
    eng.shutdown()
    del eng
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="window-kv-bench-")
    try:
        write_checkpoint(folder, args.window, args.context)
        before = run(folder, args.context, args.threads, disable_hybrid_kv_cache_manager=True)
        print("every block kept", {k: v for k, v in before.items() if k != "tokens"}, flush=True)
        after = run(folder, args.context, args.threads)
        print("window pool", {k: v for k, v in after.items() if k != "tokens"}, flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert before["tokens"] == after["tokens"], "the window pool changed the greedy output"
    ratio = after["peak"] / before["peak"]
    rows = "".join(
        f"| {name} | {r['pools']} | {r['peak'] / MiB:.1f} MiB | {r['fits']} | {r['prefill']:.1f} s |\n"
        for name, r in (("every block kept (before)", before), ("window layers' own pool", after))
    )
    body = (
        f"`python -m benchmarks.engine.window_kv --context {args.context} --window {args.window}`: a random Gemma 3 "
        f"text checkpoint with Gemma 3 1B's attention shape ({after['layers']} layers, {after['window_layers']} of "
        f"them with a {args.window}-token window: 1 full : 5 window; 1 KV head of 256; float32 KV, blocks of 16), "
        f"one {args.context}-token prompt and 4 greedy tokens alone; KV memory is the peak of the blocks the "
        "sequence holds in each pool times their bytes (1.5 GiB budget, --max-num-batched-tokens 512). The prefill "
        "time is one sample each on a shared machine (other jobs ran: not a comparison of speed).\n\n"
        "| KV cache | pools (blocks x layers) | KV held by the sequence | such sequences in the budget | prefill |\n"
        "|---|---|---|---|---|\n"
        f"{rows}\n"
        f"KV memory of the {args.context}-token sequence **{ratio:.3f}x** what it was (target <= 0.35x); the same "
        "greedy tokens.\n"
    )
    print(body)
    if not args.no_write:
        write_section("Sliding-window layers give their blocks back (issue #37)", body)


if __name__ == "__main__":
    main()
