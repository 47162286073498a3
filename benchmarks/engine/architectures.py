"""Decode speed per architecture (issue #20): the same small shape in every architecture, random weights.

Shows what each architecture's features cost: Llama layers run through the fused C++ decode stack,
the others (q/k norms, Gemma's norms and soft-capping, sliding windows, experts) through the module path.
Every model: hidden 512, 8 layers, 8 query / 4 KV heads of 64, MLP 1536 (MoE: 8 experts of 384, top 2,
about the dense MLP's active compute; LFM2: 5 of the 8 layers gated short convolutions), the bundled 49,152-token
vocabulary, float32, untied head. Sliding windows of 64 on half the layers where the architecture has them (so
they act: 64-token prompts + 64 out).
Single stream: one 64-token prompt, 64 tokens (EOS ignored), tok/s = output tokens / wall time;
batch: 16 such prompts at once; transformers: `generate` one prompt alone, same tokens.

    python -m benchmarks.engine.architectures [--threads 2] [--no-write] [--only Llama LFM2]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from benchmarks.common import write_section

SHAPE = dict(
    vocab_size=49152,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
LFM2_LAYERS = ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "full_attention"]
SLIDING = dict(sliding_window=64, layer_types=["sliding_attention", "full_attention"] * 4)


def configs():
    import transformers as T

    moe = dict(num_experts_per_tok=2)
    return {
        "Llama": (T.LlamaConfig, {}),
        "Qwen3": (T.Qwen3Config, {}),
        "Phi-3": (T.Phi3Config, {}),
        "Gemma 2": (T.Gemma2Config, dict(query_pre_attn_scalar=64, **SLIDING)),
        "Gemma 3": (T.Gemma3TextConfig, dict(query_pre_attn_scalar=64, **SLIDING)),
        "Mixtral": (T.MixtralConfig, dict(num_local_experts=8, intermediate_size=384, **moe)),
        "Qwen3-MoE": (T.Qwen3MoeConfig, dict(num_experts=8, moe_intermediate_size=384, **moe)),
        # LFM2: 5 gated short-convolution layers (a state per sequence) and 3 attention layers, LFM2-350M's mix
        "LFM2": (T.Lfm2Config, dict(layer_types=LFM2_LAYERS, block_auto_adjust_ff_dim=False)),
    }


def seconds(fn, *args, **kwargs) -> float:
    t = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--only", nargs="*", help="these architectures only (names as in the table)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    from llmserve import LLM, SamplingParams
    from llmserve.model.loader import bundled_model_path
    from llmserve.tokenizer import Tokenizer

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (64,), generator=g).tolist() for _ in range(16)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    rows = []
    for name, (cls, extra) in configs().items():
        if args.only and name not in args.only:
            continue
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cls(**{**SHAPE, **extra})).eval()
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            Tokenizer(bundled_model_path(), gguf=True).hf.save_pretrained(d)
            llm = LLM(model=d, num_threads=args.threads, kv_cache_memory=0.5)
            llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
            fused = llm.engine.model._llama_layers
            single = 64 / seconds(llm.generate, prompts[:1], params, use_tqdm=False)
            batch = 64 * len(prompts) / seconds(llm.generate, prompts, params, use_tqdm=False)
            del llm
        with torch.inference_mode():
            ids = torch.tensor([prompts[0]])
            hf = 64 / seconds(
                model.generate, ids, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0
            )
        rows.append((name, "fused C++ stack" if fused else "module path", single, batch, hf))
        print(rows[-1], flush=True)
    body = [
        __doc__.split("\n\n")[1].strip(),
        "",
        f"`python -m benchmarks.engine.architectures --threads {args.threads}`",
        "",
        "| architecture | decode path | llmserve single stream tok/s | llmserve batch of 16 tok/s "
        "| transformers single stream tok/s |",
        "|---|---|---|---|---|",
    ]
    body += [f"| {n} | {p} | {s:.1f} | {b:.1f} | {h:.1f} |" for n, p, s, b, h in rows]
    text = "\n".join(body)
    print(text)
    if not args.no_write:
        write_section("Architectures: decode speed per architecture (issue #20)", text)


if __name__ == "__main__":
    main()
