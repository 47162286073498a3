"""Tiny GGUF files for tests, written with the gguf package's GGUFWriter: a random Llama of hidden size 256
(K-quant rows are 256 values) with the bundled model's tokenizer, each tensor in the type asked."""

from __future__ import annotations

import functools

import numpy as np

from llmserve.model.kernels.gguf_kernels import random_blocks

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2

# a Q4_K_M-like mix: K-quants, Q8_0 and Q4_0 side by side, q / k / v of different types in one layer (v: Q8_0, as
# llama.cpp's fallback for Q6_K where a row is no multiple of 256; ffn_up Q4_0 beside a Q5_K gate: packed parts
# on llmserve's int8 / int4 kernels inside GGUF projections)
MIXED = {
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q8_0",
    "attn_output": "Q8_0",
    "ffn_gate": "Q5_K",
    "ffn_up": "Q4_0",
    "ffn_down": "Q6_K",
    "token_embd": "Q8_0",
    "output": "Q6_K",
}
Q8 = {name: "Q8_0" for name in MIXED}
# the low-bit types of Q2_K / Q3_K_M / IQ4_XS files (llama.cpp's mixes put IQ4_NL where a row is no multiple of 256)
LOW = {
    "attn_q": "Q3_K",
    "attn_k": "Q2_K",
    "attn_v": "IQ4_NL",
    "attn_output": "IQ4_XS",
    "ffn_gate": "Q3_K",
    "ffn_up": "Q2_K",
    "ffn_down": "IQ4_XS",
    "token_embd": "Q3_K",
    "output": "IQ4_XS",
}


@functools.cache
def _bundled_tokenizer_fields():
    from gguf import GGUFReader

    from llmserve.model.loader import bundled_model_path

    reader = GGUFReader(bundled_model_path())
    return {k: (f.contents(), f.types) for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def small_tokenizer_fields(vocab: int) -> dict:
    """The bundled tokenizer cut to its first `vocab` tokens (the bytes, the special tokens and the first merges;
    merges whose parts or result fall outside are dropped): a valid BPE tokenizer whose file reads in a
    fraction of a second (the whole 49k one takes seconds to parse, per file opened)."""
    fields = dict(_bundled_tokenizer_fields())
    tokens = fields["tokenizer.ggml.tokens"][0][:vocab]
    kept = set(tokens)
    merges = [m for m in fields["tokenizer.ggml.merges"][0] if m.replace(" ", "") in kept and set(m.split(" ")) <= kept]
    fields["tokenizer.ggml.tokens"] = (tokens, fields["tokenizer.ggml.tokens"][1])
    fields["tokenizer.ggml.token_type"] = (
        fields["tokenizer.ggml.token_type"][0][:vocab],
        fields["tokenizer.ggml.token_type"][1],
    )
    fields["tokenizer.ggml.merges"] = (merges, fields["tokenizer.ggml.merges"][1])
    return fields


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
    path: str,
    types: dict[str, str] = MIXED,
    tied: bool = False,
    seed: int = 0,
    arch: str = "llama",
    file_type: int | None = None,
    sampling: dict | None = None,
) -> str:
    """`file_type`: general.file_type (llama.cpp's LlamaFileType: 15 Q4_K_M); `sampling`: general.sampling.* keys
    (temp, top_k, top_p, min_p, penalty_repeat, penalty_last_n), the maker's recommended sampling."""
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
    if file_type is not None:
        w.add_file_type(file_type)
    for key, value in (sampling or {}).items():
        add_value = w.add_int32 if key in ("top_k", "penalty_last_n") else w.add_float32
        add_value(f"general.sampling.{key}", value)
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


# -- a Hugging Face checkpoint written as llama.cpp's converter writes it ---------------------------------
# gguf's MODEL_ARCH per GGUF architecture (Mixtral is `llama` with experts)
_MODEL_ARCH = {
    "llama": "LLAMA",
    "phi3": "PHI3",
    "gemma2": "GEMMA2",
    "gemma3": "GEMMA3",
    "qwen3moe": "QWEN3MOE",
    "granite": "GRANITE",
    "smollm3": "SMOLLM3",
    "olmo2": "OLMO2",
    "glm4": "GLM4",
    "gpt-oss": "GPT_OSS",
    "lfm2": "LFM2",
    "granitehybrid": "GRANITE_HYBRID",
    "qwen2vl": "QWEN2VL",
    "qwen3vl": "QWEN3VL",
}
# the converter's LlamaModel lineage: Q / K rows (and biases) interleaved
_PERMUTED = ("llama", "granite", "smollm3", "granitehybrid")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's interleaving of the rotary halves of Q / K rows (llama files)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(w, arch: str, cfg: dict) -> None:
    """The hyperparameters llama.cpp's converter writes for `arch` (a subset: what llama.cpp reads)."""
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    ff = cfg["intermediate_size"]
    if arch == "lfm2":  # the converter's: KV heads per layer (0 for a conv layer), the MLP's width as LFM2 adjusts it
        kv = [0 if t == "conv" else kv for t in cfg["layer_types"]]
        if cfg["block_auto_adjust_ff_dim"]:
            ff = int(cfg["block_ffn_dim_multiplier"] * int(2 * ff / 3))
            ff = -(-ff // cfg["block_multiple_of"]) * cfg["block_multiple_of"]
        w.add_shortconv_l_cache(cfg["conv_L_cache"])
    if arch == "granitehybrid":  # the converter's: KV heads per layer (0 for a mixer), the mixers' ssm.* keys
        kv = [kv if t in ("attention", "full_attention") else 0 for t in cfg["layer_types"]]  # (transformers' too)
        inner = cfg["mamba_expand"] * cfg["hidden_size"]
        w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
        w.add_ssm_state_size(cfg["mamba_d_state"])
        w.add_ssm_group_count(cfg["mamba_n_groups"])
        w.add_ssm_inner_size(inner)
        w.add_ssm_time_step_rank(cfg["mamba_n_heads"])
        w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
        w.add_rope_scaling_finetuned(False)  # (rotary only without mixers, which llama.cpp reads from this key)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps") or cfg["norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    full = rope.get("full_attention", rope)
    w.add_rope_freq_base(full.get("rope_theta", 10000.0))
    if full.get("rope_type", "default") == "linear":
        from gguf import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    rotary = int(head_dim * (cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0))
    if arch in ("gemma2", "gemma3", "qwen3moe", "olmo2", "glm4", "qwen3vl"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "glm4":
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.5)))
    elif arch not in ("gemma2", "gemma3", "qwen3moe", "olmo2"):
        w.add_rope_dimension_count(rotary)
    if arch in ("granite", "granitehybrid"):  # (the converter writes each multiplier only when set)
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch in ("gemma2", "gemma3", "phi3") and cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma3" and cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "gpt-oss":
        from gguf import RopeScalingType

        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(cfg["sliding_window"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings", 4096))


def round_trip_model(model, qtype: str) -> None:
    """A transformers model's weights replaced in place by the values write_checkpoint_gguf's `qtype` file holds
    (gguf's own quantize / dequantize; norms and routers stay as they are): the reference for a file
    transformers cannot load itself."""
    import torch
    from gguf import GGMLQuantizationType, quants

    gpt_oss = model.config.model_type == "gpt_oss"
    with torch.no_grad():
        for name, p in model.named_parameters():
            router = name.endswith((".gate.weight", ".router.weight"))
            # gpt-oss's fused experts are x @ W (the file's rows along dim 1); Qwen3-MoE's in memory are [E, out, in]
            fused = gpt_oss and name.endswith(("experts.gate_up_proj", "experts.down_proj"))
            w = np.ascontiguousarray(p.numpy().swapaxes(-1, -2) if fused else p.numpy())
            if qtype != "F32" and not router and not name.endswith("bias") and _quantizable(name, w):
                t = GGMLQuantizationType[_tensor_type(name, qtype)]
                w = quants.dequantize(quants.quantize(w, t), t)
                p.copy_(torch.from_numpy(np.ascontiguousarray(w.swapaxes(-1, -2) if fused else w)))


def _tensor_type(name: str, qtype: str) -> str:
    """A weight matrix's type in a `qtype` file: MXFP4 files (llama.cpp's MXFP4_MOE, gpt-oss) hold the experts in
    MXFP4 and every other matrix in Q8_0."""
    return "Q8_0" if qtype == "MXFP4" and "_exps" not in name and ".experts." not in name else qtype


def _quantizable(gguf_name: str, w: np.ndarray) -> bool:
    # norms (Granite 4.0-H's per-group [groups, inner / groups] one too), biases and the MoE router stay float32, as
    # llama-quantize keeps them
    return (
        w.ndim >= 2
        and w.shape[-1] % 32 == 0
        and "ffn_gate_inp" not in gguf_name
        and "_norm." not in gguf_name
        and not gguf_name.endswith("bias")
    )


def _granite_hybrid_tensor(name: str, t: np.ndarray, cfg: dict, tensors: dict, names):
    """A Granite 4.0-H checkpoint tensor as the converter's GraniteHybridModel writes it: (a name for the generic
    path, the values), or (None, _) once written into `tensors` itself (stacked experts and the shared MLP's
    gate + up split in halves). The mixers' conv weight squeezed, A_log as -exp(A_log), A and D as [heads, 1], the
    gated norm per group, dt_bias under dt_proj's name."""
    layer = name.split(".")[2] if name.startswith("model.layers.") else None
    experts = bool(cfg.get("num_local_experts"))

    def put(tensor: str, x: np.ndarray) -> tuple[None, None]:
        tensors[f"blk.{layer}.{tensor}.weight"] = np.ascontiguousarray(x)
        return None, None

    if name.endswith(("block_sparse_moe.input_linear.weight", "block_sparse_moe.experts.gate_up_proj")):
        gate, up = np.split(t, 2, axis=1)  # [E, 2I, hidden]: gate rows then up rows
        put("ffn_gate_exps", gate)
        return put("ffn_up_exps", up)
    if name.endswith(("block_sparse_moe.output_linear.weight", "block_sparse_moe.experts.down_proj")):
        return put("ffn_down_exps", t)
    if name.endswith("block_sparse_moe.router.weight"):  # (transformers' name for router.layer)
        return put("ffn_gate_inp", t)
    if name.endswith("shared_mlp.input_linear.weight"):
        gate, up = np.split(t, 2, axis=0)
        put("ffn_gate_shexp" if experts else "ffn_gate", gate)
        return put("ffn_up_shexp" if experts else "ffn_up", up)
    if name.endswith("shared_mlp.output_linear.weight") and not experts:
        return put("ffn_down", t)
    if name.endswith(".mamba.conv1d.weight"):
        return name, t.squeeze(1)
    if name.endswith(".mamba.A_log"):
        return name, -np.exp(t).reshape(-1, 1)
    if name.endswith(".mamba.D"):
        return name, t.reshape(-1, 1)
    if name.endswith(".mamba.norm.weight"):
        return name, t.reshape(cfg["mamba_n_groups"], -1)
    if name.endswith(".mamba.dt_bias"):
        return name.removesuffix(".dt_bias") + ".dt_proj.bias", t
    return name, t


def write_checkpoint_gguf(folder, path: str, arch: str, qtype: str = "F32") -> str:
    """The Hugging Face checkpoint in `folder` (config.json, model.safetensors) as a GGUF file of `arch` the way
    llama.cpp's converter writes one, independently of llmserve's own mapping: names through gguf's
    TensorNameMap, llama Q / K rows interleaved, Gemma's norms stored as 1 + w, per-expert tensors merged into
    [n_expert, rows, cols] ffn_*_exps; weight matrices in `qtype` (F32 or a type gguf quantizes: Q8_0, ...),
    norms and routers float32; the bundled model's tokenizer cut to the checkpoint's vocabulary."""
    import json
    import os

    from safetensors.numpy import load_file

    cfg = json.load(open(os.path.join(folder, "config.json")))
    weights = load_file(os.path.join(folder, "model.safetensors"))
    return write_gguf(path, arch, cfg, weights, small_tokenizer_fields(cfg["vocab_size"]), qtype)


def write_gguf(path: str, arch: str, cfg: dict, weights: dict, tokenizer: dict, qtype: str = "F32", extra=None) -> str:
    """write_checkpoint_gguf's file of a config (a transformers config as a dict), Hugging Face weights (numpy, by
    name) and tokenizer fields (as small_tokenizer_fields gives them); `extra(writer)` adds more metadata."""
    from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFValueType, GGUFWriter, get_tensor_name_map, quants

    w = GGUFWriter(path, arch)
    _metadata(w, arch, cfg)
    if extra is not None:
        extra(w)
    for key, (value, vtypes) in tokenizer.items():
        w.add_key_value(key, value, vtypes[0], sub_type=vtypes[1] if vtypes[0] == GGUFValueType.ARRAY else None)
    names = get_tensor_name_map(MODEL_ARCH[_MODEL_ARCH[arch]], cfg["num_hidden_layers"])
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    tensors: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, t in weights.items():
        t = t.astype(np.float32)
        if arch in _PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            t = _permute(t, heads if "q_proj" in name else kv)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1
        parts = name.split(".")
        if arch == "gpt-oss" and ".experts." in name:  # fused [E, in, out] (x @ W), gate / up columns interleaved
            bias = name.endswith("_bias")
            t = t if bias else t.swapaxes(-1, -2)  # [E, out, in]
            proj = parts[-1].removesuffix("_bias")
            split = {"gate_proj": t[:, ::2], "up_proj": t[:, 1::2]} if proj == "gate_up_proj" else {proj: t}
            for part, x in split.items():
                merged = names.get_name(".".join(parts[:4] + ["experts", part]))
                tensors[f"{merged}.{'bias' if bias else 'weight'}"] = np.ascontiguousarray(x)
            continue
        if arch == "granitehybrid":
            name, t = _granite_hybrid_tensor(name, t, cfg, tensors, names)
            if name is None:
                continue
            parts = name.split(".")
        if arch == "lfm2" and ".conv.conv." in name:  # (the converter squeezes the conv weight to [hidden, kernel])
            t = t.squeeze(1)
        if name.endswith(".sinks"):  # (the converter's name for gpt-oss's sinks has a .weight)
            name, parts = name + ".weight", parts + ["weight"]
        if ".experts." in name:  # model.layers.N.(mlp|block_sparse_moe).experts.E.<proj>.weight
            e = parts.index("experts")
            merged = names.get_name(".".join(parts[:e] + ["experts", parts[e + 2]]))
            experts.setdefault(merged + ".weight", {})[int(parts[e + 1])] = t
            continue
        stem, _, kind = name.rpartition(".")  # (weight or bias)
        if arch == "granitehybrid" and name.endswith((".A_log", ".D")):  # (the converter's names: no suffix)
            tensors[names.get_name(name)] = t
            continue
        tensors[f"{names.get_name(stem)}.{kind}"] = t
    rope = cfg.get("rope_parameters") or {}
    if arch == "phi3" and rope.get("rope_type") == "longrope":  # the factors as tensors, as the converter writes them
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], np.float32)
    for merged, per_expert in experts.items():
        tensors[merged] = np.stack([per_expert[i] for i in range(len(per_expert))])
    for name, t in tensors.items():
        if qtype != "F32" and _quantizable(name, t):
            q = GGMLQuantizationType[_tensor_type(name, qtype)]
            w.add_tensor(name, quants.quantize(t, q), raw_dtype=q)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
