"""LFM2 (Liquid AI): conv layers with a state per sequence among attention layers (llmserve.model.families.lfm2);
the checkpoint's names onto Llama's (`RENAMES`), its MLP width adjusted from the config (`config_fields`), its GGUF
names and hooks."""

from __future__ import annotations

from llmserve.model.families.lfm2 import Lfm2Model
from llmserve.model.specs.spec import (
    GGUF_LLAMA_LAYERS,
    GGUF_MODEL_NAMES,
    GGUF_QK_NORMS,
    NO_STACK,
    ArchSpec,
    GGUFMetadata,
    GGUFSpec,
)

# the checkpoint's names -> the Llama decoder's (the conv layers' `conv.*` stay as they are)
RENAMES = (
    (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
    (".operator_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    ("model.embedding_norm.", "model.norm."),  # (applied after the last layer, despite its name)
)


def config_fields(hf) -> dict:
    """ModelConfig fields from an Lfm2Config: the conv layers, the conv width, the MLP's width (with
    block_auto_adjust_ff_dim, two thirds of intermediate_size, times the multiplier, rounded up to a multiple)."""
    width = hf.intermediate_size
    if hf.block_auto_adjust_ff_dim:
        width = int(2 * width / 3)
        if hf.block_ffn_dim_multiplier is not None:
            width = int(hf.block_ffn_dim_multiplier * width)
            width = -(-width // hf.block_multiple_of) * hf.block_multiple_of
    return dict(
        intermediate_size=width,
        recurrent_layers=tuple(t == "conv" for t in hf.layer_types),
        conv_kernel=int(hf.conv_L_cache),
        conv_bias=bool(hf.conv_bias),
    )


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


# -- the specs -------------------------------------------------------------------------------------------------------
SPECS = (
    # LFM2: gated short-convolution layers that keep a state per sequence (engine/state_pool.py) among attention
    # layers with q / k norms per head (llmserve.model.families.lfm2); its names onto Llama's
    ArchSpec(
        "lfm2",
        ("Lfm2ForCausalLM",),
        features=dict(qk_norm=True),
        config=config_fields,
        gguf=GGUFSpec("lfm2", "Lfm2Config", GGUF_LFM2_LAYERS, names=GGUF_LFM2_NAMES, config=gguf_lfm2),
        checkpoint_renames=RENAMES,
        tensor_parallel=False,
        model_class=Lfm2Model,
        **NO_STACK,
    ),
)
