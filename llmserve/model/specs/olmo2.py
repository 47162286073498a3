"""OLMo 2: no norm before attention or the MLP, one after each (the sandwich's post-norms), q / k normed over the whole
projection."""

from __future__ import annotations

from llmserve.model.specs.spec import (
    GGUF_LLAMA_LAYERS,
    GGUF_QK_NORMS,
    NO_STACK,
    ArchSpec,
    GGUFSpec,
    gguf_attention_bias,
    o_proj_bias_fields,
)

# OLMo 2: no norms before attention or the MLP, the post-norms as Gemma's, q / k norms over the whole projection
GGUF_OLMO2_LAYERS = {
    **{k: v for k, v in GGUF_LLAMA_LAYERS.items() if k not in ("attn_norm", "ffn_norm")},
    **GGUF_QK_NORMS,
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


# -- the specs -------------------------------------------------------------------------------------------------------
SPECS = (
    # OLMo 2: no norm before attention or the MLP, one after each (the sandwich's post-norms), q / k normed over
    # the whole projection (all heads as one row: not split across tensor-parallel ranks)
    ArchSpec(
        "olmo2",
        ("Olmo2ForCausalLM",),
        features=dict(qk_norm=True, qk_norm_whole=True, sandwich_norms=True, pre_norms=False),
        config=o_proj_bias_fields,
        gguf=GGUFSpec(
            "olmo2",
            "Olmo2Config",
            GGUF_OLMO2_LAYERS,
            head_dim_key="attention.key_length",
            config=gguf_attention_bias,
        ),
        tensor_parallel=False,
        **NO_STACK,
    ),
)
