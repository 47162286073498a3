"""GLM-4 (0414): Gemma's sandwich norms under other names (renamed onto Gemma's), interleaved partial rotary, q / k / v
biases, a packed gate_up_proj."""

from __future__ import annotations

from llmserve.model.specs.spec import GGUF_LLAMA_LAYERS, NO_STACK, ArchSpec, GGUFMetadata, GGUFSpec

# GLM-4 under Hugging Face's GLM names (its spec's checkpoint_renames make them Gemma's): ffn_norm is the norm before
# the MLP (GLM's post_attention_layernorm), ffn_up the packed gate + up
GGUF_GLM4_LAYERS = {
    **GGUF_LLAMA_LAYERS,
    "post_attention_norm": "post_self_attn_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
    "ffn_up": "mlp.gate_up_proj",
}


def gguf_glm4(meta: GGUFMetadata, kw: dict, theta: float) -> dict:
    return dict(partial_rotary_factor=meta.get("rope.dimension_count", kw["head_dim"] // 2) / kw["head_dim"])


# -- the specs -------------------------------------------------------------------------------------------------------
SPECS = (
    # GLM-4 (0414): Gemma's sandwich norms under other names, interleaved partial rotary (q / k rows loaded in
    # layers.head_order), q / k / v biases, a packed gate_up_proj in the checkpoint (as Phi-3's)
    ArchSpec(
        "glm4",
        ("Glm4ForCausalLM",),
        features=dict(sandwich_norms=True, rotary_interleaved=True),
        # (llama.cpp rotates GLM-4's adjacent pairs too: the converter keeps Hugging Face's rows)
        gguf=GGUFSpec("glm4", "Glm4Config", GGUF_GLM4_LAYERS, head_dim_key="attention.key_length", config=gguf_glm4),
        checkpoint_renames=(  # (in this order: post_attention_layernorm is first renamed away)
            (".post_attention_layernorm.", ".pre_feedforward_layernorm."),
            (".post_self_attn_layernorm.", ".post_attention_layernorm."),
            (".post_mlp_layernorm.", ".post_feedforward_layernorm."),
        ),
        tensor_parallel=False,  # (the packed gate_up_proj, as Phi-3's)
        **NO_STACK,
    ),
)
