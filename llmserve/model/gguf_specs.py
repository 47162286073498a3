"""How each family's GGUF files map onto its transformers config and Hugging Face tensor names, as llama.cpp
writes and reads them: `GGUFSpec` (a registry.ArchSpec's `gguf`), the tensor-name tables the specs compose, and
the per-family hooks reading config fields from the file's metadata (`GGUFMetadata`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GGUFMetadata:
    """What a GGUFSpec's `config` reads from the file: `get(key, default)` is the `<arch>.<key>` metadata."""

    get: Callable
    tensor_names: frozenset
    path: str = ""
    tensor: Callable | None = None  # a small float tensor's values by its GGUF name (Phi-3's rope factors)


@dataclass(frozen=True)
class GGUFSpec:
    """How a family's GGUF files map onto its transformers config and Hugging Face tensor names."""

    arch: str  # general.architecture (and the metadata keys' prefix)
    config_class: str  # the transformers config class the metadata becomes
    layer_names: Mapping  # blk.N.<key>.weight -> model.layers.N.<value>.weight ("{e}": one per expert)
    names: Mapping = field(default_factory=lambda: dict(GGUF_MODEL_NAMES))  # whole-model tensors -> HF names
    permute_qk: bool = False  # llama.cpp's converter interleaved the rotary halves of Q and K rows
    head_dim_key: str | None = None  # metadata key (after "<arch>.") holding the head size, if any
    norm_offset: bool = False  # the converter stored the (1 + w) norms as 1 + w: read back as w (Gemma)
    experts: bool = False  # this family's files are `arch` files with `<arch>.expert_count` > 0 (Mixtral: llama)
    # (GGUFMetadata, the common config fields, rope theta) -> the config fields beyond the common ones
    config: Callable | None = None
    # (Hugging Face name, the file's float32 tensor) -> the tensor as the checkpoint holds it, where the converter
    # stored a value transformed (Granite 4.0-H's -exp(A_log), its per-group norm); None: every tensor as stored
    values: Callable | None = None


# -- GGUF tensor names (llama.cpp's) --------------------------------------------------------------
GGUF_MODEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LLAMA_LAYERS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# routed experts: the router, and each merged [n_expert, rows, cols] tensor split into one per expert
GGUF_MOE_LAYERS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
# Gemma's sandwich norms: llama.cpp's ffn_norm is the norm before the MLP, post_attention_norm the one after
# attention (Hugging Face's post_attention_layernorm), post_ffw_norm the one after the MLP
GGUF_GEMMA_LAYERS = {
    **GGUF_LLAMA_LAYERS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


# OLMo 2: no norms before attention or the MLP, the post-norms as Gemma's, q / k norms over the whole projection
GGUF_OLMO2_LAYERS = {
    **{k: v for k, v in GGUF_LLAMA_LAYERS.items() if k not in ("attn_norm", "ffn_norm")},
    **GGUF_QK_NORMS,
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# GLM-4 under Hugging Face's GLM names (its spec's checkpoint_renames make them Gemma's): ffn_norm is the norm before
# the MLP (GLM's post_attention_layernorm), ffn_up the packed gate + up
GGUF_GLM4_LAYERS = {
    **GGUF_LLAMA_LAYERS,
    "post_attention_norm": "post_self_attn_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
    "ffn_up": "mlp.gate_up_proj",
}


# gpt-oss: the norm before the MLP is llama.cpp's post_attention_norm; sinks; the router and the experts with biases
# (the converter splits Hugging Face's interleaved gate_up_proj into gate and up, or writes them fused, gate rows
# first: ffn_gate_up_exps)
GGUF_GPT_OSS_LAYERS = {
    **{k: v for k, v in GGUF_LLAMA_LAYERS.items() if not k.startswith("ffn_")},
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
    **GGUF_MOE_LAYERS,
    "ffn_gate_up_exps": "mlp.experts.{e}.gate_up_proj",
}


# LFM2 under the model's (Llama's) names, as Mixtral's experts: its blocks are adopted by those names; the final norm
# is token_embd_norm (Hugging Face's embedding_norm, applied after the last layer), the conv layers' tensors are
# shortconv.* (the convolution's weight [hidden, kernel]: the converter squeezes Hugging Face's [hidden, 1, kernel])
GGUF_LFM2_NAMES = {**GGUF_MODEL_NAMES, "token_embd_norm.weight": "model.norm.weight"}
GGUF_LFM2_LAYERS = {
    **GGUF_LLAMA_LAYERS,
    **GGUF_QK_NORMS,
    "shortconv.conv": "conv.conv",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj",
}


# Granite 4.0-H: attention layers as Llama's (their Q / K rows interleaved), Mamba-2 mixers as ssm_* (the converter
# squeezes the conv weight to [channels, kernel], stores dt_bias as ssm_dt.bias and A_log as ssm_a = -exp(A_log),
# A and D as [heads, 1], the gated norm as [groups, inner / groups]: `gguf_granite_hybrid_values` undoes them); the
# experts as Mixtral's, the shared MLP as *_shexp (ffn_gate / ffn_up / ffn_down when the model has no experts).
# Keys holding their suffix (or none, as ssm_a / ssm_d) name the whole tensor.
GGUF_GRANITE_HYBRID_LAYERS = {
    **GGUF_LLAMA_LAYERS,
    "ffn_gate": "shared_mlp.gate_proj",
    "ffn_up": "shared_mlp.up_proj",
    "ffn_down": "shared_mlp.down_proj",
    "ffn_gate_shexp": "shared_mlp.gate_proj",
    "ffn_up_shexp": "shared_mlp.up_proj",
    "ffn_down_shexp": "shared_mlp.down_proj",
    **GGUF_MOE_LAYERS,
    "ssm_in": "mamba.in_proj",
    "ssm_conv1d": "mamba.conv1d",
    "ssm_dt.bias": "mamba.dt_bias",
    "ssm_a": "mamba.A_log",
    "ssm_d": "mamba.D",
    "ssm_norm": "mamba.norm",
    "ssm_out": "mamba.out_proj",
}


def gguf_granite_hybrid_values(name: str, w):
    """A Granite 4.0-H tensor as the checkpoint holds it: A_log from the file's -exp(A_log), D and the mixer's
    norm weight flat (the conv weight's unit dimension the model's loader restores itself)."""
    import torch

    if name.endswith(".mamba.A_log"):
        return torch.log(-w.reshape(-1))
    if name.endswith((".mamba.D", ".mamba.norm.weight")):
        return w.reshape(-1)
    return w


# -- per-family config fields: from GGUF metadata, as llama.cpp reads it --------------------------------
def swa_layers(meta: GGUFMetadata, layers: int, every: int) -> list[str]:
    """Hugging Face's layer_types from `<arch>.attention.sliding_window_pattern` (a bool per layer, or n: every
    n-th layer is global) or llama.cpp's default n for the architecture."""
    pattern = meta.get("attention.sliding_window_pattern", every)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [pattern > 0 and (i + 1) % pattern != 0 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def gguf_gemma(meta: GGUFMetadata, kw: dict, big_layers: int, final_softcap: float | None) -> dict:
    # llama.cpp scales queries by head_dim ** -0.5, but for the 27B models by (hidden / heads) ** -0.5
    big = kw["num_hidden_layers"] == big_layers
    return dict(
        query_pre_attn_scalar=kw["hidden_size"] // kw["num_attention_heads"] if big else kw["head_dim"],
        final_logit_softcapping=meta.get("final_logit_softcapping", final_softcap),
        hidden_activation="gelu_pytorch_tanh",
    )


def gguf_gemma2(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    return dict(
        gguf_gemma(meta, kw, 46, 30.0),
        sliding_window=meta.get("attention.sliding_window", 4096),
        attn_logit_softcapping=meta.get("attn_logit_softcapping", 50.0),  # (llama.cpp's defaults)
        layer_types=swa_layers(meta, kw["num_hidden_layers"], 2),
    )


def gguf_gemma3(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    layers, window = kw["num_hidden_layers"], meta.get("attention.sliding_window")
    full = {"rope_type": "default", "rope_theta": theta}
    scaling_type = meta.get("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        full = {"rope_type": scaling_type, "factor": meta.get("rope.scaling.factor", 1.0), "rope_theta": theta}
    local = {"rope_type": "default", "rope_theta": meta.get("rope.freq_base_swa", 10000.0)}
    return dict(
        gguf_gemma(meta, kw, 62, None),
        sliding_window=window,
        layer_types=swa_layers(meta, layers, 6) if window else ["full_attention"] * layers,
        rope_parameters={"full_attention": full, "sliding_attention": local},
    )


def gguf_mrope(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    """Qwen2.5-VL / Qwen3-VL text files (qwen2vl / qwen3vl): the multimodal rotary sections the converter stores as
    `rope.dimension_sections` (t, h, w, padded with a 0) become Hugging Face's `mrope_section`."""
    sections = [int(s) for s in meta.get("rope.dimension_sections") or []]
    if len(sections) < 3 or any(sections[3:]) or sum(sections[:3]) != kw["head_dim"] // 2:
        raise ValueError(
            f"model: {meta.path}: rope.dimension_sections {sections} do not split the head's "
            f"{kw['head_dim'] // 2} rotary frequencies into t, h, w"
        )
    return dict(rope_parameters={"rope_type": "default", "rope_theta": theta, "mrope_section": sections[:3]})


def gguf_mrope_interleaved(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    """qwen3vl: gguf_mrope's sections, interleaved (frequencies t, h, w, t, h, w, ...)."""
    fields = gguf_mrope(meta, kw, theta)
    fields["rope_parameters"]["mrope_interleaved"] = True
    return fields


def gguf_phi3(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    extra = {"sliding_window": meta.get("attention.sliding_window") or None}  # (llama.cpp writes 0 for none)
    rot = meta.get("rope.dimension_count", kw["head_dim"])
    if rot != kw["head_dim"]:  # Phi-4-mini: partial rotary (q / k rows in layers.head_order, blocks too)
        extra["partial_rotary_factor"] = rot / kw["head_dim"]
    if "rope_factors_long.weight" in meta.tensor_names:  # longrope: the converter writes the factors as tensors
        extra["rope_scaling"] = {
            "rope_type": "longrope",
            "rope_theta": theta,
            "long_factor": meta.tensor("rope_factors_long.weight").tolist(),
            "short_factor": meta.tensor("rope_factors_short.weight").tolist(),
            "original_max_position_embeddings": meta.get("rope.scaling.original_context_length"),
        }
        extra["original_max_position_embeddings"] = meta.get("rope.scaling.original_context_length")
    return extra


def gguf_attention_bias(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    # attention_bias (Granite, OLMo 2): the converter writes the checkpoint's biases as blk.N.attn_*.bias, and no key
    return dict(attention_bias="blk.0.attn_q.bias" in meta.tensor_names)


def gguf_granite(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    # llama.cpp's defaults where the converter wrote none (it writes each only when set): 1 / sqrt(head_dim)
    return dict(
        gguf_attention_bias(meta, kw, theta),
        attention_multiplier=meta.get("attention.scale", kw["head_dim"] ** -0.5),
        embedding_multiplier=meta.get("embedding_scale", 1.0),
        residual_multiplier=meta.get("residual_scale", 1.0),
        logits_scaling=meta.get("logit_scale", 1.0),
    )


def gguf_smollm3(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    return dict(no_rope_layer_interval=4)  # (llama.cpp's, fixed: the converter writes none)


def gguf_glm4(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    return dict(partial_rotary_factor=meta.get("rope.dimension_count", kw["head_dim"] // 2) / kw["head_dim"])


def gguf_mixtral(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    return dict(
        num_experts_per_tok=meta.get("expert_used_count"),
        num_local_experts=meta.get("expert_count"),
        intermediate_size=meta.get("expert_feed_forward_length", kw["intermediate_size"]),
    )


def gguf_qwen3_moe(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    layers = kw["num_hidden_layers"]
    return dict(
        num_experts_per_tok=meta.get("expert_used_count"),
        num_experts=meta.get("expert_count"),
        moe_intermediate_size=meta.get("expert_feed_forward_length", kw["intermediate_size"]),
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in meta.tensor_names],
        # llama.cpp renormalises Qwen3-MoE's top-k weights unless the file says otherwise
        norm_topk_prob=bool(meta.get("expert_weights_norm", True)),
    )


def gguf_gpt_oss(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    # llama.cpp's gpt-oss: every other layer sliding (the first one), yarn rope (the converter writes its factor
    # and original context; beta_fast / beta_slow and truncate are gpt-oss's), the SwiGLU's alpha 1.702 and limit 7
    # (fixed: the file holds none)
    return dict(
        num_local_experts=meta.get("expert_count"),
        num_experts_per_tok=meta.get("expert_used_count"),
        intermediate_size=meta.get("expert_feed_forward_length", kw["intermediate_size"]),
        sliding_window=meta.get("attention.sliding_window"),
        layer_types=swa_layers(meta, kw["num_hidden_layers"], 2),
        attention_bias=True,
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": meta.get("rope.scaling.factor", 32.0),
            "original_max_position_embeddings": meta.get("rope.scaling.original_context_length", 4096),
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
    )


def gguf_lfm2(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    # llama.cpp's LFM2: attention.head_count_kv per layer, 0 for a conv layer; feed_forward_length the MLP's width
    # as adjusted already; shortconv.l_cache the convolution's width
    kv = kw["num_key_value_heads"]
    kv = list(kv) if isinstance(kv, (list, tuple)) else [kv] * kw["num_hidden_layers"]
    return dict(
        num_key_value_heads=max(kv),
        layer_types=["full_attention" if h else "conv" for h in kv],
        block_auto_adjust_ff_dim=False,
        conv_L_cache=meta.get("shortconv.l_cache", 3),
        norm_eps=kw["rms_norm_eps"],
    )


def gguf_granite_hybrid(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    # llama.cpp's Granite 4.0-H: attention.head_count_kv per layer, 0 for a Mamba-2 layer; ssm.inner_size the mixers'
    # width, ssm.time_step_rank their heads; rotary only where rope.scaling.finetuned is true (its default), which
    # the converter writes false for a model with mixers; the shared MLP's width expert_shared_feed_forward_length
    kv = kw["num_key_value_heads"]
    kv = list(kv) if isinstance(kv, (list, tuple)) else [kv] * kw["num_hidden_layers"]
    attn = next((i for i, h in enumerate(kv) if h), 0)
    mixer = next((i for i, h in enumerate(kv) if not h), 0)
    inner, heads = meta.get("ssm.inner_size"), meta.get("ssm.time_step_rank")
    experts = meta.get("expert_count", 0) or 0
    routed = dict(num_experts_per_tok=meta.get("expert_used_count")) if experts else {}  # (else the config's default)
    return dict(
        gguf_granite(meta, kw, theta),
        **routed,
        attention_bias=f"blk.{attn}.attn_q.bias" in meta.tensor_names,
        num_key_value_heads=max(kv) or kw["num_attention_heads"],
        layer_types=["attention" if h else "mamba" for h in kv],
        position_embedding_type="rope" if meta.get("rope.scaling.finetuned", True) else None,
        shared_intermediate_size=meta.get("expert_shared_feed_forward_length", kw["intermediate_size"]),
        num_local_experts=experts,
        mamba_n_heads=heads,
        mamba_d_head=inner // heads,
        mamba_n_groups=meta.get("ssm.group_count", 1),
        mamba_d_state=meta.get("ssm.state_size"),
        mamba_d_conv=meta.get("ssm.conv_kernel"),
        mamba_expand=inner // kw["hidden_size"],
        mamba_conv_bias=f"blk.{mixer}.ssm_conv1d.bias" in meta.tensor_names,
        mamba_proj_bias=f"blk.{mixer}.ssm_in.bias" in meta.tensor_names,
    )
