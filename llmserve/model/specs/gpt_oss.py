"""gpt-oss: attention sinks, alternating sliding-window layers, q / k / v / o biases, experts in every layer with the
clamped SwiGLU; its checkpoint's fused expert tensors split per expert (llmserve.model.families.gpt_oss)."""

from __future__ import annotations

from llmserve.model.families.gpt_oss import checkpoint_tensors as gpt_oss_tensors
from llmserve.model.specs.moe import mixtral_fields
from llmserve.model.specs.spec import (
    GGUF_LLAMA_LAYERS,
    GGUF_MOE_LAYERS,
    NO_STACK,
    ArchSpec,
    GGUFMetadata,
    GGUFSpec,
    o_proj_bias_fields,
    swa_layers,
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


# -- the specs -------------------------------------------------------------------------------------------------------
SPECS = (
    # gpt-oss: attention sinks, alternating sliding-window layers, q / k / v / o biases; experts in every layer
    # (router with a bias, softmax over the top-k logits, biased experts, the clamped SwiGLU); the checkpoint's
    # fused expert tensors split per expert (llmserve.model.families.gpt_oss)
    ArchSpec(
        "gpt_oss",
        ("GptOssForCausalLM",),
        features=dict(attn_sinks=True),
        config=gpt_oss_fields,
        gguf=GGUFSpec(
            "gpt-oss", "GptOssConfig", GGUF_GPT_OSS_LAYERS, head_dim_key="attention.key_length", config=gguf_gpt_oss
        ),
        # (a GGUF file's attn_sinks has a .weight suffix, the checkpoint's sinks none)
        checkpoint_renames=((".mlp.router.", ".mlp.gate."), (".self_attn.sinks.weight", ".self_attn.sinks")),
        checkpoint_tensors=gpt_oss_tensors,
        tensor_parallel=False,
        **NO_STACK,
    ),
)
