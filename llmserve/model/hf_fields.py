"""Per-family ModelConfig fields read from a transformers config (llmserve.model.registry's `ArchSpec.config`):
what each family adds to the fields every family shares (`registry.config_from_hf`)."""

from __future__ import annotations


def gemma_fields(hf) -> dict:
    return dict(
        norm_offset=True,
        embed_scale=hf.hidden_size**0.5,
        sandwich_norms=True,
        attn_scale=hf.query_pre_attn_scalar**-0.5,
        attn_softcap=getattr(hf, "attn_logit_softcapping", None),
        final_softcap=getattr(hf, "final_logit_softcapping", None),
    )


def o_proj_bias_fields(hf) -> dict:
    """attention_bias in Granite, OLMo 2 and gpt-oss: q / k / v biases (the common field) and o_proj's alike (a
    biased o_proj leaves the fused decode stack, which takes no biases: the model takes the module path)."""
    return dict(o_proj_bias=bool(getattr(hf, "attention_bias", False)))


def granite_fields(hf) -> dict:
    return dict(
        o_proj_bias_fields(hf),
        embed_scale=float(hf.embedding_multiplier),
        attn_scale=float(hf.attention_multiplier),
        residual_multiplier=float(hf.residual_multiplier),  # (folded into o_proj and down_proj at load)
        logits_scaling=float(hf.logits_scaling),
    )


def smollm3_fields(hf) -> dict:
    return dict(nope_layers=tuple(not use_rope for use_rope in hf.no_rope_layers))  # (1: the layer rotates)


def mrope_fields(hf) -> dict:
    """Multimodal rotary (Qwen2.5-VL, Qwen3-VL): the frequency sections each position axis turns."""
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    if "mrope_section" not in params:
        raise ValueError("model: a vision-language config without rope_parameters.mrope_section")
    return dict(mrope_section=tuple(params["mrope_section"]))


def mixtral_fields(hf) -> dict:
    return dict(
        num_experts=hf.num_local_experts,
        num_experts_per_tok=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size,
        moe_layers=(True,) * hf.num_hidden_layers,
    )


def qwen3_moe_fields(hf) -> dict:
    sparse = tuple(
        i not in (hf.mlp_only_layers or []) and hf.num_experts > 0 and (i + 1) % hf.decoder_sparse_step == 0
        for i in range(hf.num_hidden_layers)
    )
    return dict(
        num_experts=hf.num_experts,
        num_experts_per_tok=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        moe_layers=sparse,
        norm_topk_prob=bool(hf.norm_topk_prob),
    )


def gpt_oss_fields(hf) -> dict:
    return dict(
        mixtral_fields(hf),  # (experts in every layer, num_local_experts of intermediate_size, as Mixtral's)
        router_bias=True,
        router_topk_softmax=True,
        expert_bias=True,
        hidden_act="clamped_swiglu",
        swiglu_alpha=float(hf.swiglu_alpha),
        swiglu_limit=float(hf.swiglu_limit),
        **o_proj_bias_fields(hf),
    )
