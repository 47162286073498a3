"""Random-weight checkpoints of real model shapes, for speed and memory benchmarks (never in CI).

A random-weight model of a real shape costs what the real one costs: same matmuls, same bytes, same KV
cache. Weights are written tensor by tensor (a safetensors header first, then each tensor generated,
written and dropped), so an 8B checkpoint never sits in memory whole. The tokenizer is the bundled
model's (49,152 tokens); benchmarks ignore EOS.

    python -m benchmarks.make_checkpoint --shape 1b --out ~/ckpt/llama-1b            # bfloat16 safetensors
    python -m benchmarks.make_checkpoint --shape 3b --out ~/ckpt/llama-3b --gguf Q4_K_M
        # + llama.cpp's convert_hf_to_gguf.py (f16) and llama-quantize: ~/ckpt/llama-3b/model-Q4_K_M.gguf
    python -m benchmarks.make_checkpoint --shape 8b --out ~/ckpt/llama-8b --gguf-only --gguf Q4_K_M
        # no safetensors (~5 GB of disk in the end, 13.5 GB at the peak): a Q8_0 GGUF written straight, requantized

`--gguf` needs llama.cpp built (`../shared/peers/llama-cpp.sh build`) and `sentencepiece` importable.

The gpt-oss shapes are written straight as a GGUF file (benchmarks/gguf_checkpoint.py), laid out as llama.cpp's
MXFP4_MOE files are:

    python -m benchmarks.make_checkpoint --shape gpt-oss-20b --out ~/ckpt/gpt-oss-20b   # model-MXFP4_MOE.gguf, 12 GB

The Qwen3-MoE shapes are GGUF only too (the MoE most CPU users run, Qwen3-30B-A3B's shape: 48 layers, 128 experts of
768, 8 a token): `--gguf Q4_K_M` alone writes the Q4_K_M file straight (17 GB, each tensor of the type llama-quantize
gives it, random Q4_K / Q6_K blocks); other types go through a Q8_0 file (31 GB) and llama-quantize:

    python -m benchmarks.make_checkpoint --shape qwen3-30b-a3b --out ~/ckpt/qwen3-30b-a3b --gguf Q4_K_M
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np

from benchmarks.gguf_checkpoint import write_gpt_oss_gguf, write_llama_gguf, write_qwen3_moe_gguf

SHAPES = {  # Llama-3.x shapes with the bundled 49,152-token vocabulary
    "tiny": dict(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "3b": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}
VOCAB = 49152
ROPE_THETA, MAX_POSITIONS = 500000.0, 8192  # Llama 3's rotary base; the configs' context
QWEN3_ROPE_THETA = 1000000.0
# gpt-oss: the published configs' shapes (gpt-oss-20b: hidden 2880, 24 layers alternating 128-token windows and full
# attention, 64 / 8 heads of 64, 32 experts top-4 of 2880, yarn x32 over 4096 positions); the tiny one for tests
GPT_OSS_SHAPES = {
    "gpt-oss-tiny": dict(
        vocab_size=VOCAB + 128,  # (padded: the 20b's is too)
        hidden_size=128,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        max_position_embeddings=4096,
    ),
    "gpt-oss-20b": dict(
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        max_position_embeddings=131072,
    ),
}

# Qwen3-MoE: Qwen3-30B-A3B's published config (hidden 2048, 48 layers, 32 / 4 heads of 128, 128 experts of 768,
# top-8 renormalised, rotary base 10^6), with the bundled vocabulary; the tiny one for tests
QWEN3_MOE_SHAPES = {
    "qwen3-moe-tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
    ),
    "qwen3-30b-a3b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
}


def tensor_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, m, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (VOCAB, h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "mlp.gate_proj.weight", (m, h)),
            (p + "mlp.up_proj.weight", (m, h)),
            (p + "mlp.down_proj.weight", (h, m)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not c["tie_word_embeddings"]:
        out.append(("lm_head.weight", (VOCAB, h)))
    return out


def random_bf16(shape: tuple[int, ...], rng: np.random.Generator, norm: bool) -> bytes:
    """bfloat16 bytes: ones for norms, N(0, 0.02) elsewhere (the upper halves of float32 values)."""
    if norm:
        x = np.ones(shape, dtype=np.float32)
    else:
        x = rng.standard_normal(shape, dtype=np.float32)
        x *= 0.02
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def write_safetensors(path: str, shapes: list[tuple[str, tuple[int, ...]]], seed: int) -> None:
    header, offset = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(seed)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in shapes:
            f.write(random_bf16(shape, rng, name.endswith("norm.weight")))
    os.replace(path + ".tmp", path)


def bundled_tokenizer_folder() -> str:
    from llmserve.model.loader import bundled_model_path, gguf_as_hf_folder

    return gguf_as_hf_folder(bundled_model_path())


def write_config(shape: str, out: str) -> None:
    """The tokenizer's files and config.json of `shape` in `out` (what clients and vLLM read)."""
    import transformers

    os.makedirs(out, exist_ok=True)
    tok = bundled_tokenizer_folder()
    for name in os.listdir(tok):
        if name.startswith(("tokenizer", "special_tokens")) or name == "chat_template.jinja":
            shutil.copy(os.path.join(tok, name), out)
    if shape in QWEN3_MOE_SHAPES:
        cfg = transformers.Qwen3MoeConfig(
            vocab_size=VOCAB, rope_theta=QWEN3_ROPE_THETA, norm_topk_prob=True, **QWEN3_MOE_SHAPES[shape]
        )
        cfg.architectures = ["Qwen3MoeForCausalLM"]
        cfg.save_pretrained(out)
        return
    c = SHAPES[shape]
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
        rope_theta=ROPE_THETA,
        **c,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(out)


def write_checkpoint(shape: str, out: str, seed: int = 0) -> str:
    write_config(shape, out)
    target = os.path.join(out, "model.safetensors")
    if not os.path.exists(target):
        write_safetensors(target, tensor_shapes(SHAPES[shape]), seed)
    return out


def write_gguf_only(shape: str, out: str, quants: list[str], seed: int = 0) -> list[str]:
    """`quants` of `shape` without the Hugging Face weights (an 8B's bfloat16 and float16 files would need 32 GB of
    disk): model-Q8_0.gguf written straight (gguf_checkpoint), llama-quantize --allow-requantize for the other
    types; the Q8_0 file is removed after unless asked for. The folder keeps the tokenizer and config.json."""
    write_config(shape, out)
    if shape in QWEN3_MOE_SHAPES:
        c = {**QWEN3_MOE_SHAPES[shape], "vocab_size": VOCAB, "rope_theta": QWEN3_ROPE_THETA}
        c["max_position_embeddings"] = 40960
        if quants == ["Q4_K_M"]:  # straight, typed as llama-quantize types it (an hour of llama-quantize saved)
            return [write_qwen3_moe_gguf(c, out, shape, seed, quant="Q4_K_M")]
        q8 = write_qwen3_moe_gguf(c, out, shape, seed)
    else:
        c = {**SHAPES[shape], "vocab_size": VOCAB, "rope_theta": ROPE_THETA, "max_position_embeddings": MAX_POSITIONS}
        q8 = write_llama_gguf(c, out, f"llama {shape}", seed)
    made = []
    for quant in quants:
        target = os.path.join(out, f"model-{quant}.gguf")
        if quant != "Q8_0" and not os.path.exists(target):
            tool = os.path.join(llama_cpp_dir(), "build", "bin", "llama-quantize")
            subprocess.run([tool, "--allow-requantize", q8, target, quant], check=True)
        made.append(target)
    if "Q8_0" not in quants:
        os.remove(q8)
    return made


def llama_cpp_dir() -> str:
    """llama.cpp's checkout: the shared peers script's where there is one (next to the main checkout), else
    ~/.cache/llmserve-peers/llama.cpp (git worktrees sit elsewhere, where the relative path finds nothing)."""
    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "..", "..", "shared", "peers", "llama-cpp.sh")
    if os.path.exists(script):
        return subprocess.run(["bash", script, "dir"], capture_output=True, text=True, check=True).stdout.strip()
    fallback = os.path.expanduser("~/.cache/llmserve-peers/llama.cpp")
    if not os.path.isdir(fallback):
        raise SystemExit(f"llama.cpp not found ({script} nor {fallback}); build it first")
    return fallback


def to_gguf(folder: str, quant: str) -> str:
    """llama.cpp's converter (to f16, or straight to q8_0) and llama-quantize for the other types."""
    src = llama_cpp_dir()
    target = os.path.join(folder, f"model-{quant}.gguf")
    if os.path.exists(target):
        return target
    direct = quant in ("F16", "Q8_0", "BF16")
    first = target if direct else os.path.join(folder, "model-F16.gguf")
    if not os.path.exists(first):
        env = {**os.environ, "PYTHONPATH": os.path.join(src, "gguf-py")}
        subprocess.run(
            [
                sys.executable,
                os.path.join(src, "convert_hf_to_gguf.py"),
                folder,
                "--outfile",
                first,
                "--outtype",
                quant.lower() if direct else "f16",
            ],
            check=True,
            env=env,
        )
    if not direct:
        subprocess.run([os.path.join(src, "build", "bin", "llama-quantize"), first, target, quant], check=True)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted([*SHAPES, *GPT_OSS_SHAPES, *QWEN3_MOE_SHAPES]), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gguf", nargs="*", default=[], help="GGUF types to make, e.g. Q8_0 Q4_K_M")
    ap.add_argument("--gguf-only", action="store_true", help="no safetensors: the --gguf types from a Q8_0 GGUF")
    args = ap.parse_args()
    if args.shape in GPT_OSS_SHAPES:  # (a GGUF file already: MXFP4_MOE)
        if args.gguf:
            ap.error("--gguf: the gpt-oss shapes are written as an MXFP4_MOE GGUF file only")
        print(write_gpt_oss_gguf(GPT_OSS_SHAPES[args.shape], os.path.expanduser(args.out), args.shape, args.seed))
        return
    if args.shape in QWEN3_MOE_SHAPES and not (args.gguf_only or args.gguf):
        ap.error("--gguf: the Qwen3-MoE shapes are written as GGUF files only (name the types)")
    if args.gguf_only or args.shape in QWEN3_MOE_SHAPES:
        if not args.gguf:
            ap.error("--gguf-only: name the --gguf types to make")
        print("\n".join(write_gguf_only(args.shape, os.path.expanduser(args.out), args.gguf, args.seed)))
        return
    folder = write_checkpoint(args.shape, os.path.expanduser(args.out), args.seed)
    print(folder)
    for q in args.gguf:
        print(to_gguf(folder, q))


if __name__ == "__main__":
    main()
