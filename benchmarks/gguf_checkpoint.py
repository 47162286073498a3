"""Random-weight GGUF files written straight with the gguf package, no Hugging Face folder between (benchmarks only,
never in CI beyond the tiny shapes): llama.cpp's names and metadata, each tensor generated, written and dropped, rows
at a time (memory stays ~100 MB beyond the tokenizer), so a file of any size fits on a disk that holds it once.

- gpt-oss (`write_gpt_oss_gguf`): laid out as llama-quantize's MXFP4_MOE files are (experts MXFP4, every other matrix
  Q8_0, norms / biases / sinks / router float32); a 20b folder would need ~40 GB of disk.
- Qwen3-MoE (`write_qwen3_moe_gguf`): every matrix Q8_0 (experts as llama.cpp's 3-D `ffn_*_exps`), the router
  `ffn_gate_inp` and the norms (q / k norms included) float32, as the converter's `--outtype q8_0` leaves them; or
  straight as Q4_K_M (`quant="Q4_K_M"`): each tensor of the type llama-quantize's Q4_K_M gives it (`q4_k_m_type`),
  random Q4_K / Q6_K blocks. A Qwen3-30B-A3B-shaped file is 31 GB of Q8_0, and llama-quantize takes about an hour
  on 2 cores to make the 17 GB Q4_K_M from it; written straight, minutes.
- Llama (`write_llama_gguf`): every matrix Q8_0, norms float32, as llama.cpp's converter writes `--outtype q8_0`;
  llama-quantize `--allow-requantize` makes the other types from it (an 8B Q4_K_M without the 16 GB float16 file).

The shapes are make_checkpoint's (`SHAPES`, `GPT_OSS_SHAPES`); the tokenizer is the bundled model's, padded to the
shape's vocabulary."""

from __future__ import annotations

import functools
import os

import numpy as np

# gpt-oss's rotary, the same in both published models (their config.json's rope_theta and rope_scaling)
GPT_OSS_ROPE = dict(
    rope_theta=150000.0, factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0
)


def _tensor_name(names: dict, layer: int, tensor, kind: str) -> str:
    return f"{names[tensor].format(bid=layer)}.{kind}"


def _layer_names(c: dict) -> list:
    """Per layer of shape `c`: a function (gguf MODEL_TENSOR, "weight" / "bias") -> llama.cpp's tensor name."""
    from gguf import TENSOR_NAMES

    return [functools.partial(_tensor_name, TENSOR_NAMES, i) for i in range(c["num_hidden_layers"])]


def _sizes(c: dict) -> tuple[int, int]:
    return c["hidden_size"], c["intermediate_size"]


def _heads(c: dict) -> tuple[int, int]:
    """The q and the k / v projections' widths."""
    return c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]


def gpt_oss_tensors(c: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(llama.cpp's name, shape in rows-last order as NumPy holds it, type) of every tensor of a gpt-oss file of
    shape `c`, in the file's order: as llama-quantize's MXFP4_MOE leaves them."""
    from gguf import MODEL_TENSOR

    h, m, e, v, q, kv = *_sizes(c), c["num_local_experts"], c["vocab_size"], *_heads(c)
    out = [("token_embd.weight", (v, h), "Q8_0")]
    for n in _layer_names(c):
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


def llama_tensors(c: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """The same for a Llama file of shape `c` (make_checkpoint's SHAPES plus `vocab_size`), as llama.cpp's converter
    writes `--outtype q8_0`: matrices Q8_0, norms float32, `output` only when the embeddings are not tied."""
    from gguf import MODEL_TENSOR

    h, m, v, q, kv = *_sizes(c), c["vocab_size"], *_heads(c)
    out = [("token_embd.weight", (v, h), "Q8_0")]
    for n in _layer_names(c):
        out += [
            (n(MODEL_TENSOR.ATTN_NORM, "weight"), (h,), "F32"),
            (n(MODEL_TENSOR.ATTN_Q, "weight"), (q, h), "Q8_0"),
            (n(MODEL_TENSOR.ATTN_K, "weight"), (kv, h), "Q8_0"),
            (n(MODEL_TENSOR.ATTN_V, "weight"), (kv, h), "Q8_0"),
            (n(MODEL_TENSOR.ATTN_OUT, "weight"), (h, q), "Q8_0"),
            (n(MODEL_TENSOR.FFN_NORM, "weight"), (h,), "F32"),
            (n(MODEL_TENSOR.FFN_GATE, "weight"), (m, h), "Q8_0"),
            (n(MODEL_TENSOR.FFN_UP, "weight"), (m, h), "Q8_0"),
            (n(MODEL_TENSOR.FFN_DOWN, "weight"), (h, m), "Q8_0"),
        ]
    out.append(("output_norm.weight", (h,), "F32"))
    if not c["tie_word_embeddings"]:
        out.append(("output.weight", (v, h), "Q8_0"))
    return out


def qwen3_moe_tensors(c: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """The same for a Qwen3-MoE file of shape `c` (make_checkpoint's QWEN3_MOE_SHAPES): attention as Llama's plus
    the per-head q / k norms, every layer's MLP routed (`ffn_gate_inp`, then the experts' 3-D tensors)."""
    from gguf import MODEL_TENSOR

    h, v, q, kv = c["hidden_size"], c["vocab_size"], *_heads(c)
    e, m, d = c["num_experts"], c["moe_intermediate_size"], c["head_dim"]
    out = [("token_embd.weight", (v, h), "Q8_0")]
    for n in _layer_names(c):
        out += [
            (n(MODEL_TENSOR.ATTN_NORM, "weight"), (h,), "F32"),
            (n(MODEL_TENSOR.ATTN_Q, "weight"), (q, h), "Q8_0"),
            (n(MODEL_TENSOR.ATTN_Q_NORM, "weight"), (d,), "F32"),
            (n(MODEL_TENSOR.ATTN_K, "weight"), (kv, h), "Q8_0"),
            (n(MODEL_TENSOR.ATTN_K_NORM, "weight"), (d,), "F32"),
            (n(MODEL_TENSOR.ATTN_V, "weight"), (kv, h), "Q8_0"),
            (n(MODEL_TENSOR.ATTN_OUT, "weight"), (h, q), "Q8_0"),
            (n(MODEL_TENSOR.FFN_NORM, "weight"), (h,), "F32"),
            (n(MODEL_TENSOR.FFN_GATE_INP, "weight"), (e, h), "F32"),
            (n(MODEL_TENSOR.FFN_GATE_EXP, "weight"), (e, m, h), "Q8_0"),
            (n(MODEL_TENSOR.FFN_UP_EXP, "weight"), (e, m, h), "Q8_0"),
            (n(MODEL_TENSOR.FFN_DOWN_EXP, "weight"), (e, h, m), "Q8_0"),
        ]
    return out + [("output_norm.weight", (h,), "F32"), ("output.weight", (v, h), "Q8_0")]


def q4_k_m_type(name: str, n_layers: int) -> str:
    """The type llama-quantize's Q4_K_M gives a matrix of a Llama-like or Qwen3-MoE file (llama.cpp's
    llama_tensor_get_type, read off a 48-layer qwen3moe file it quantized): Q6_K for the output and for attn_v and
    ffn_down(_exps) in the layers it gives more bits (the first and last eighth, every third between), Q4_K else."""
    if name == "output.weight":
        return "Q6_K"
    if name.startswith("blk.") and (".attn_v." in name or ".ffn_down" in name):
        i = int(name.split(".")[1])
        if i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2:
            return "Q6_K"
    return "Q4_K"


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
    elif qtype in ("Q4_K", "Q6_K"):  # random quants and 6-bit (Q6_K: int8) scales under one float16 d (and dmin)
        blocks[...] = rng.integers(0, 256, blocks.shape, dtype=np.uint8)
        lead = blocks.shape[:-1]
        if qtype == "Q4_K":  # w = d sc q - dmin m, sc, m in 0..63, q in 0..15: std ~261 d, mean ~0 at dmin = 7.5 d
            d = np.full(lead, 0.02 / 261, np.float16)
            blocks[..., 0:2] = d.view(np.uint8).reshape(*lead, 2)
            blocks[..., 2:4] = (d * np.float16(7.5)).view(np.uint8).reshape(*lead, 2)
        else:  # w = d sc (q - 32), sc in -32..31, q in 0..63: std ~342 d
            blocks[..., 192:208] = rng.integers(-32, 32, (*lead, 16), dtype=np.int8).view(np.uint8)
            blocks[..., 208:210] = np.full(lead, 0.02 / 342, np.float16).view(np.uint8).reshape(*lead, 2)
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


def _common_header(w, name: str, c: dict) -> None:
    w.add_name(name)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(c["vocab_size"])


def _gpt_oss_header(w, c: dict) -> None:
    from gguf import LlamaFileType, RopeScalingType

    w.add_rope_freq_base(GPT_OSS_ROPE["rope_theta"])
    w.add_rope_scaling_type(RopeScalingType.YARN)
    w.add_rope_scaling_factor(GPT_OSS_ROPE["factor"])
    w.add_rope_scaling_orig_ctx_len(GPT_OSS_ROPE["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(GPT_OSS_ROPE["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(GPT_OSS_ROPE["beta_slow"])
    w.add_expert_count(c["num_local_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(c["intermediate_size"])
    w.add_sliding_window(c["sliding_window"])
    w.add_file_type(LlamaFileType.MOSTLY_MXFP4_MOE)


def _llama_header(w, c: dict) -> None:
    from gguf import LlamaFileType

    w.add_rope_freq_base(c["rope_theta"])
    w.add_rope_dimension_count(c["head_dim"])
    w.add_file_type(LlamaFileType.MOSTLY_Q8_0)


def _qwen3_moe_header(w, c: dict) -> None:
    from gguf import LlamaFileType

    w.add_rope_freq_base(c["rope_theta"])
    w.add_expert_count(c["num_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_file_type(LlamaFileType.MOSTLY_Q4_K_M if c.get("quant") == "Q4_K_M" else LlamaFileType.MOSTLY_Q8_0)


def _write(path: str, arch: str, name: str, c: dict, header, plan: list, seed: int) -> str:
    """Write `plan`'s tensors (random, `_random_rows`) under `arch`'s common and own (`header`) metadata and the
    padded bundled tokenizer; the file appears at `path` only once whole."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter

    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    w = GGUFWriter(path + ".tmp", arch)
    _common_header(w, name, c)
    header(w, c)
    for key, (value, types) in _padded_tokenizer(c["vocab_size"]).items():
        w.add_key_value(key, value, types[0], sub_type=types[-1] if types[0] == GGUFValueType.ARRAY else None)
    for tname, dims, qtype in plan:
        if qtype == "F32":
            w.add_tensor_info(tname, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
            stored = (*dims[:-1], dims[-1] // block * size)
            w.add_tensor_info(tname, stored, np.dtype(np.uint8), int(np.prod(stored)), GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng, f = np.random.default_rng(seed), w.fout[0]
    for tname, dims, qtype in plan:
        w.write_padding(f, f.tell())
        step = max(1, (1 << 24) // int(np.prod(dims[1:]) or 1))  # ~16M values a chunk
        written = 0
        for start in range(0, dims[0], step):
            chunk = _random_rows(tname, (min(step, dims[0] - start), *dims[1:]), qtype, rng)
            chunk.tofile(f)
            written += chunk.nbytes
        w.write_padding(f, written)
    w.close()
    os.replace(path + ".tmp", path)
    return path


def write_gpt_oss_gguf(c: dict, out: str, name: str = "gpt-oss", seed: int = 0) -> str:
    """A random gpt-oss GGUF file of shape `c` (make_checkpoint's GPT_OSS_SHAPES) in `out`: model-MXFP4_MOE.gguf."""
    path = os.path.join(out, "model-MXFP4_MOE.gguf")
    return _write(path, "gpt-oss", f"random {name}", c, _gpt_oss_header, gpt_oss_tensors(c), seed)


def write_llama_gguf(c: dict, out: str, name: str = "llama", seed: int = 0) -> str:
    """A random Llama GGUF file of shape `c` (make_checkpoint's SHAPES plus `vocab_size`, `rope_theta` and
    `max_position_embeddings`) in `out`: model-Q8_0.gguf."""
    path = os.path.join(out, "model-Q8_0.gguf")
    return _write(path, "llama", f"random {name}", c, _llama_header, llama_tensors(c), seed)


def write_qwen3_moe_gguf(c: dict, out: str, name: str = "qwen3-moe", seed: int = 0, quant: str = "Q8_0") -> str:
    """A random Qwen3-MoE GGUF file of shape `c` (make_checkpoint's QWEN3_MOE_SHAPES) in `out`: model-Q8_0.gguf, or
    model-Q4_K_M.gguf with `quant="Q4_K_M"` (its tensors typed as llama-quantize types them: `q4_k_m_type`)."""
    plan = qwen3_moe_tensors(c)
    if quant == "Q4_K_M":
        plan = [(n, dims, q4_k_m_type(n, c["num_hidden_layers"]) if q != "F32" else q) for n, dims, q in plan]
    elif quant != "Q8_0":
        raise ValueError(f"write_qwen3_moe_gguf: Q8_0 or Q4_K_M, not {quant}")
    path = os.path.join(out, f"model-{quant}.gguf")
    return _write(path, "qwen3moe", f"random {name}", {**c, "quant": quant}, _qwen3_moe_header, plan, seed)
