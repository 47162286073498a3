"""The routed-expert families on Llama's layers: Mixtral (its GGUF files are llama ones with experts) and Qwen3-MoE."""

from __future__ import annotations

from llmserve.model.specs.spec import (
    GGUF_LLAMA_LAYERS,
    GGUF_MOE_LAYERS,
    GGUF_QK_NORMS,
    NO_STACK,
    ArchSpec,
    GGUFMetadata,
    GGUFSpec,
)


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


# -- the specs -------------------------------------------------------------------------------------------------------
SPECS = (
    ArchSpec(
        "mixtral",
        ("MixtralForCausalLM",),
        config=mixtral_fields,
        gguf=GGUFSpec(
            "llama",
            "MixtralConfig",
            {**GGUF_LLAMA_LAYERS, **GGUF_MOE_LAYERS},
            permute_qk=True,
            head_dim_key="rope.dimension_count",
            experts=True,
            config=gguf_mixtral,
        ),
        # the model's names are Hugging Face's Llama / Qwen3-MoE ones
        checkpoint_renames=(
            (".block_sparse_moe.", ".mlp."),
            (".w1.", ".gate_proj."),
            (".w3.", ".up_proj."),
            (".w2.", ".down_proj."),
        ),
        tensor_parallel=False,  # (experts are not split yet)
        **NO_STACK,
    ),
    ArchSpec(
        "qwen3_moe",
        ("Qwen3MoeForCausalLM",),
        features=dict(qk_norm=True),
        config=qwen3_moe_fields,
        gguf=GGUFSpec(
            "qwen3moe",
            "Qwen3MoeConfig",
            {**GGUF_LLAMA_LAYERS, **GGUF_QK_NORMS, **GGUF_MOE_LAYERS},
            head_dim_key="attention.key_length",
            config=gguf_qwen3_moe,
        ),
        tensor_parallel=False,
        **NO_STACK,
    ),
)
