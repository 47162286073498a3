"""Gemma 2 and Gemma 3 (text, and with its SigLIP tower: llmserve.model.vision.gemma3): (1 + w) norms, scaled
embeddings, sandwich norms, soft-capping, sliding-window layers."""

from __future__ import annotations

from llmserve.model.specs.spec import (
    GGUF_LLAMA_LAYERS,
    GGUF_QK_NORMS,
    NO_STACK,
    ArchSpec,
    GGUFMetadata,
    GGUFSpec,
    swa_layers,
)
from llmserve.model.vision.gemma3 import Gemma3VisionModel
from llmserve.model.vision.processing import Gemma3Processing


def gemma_fields(hf) -> dict:
    return dict(
        norm_offset=True,
        embed_scale=hf.hidden_size**0.5,
        sandwich_norms=True,
        attn_scale=hf.query_pre_attn_scalar**-0.5,
        attn_softcap=getattr(hf, "attn_logit_softcapping", None),
        final_softcap=getattr(hf, "final_logit_softcapping", None),
    )


# Gemma's sandwich norms: llama.cpp's ffn_norm is the norm before the MLP, post_attention_norm the one after
# attention (Hugging Face's post_attention_layernorm), post_ffw_norm the one after the MLP
GGUF_GEMMA_LAYERS = {
    **GGUF_LLAMA_LAYERS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


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


# -- the specs -------------------------------------------------------------------------------------------------------
SPECS = (
    ArchSpec(
        "gemma2",
        ("Gemma2ForCausalLM",),
        config=gemma_fields,
        gguf=GGUFSpec(
            "gemma2",
            "Gemma2Config",
            GGUF_GEMMA_LAYERS,
            head_dim_key="attention.key_length",
            norm_offset=True,
            config=gguf_gemma2,
        ),
        **NO_STACK,
    ),
    ArchSpec(
        "gemma3_text",
        ("Gemma3ForCausalLM",),
        features=dict(qk_norm=True),
        config=gemma_fields,
        gguf=GGUFSpec(
            "gemma3",
            "Gemma3TextConfig",
            {**GGUF_GEMMA_LAYERS, **GGUF_QK_NORMS},
            head_dim_key="attention.key_length",
            norm_offset=True,
            config=gguf_gemma3,
        ),
        **NO_STACK,
    ),
    ArchSpec(  # Gemma 3 with its SigLIP tower (pan and scan off): the decoder is gemma3_text's
        "gemma3",
        ("Gemma3ForConditionalGeneration",),
        features=dict(qk_norm=True),
        config=gemma_fields,
        checkpoint_renames=(("language_model.model.", "model."), ("vision_tower.vision_model.", "vision_tower.")),
        tensor_parallel=False,
        model_class=Gemma3VisionModel,
        images=Gemma3Processing,
        **NO_STACK,
    ),
)
