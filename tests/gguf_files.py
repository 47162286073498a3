"""Tiny GGUF files for tests, written with the gguf package's GGUFWriter: a random Llama of hidden size 256
(K-quant rows are 256 values) with the bundled model's tokenizer, each tensor in the type asked."""

from __future__ import annotations

import numpy as np

from llmserve.model.gguf_kernels import random_blocks

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2

# a Q4_K_M-like mix: K-quants, Q8_0 and Q5_0 side by side, q / k / v of different types in one layer
MIXED = {
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q8_0",
    "ffn_gate": "Q5_K",
    "ffn_up": "Q4_K",
    "ffn_down": "Q6_K",
    "token_embd": "Q8_0",
    "output": "Q6_K",
}
Q8 = {name: "Q8_0" for name in MIXED}


def _bundled_tokenizer_fields():
    from gguf import GGUFReader

    from llmserve.model.loader import bundled_model_path

    reader = GGUFReader(bundled_model_path())
    return {k: (f.contents(), f.types) for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def _weight(name: str, qtype: str, rows: int, cols: int, rng) -> np.ndarray:
    """uint8 blocks [rows, row_bytes] (or float32 [rows, cols]) of small random weights."""
    from gguf import GGMLQuantizationType, quants

    if qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):  # gguf quantizes these itself
        w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        return quants.quantize(w, GGMLQuantizationType[qtype])
    if qtype == "F32":
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    # K-quants (gguf cannot quantize them): random blocks with small scales
    return random_blocks(qtype, rows, cols, seed=int(rng.integers(1 << 30)), d_max=4e-4).numpy()


def write_tiny_gguf(
    path: str, types: dict[str, str] = MIXED, tied: bool = False, seed: int = 0, arch: str = "llama"
) -> str:
    import os

    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    rng = np.random.default_rng(seed)
    tok = _bundled_tokenizer_fields()
    vocab = len(tok["tokenizer.ggml.tokens"][0])
    w = GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    for key, (value, vtypes) in tok.items():
        sub = vtypes[1] if vtypes[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtypes[0], sub_type=sub)

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        qtype = types.get(kind, "F32")
        data = _weight(name, qtype, rows, cols, rng)
        w.add_tensor(name, data, raw_dtype=None if qtype == "F32" else GGMLQuantizationType[qtype])

    add("token_embd.weight", "token_embd", vocab, HIDDEN)
    if not tied:
        add("output.weight", "output", vocab, HIDDEN)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    kv = HIDDEN // HEADS * KV_HEADS
    for i in range(LAYERS):
        for n in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{n}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        for n, rows, cols in (
            ("attn_q", HIDDEN, HIDDEN),
            ("attn_k", kv, HIDDEN),
            ("attn_v", kv, HIDDEN),
            ("attn_output", HIDDEN, HIDDEN),
            ("ffn_gate", FFN, HIDDEN),
            ("ffn_up", FFN, HIDDEN),
            ("ffn_down", HIDDEN, FFN),
        ):
            add(f"blk.{i}.{n}.weight", n, rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
