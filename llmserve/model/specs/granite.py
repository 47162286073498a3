"""IBM Granite: Granite 3.x (Llama layers with multipliers, the residual one folded into the weights) and Granite
4.0-H (Mamba-2 mixers among attention layers, routed experts beside a shared MLP: families/granite_hybrid.py);
their transformers config fields, GGUF names and hooks, and checkpoint renames."""

from __future__ import annotations

import torch

from llmserve.model.config import MambaConfig
from llmserve.model.families.granite_hybrid import GraniteHybridModel
from llmserve.model.families.granite_hybrid import checkpoint_tensors as granite_hybrid_tensors
from llmserve.model.specs.spec import (
    GGUF_LLAMA_LAYERS,
    GGUF_MOE_LAYERS,
    NO_STACK,
    ArchSpec,
    GGUFMetadata,
    GGUFSpec,
    gguf_attention_bias,
    o_proj_bias_fields,
)


def granite_fields(hf) -> dict:
    return dict(
        o_proj_bias_fields(hf),
        embed_scale=float(hf.embedding_multiplier),
        attn_scale=float(hf.attention_multiplier),
        residual_multiplier=float(hf.residual_multiplier),  # (folded into o_proj and down_proj at load)
        logits_scaling=float(hf.logits_scaling),
    )


def gguf_granite(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    # llama.cpp's defaults where the converter wrote none (it writes each only when set): 1 / sqrt(head_dim)
    return dict(
        gguf_attention_bias(meta, kw, theta),
        attention_multiplier=meta.get("attention.scale", kw["head_dim"] ** -0.5),
        embedding_multiplier=meta.get("embedding_scale", 1.0),
        residual_multiplier=meta.get("residual_scale", 1.0),
        logits_scaling=meta.get("logit_scale", 1.0),
    )


def hybrid_fields(hf) -> dict:
    """The ModelConfig fields of a transformers GraniteMoeHybridConfig beyond Granite's multipliers: Mamba-2 mixers
    where `layer_types` says (transformers' name for them, or the checkpoints' own "mamba"), experts of
    `intermediate_size` beside a shared MLP (ModelConfig's intermediate_size: shared_intermediate_size), rotary only
    with position_embedding_type "rope"."""
    if hf.hidden_act not in ("silu", "swish"):  # (the mixers' convolution takes the same activation)
        raise ValueError(f"model: Granite 4.0-H with hidden_act {hf.hidden_act!r} is not supported (silu only)")
    types = hf.layer_types or ["mamba"] * hf.num_hidden_layers
    mamba = tuple(t in ("linear_attention", "mamba") for t in types)
    experts = int(hf.num_local_experts or 0)
    dt_min, dt_max = hf.time_step_limit or (0.0, float("inf"))
    return dict(
        intermediate_size=hf.shared_intermediate_size,
        num_experts=experts,
        num_experts_per_tok=hf.num_experts_per_tok if experts else 0,
        moe_intermediate_size=hf.intermediate_size,
        moe_layers=(experts > 0,) * hf.num_hidden_layers,
        router_topk_softmax=True,
        nope_layers=() if hf.position_embedding_type == "rope" else tuple(not m for m in mamba),
        mamba=MambaConfig(
            heads=hf.mamba_n_heads,
            head_dim=hf.mamba_d_head,
            groups=hf.mamba_n_groups,
            state=hf.mamba_d_state,
            conv_kernel=hf.mamba_d_conv,
            conv_bias=bool(hf.mamba_conv_bias),
            proj_bias=bool(hf.mamba_proj_bias),
            chunk_size=hf.mamba_chunk_size,
            dt_min=float(dt_min),
            dt_max=float(dt_max),
        ),
        recurrent_layers=mamba,
    )


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
    if name.endswith(".mamba.A_log"):
        return torch.log(-w.reshape(-1))
    if name.endswith((".mamba.D", ".mamba.norm.weight")):
        return w.reshape(-1)
    return w


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


# -- the specs -------------------------------------------------------------------------------------------------------
SPECS = (
    # Granite 3.x: Llama layers with multipliers; the residual one is folded into the weights (the fused stack's)
    ArchSpec(
        "granite",
        ("GraniteForCausalLM",),
        config=granite_fields,
        gguf=GGUFSpec(
            "granite",
            "GraniteConfig",
            GGUF_LLAMA_LAYERS,
            permute_qk=True,
            head_dim_key="rope.dimension_count",
            config=gguf_granite,
        ),
    ),
    # Granite 4.0-H: Mamba-2 mixers and attention layers (families/granite_hybrid.py), each sequence's mixer
    # states in the engine's recurrent-state pool; the checkpoint's stacked experts split per expert
    ArchSpec(
        "granitemoehybrid",
        ("GraniteMoeHybridForCausalLM",),
        config=lambda hf: {**granite_fields(hf), **hybrid_fields(hf)},
        gguf=GGUFSpec(
            "granitehybrid",
            "GraniteMoeHybridConfig",
            GGUF_GRANITE_HYBRID_LAYERS,
            permute_qk=True,
            config=gguf_granite_hybrid,
            values=gguf_granite_hybrid_values,
        ),
        checkpoint_renames=(
            (".block_sparse_moe.router.layer.", ".mlp.gate."),
            (".block_sparse_moe.router.", ".mlp.gate."),
            (".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
            (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),
            (".block_sparse_moe.experts.", ".mlp.experts."),
            (".shared_mlp.input_linear.", ".shared_mlp.gate_up_proj."),
            (".shared_mlp.output_linear.", ".shared_mlp.down_proj."),
        ),
        checkpoint_tensors=granite_hybrid_tensors,
        tensor_parallel=False,
        model_class=GraniteHybridModel,
        **NO_STACK,
    ),
)
