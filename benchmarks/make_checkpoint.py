"""Random-weight checkpoints of real model shapes, for speed and memory benchmarks (never in CI).

A random-weight model of a real shape costs what the real one costs: same matmuls, same bytes, same KV
cache. Weights are written tensor by tensor (a safetensors header first, then each tensor generated,
written and dropped), so an 8B checkpoint never sits in memory whole. The tokenizer is the bundled
model's (49,152 tokens); benchmarks ignore EOS.

    python -m benchmarks.make_checkpoint --shape 1b --out ~/ckpt/llama-1b            # bfloat16 safetensors
    python -m benchmarks.make_checkpoint --shape 8b --out ~/ckpt/llama-8b --gguf Q4_K_M
        # + llama.cpp's convert_hf_to_gguf.py (f16) and llama-quantize: ~/ckpt/llama-8b/model-Q4_K_M.gguf

`--gguf` needs llama.cpp built (`../shared/peers/llama-cpp.sh build`) and `sentencepiece` importable.

The gpt-oss shapes are written straight as a GGUF file with the gguf package, no Hugging Face folder between (a
20b folder would need ~40 GB of disk): llama.cpp's `gpt-oss` names and metadata, laid out as its MXFP4_MOE files
are (experts MXFP4, every other matrix Q8_0, norms / biases / sinks / router float32), tensor by tensor:

    python -m benchmarks.make_checkpoint --shape gpt-oss-20b --out ~/ckpt/gpt-oss-20b   # model-MXFP4_MOE.gguf, 12 GB
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np

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
# gpt-oss's rotary, the same in both published models (their config.json's rope_theta and rope_scaling)
GPT_OSS_ROPE = dict(
    rope_theta=150000.0, factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0
)
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


def write_checkpoint(shape: str, out: str, seed: int = 0) -> str:
    import transformers

    c = SHAPES[shape]
    os.makedirs(out, exist_ok=True)
    tok = bundled_tokenizer_folder()
    for name in os.listdir(tok):
        if name.startswith(("tokenizer", "special_tokens")) or name == "chat_template.jinja":
            shutil.copy(os.path.join(tok, name), out)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
        rope_theta=500000.0,
        **c,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(out)
    target = os.path.join(out, "model.safetensors")
    if not os.path.exists(target):
        write_safetensors(target, tensor_shapes(c), seed)
    return out


# -- gpt-oss, written as a GGUF file ------------------------------------------------------------------------
def gpt_oss_tensors(c: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(llama.cpp's name, shape in rows-last order as NumPy holds it, type) of every tensor of a gpt-oss file of
    shape `c`, in the file's order: as llama-quantize's MXFP4_MOE leaves them."""
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    h, m, e, v = c["hidden_size"], c["intermediate_size"], c["num_local_experts"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    out = [("token_embd.weight", (v, h), "Q8_0")]
    for i in range(c["num_hidden_layers"]):
        n = functools.partial(_tensor_name, TENSOR_NAMES, i)
        out += [
            (n(MODEL_TENSOR.ATTN_NORM, "weight"), (h,), "F32"),
            (n(MODEL_TENSOR.ATTN_Q, "weight"), (q, h), "Q8_0"),
            (n(MODEL_TENSOR.ATTN_Q, "bias"), (q,), "F32"),
            (n(MODEL_TENSOR.ATTN_K, "weight"), (kv, h), "Q8_0"),
            (n(MODEL_TENSOR.ATTN_K, "bias"), (kv,), "F32"),
            (n(MODEL_TENSOR.ATTN_V, "weight"), (kv, h), "Q8_0"),
            (n(MODEL_TENSOR.ATTN_V, "bias"), (kv,), "F32"),
            (n(MODEL_TENSOR.ATTN_OUT, "weight"), (h, q), "Q8_0"),
            (n(MODEL_TENSOR.ATTN_OUT, "bias"), (h,), "F32"),
            (n(MODEL_TENSOR.ATTN_SINKS, "weight"), (c["num_attention_heads"],), "F32"),
            (n(MODEL_TENSOR.ATTN_POST_NORM, "weight"), (h,), "F32"),
            (n(MODEL_TENSOR.FFN_GATE_INP, "weight"), (e, h), "F32"),
            (n(MODEL_TENSOR.FFN_GATE_INP, "bias"), (e,), "F32"),
            (n(MODEL_TENSOR.FFN_GATE_EXP, "weight"), (e, m, h), "MXFP4"),
            (n(MODEL_TENSOR.FFN_GATE_EXP, "bias"), (e, m), "F32"),
            (n(MODEL_TENSOR.FFN_UP_EXP, "weight"), (e, m, h), "MXFP4"),
            (n(MODEL_TENSOR.FFN_UP_EXP, "bias"), (e, m), "F32"),
            (n(MODEL_TENSOR.FFN_DOWN_EXP, "weight"), (e, h, m), "MXFP4"),
            (n(MODEL_TENSOR.FFN_DOWN_EXP, "bias"), (e, h), "F32"),
        ]
    return out + [("output_norm.weight", (h,), "F32"), ("output.weight", (v, h), "Q8_0")]


def _tensor_name(names: dict, layer: int, tensor, kind: str) -> str:
    return f"{names[tensor].format(bid=layer)}.{kind}"


def _random_rows(name: str, shape: tuple[int, ...], qtype: str, rng: np.random.Generator) -> np.ndarray:
    """`shape`'s values as the file stores them (uint8 blocks for MXFP4 / Q8_0, rows of bytes), at a scale that keeps
    activations finite through every layer: weights of standard deviation ~0.02, norms 1, biases and sinks small.
    MXFP4: random E2M1 codes (doubled: rms ~5.9) under E8M0 exponents 119-120 (x 2^-9 or 2^-8); Q8_0: int8 codes
    (rms ~73) under one float16 scale."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if qtype == "F32":
        if name.endswith("norm.weight"):
            return np.ones(shape, np.float32)
        return (rng.standard_normal(shape, dtype=np.float32) * (1.0 if "sinks" in name else 0.02)).astype(np.float32)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    *rows, cols = shape
    blocks = np.empty((*rows, cols // block, size), np.uint8)
    if qtype == "MXFP4":
        blocks[..., 0] = rng.integers(119, 121, blocks.shape[:-1], dtype=np.uint8)
        blocks[..., 1:] = rng.integers(0, 256, (*blocks.shape[:-1], size - 1), dtype=np.uint8)
    else:  # Q8_0
        scales = np.full(blocks.shape[:-1], 0.02 / 73.3, np.float16)
        blocks[..., :2] = scales.view(np.uint8).reshape(*blocks.shape[:-1], 2)
        blocks[..., 2:] = rng.integers(-127, 128, (*blocks.shape[:-1], size - 2), dtype=np.int8).view(np.uint8)
    return blocks.reshape(*rows, -1)


def _padded_tokenizer(vocab: int) -> dict:
    """The bundled model's tokenizer fields ({key: (value, GGUF types)}) with its token list padded to `vocab` with
    unused [PAD<id>] tokens, as llama.cpp's converter pads a vocabulary shorter than the embedding."""
    from gguf import GGUFReader, TokenType

    from llmserve.model.loader import bundled_model_path

    fields = {k: (f.contents(), f.types) for k, f in GGUFReader(bundled_model_path()).fields.items()}
    fields = {k: v for k, v in fields.items() if k.startswith("tokenizer.")}
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    pad = range(len(tokens[0]), vocab)
    fields["tokenizer.ggml.tokens"] = (tokens[0] + [f"[PAD{i}]" for i in pad], tokens[1])
    fields["tokenizer.ggml.token_type"] = (types[0] + [int(TokenType.UNUSED)] * len(pad), types[1])
    return fields


def write_gpt_oss_gguf(shape: str, out: str, seed: int = 0) -> str:
    """A random gpt-oss GGUF file of `shape` (GPT_OSS_SHAPES) in `out`: model-MXFP4_MOE.gguf, each tensor generated,
    written and dropped (rows at a time: memory stays ~100 MB beyond the tokenizer)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType, RopeScalingType

    c = GPT_OSS_SHAPES[shape]
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "model-MXFP4_MOE.gguf")
    if os.path.exists(path):
        return path
    w = GGUFWriter(path + ".tmp", "gpt-oss")
    w.add_name(f"random {shape}")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_freq_base(GPT_OSS_ROPE["rope_theta"])
    w.add_rope_scaling_type(RopeScalingType.YARN)
    w.add_rope_scaling_factor(GPT_OSS_ROPE["factor"])
    w.add_rope_scaling_orig_ctx_len(GPT_OSS_ROPE["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(GPT_OSS_ROPE["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(GPT_OSS_ROPE["beta_slow"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(c["num_local_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(c["intermediate_size"])
    w.add_sliding_window(c["sliding_window"])
    w.add_vocab_size(c["vocab_size"])
    w.add_file_type(LlamaFileType.MOSTLY_MXFP4_MOE)
    for key, (value, types) in _padded_tokenizer(c["vocab_size"]).items():
        w.add_key_value(key, value, types[0], sub_type=types[-1] if types[0] == GGUFValueType.ARRAY else None)
    plan = gpt_oss_tensors(c)
    for name, dims, qtype in plan:
        if qtype == "F32":
            w.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
            stored = (*dims[:-1], dims[-1] // block * size)
            w.add_tensor_info(name, stored, np.dtype(np.uint8), int(np.prod(stored)), GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng, f = np.random.default_rng(seed), w.fout[0]
    for name, dims, qtype in plan:
        w.write_padding(f, f.tell())
        step = max(1, (1 << 24) // int(np.prod(dims[1:]) or 1))  # ~16M values a chunk
        written = 0
        for start in range(0, dims[0], step):
            chunk = _random_rows(name, (min(step, dims[0] - start), *dims[1:]), qtype, rng)
            chunk.tofile(f)
            written += chunk.nbytes
        w.write_padding(f, written)
    w.close()
    os.replace(path + ".tmp", path)
    return path


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
    ap.add_argument("--shape", choices=sorted([*SHAPES, *GPT_OSS_SHAPES]), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gguf", nargs="*", default=[], help="GGUF types to make, e.g. Q8_0 Q4_K_M")
    args = ap.parse_args()
    if args.shape in GPT_OSS_SHAPES:  # (a GGUF file already: MXFP4_MOE)
        if args.gguf:
            ap.error("--gguf: the gpt-oss shapes are written as an MXFP4_MOE GGUF file only")
        print(write_gpt_oss_gguf(args.shape, os.path.expanduser(args.out), args.seed))
        return
    folder = write_checkpoint(args.shape, os.path.expanduser(args.out), args.seed)
    print(folder)
    for q in args.gguf:
        print(to_gguf(folder, q))


if __name__ == "__main__":
    main()
