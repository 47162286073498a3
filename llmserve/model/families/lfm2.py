"""LFM2 (Liquid AI): a hybrid decoder whose conv layers mix positions with a gated short convolution that keeps a
small state per sequence (llmserve.model.layers.short_conv; the engine keeps the states in its pool,
engine/state_pool.py), among attention layers that are the Llama decoder's own with q / k norms per head. The
checkpoint's names map onto Llama's (`RENAMES`); its MLP width is adjusted from the config (`config_fields`)."""

from __future__ import annotations

import torch
import torch.nn as nn

from llmserve.model.attention import AttentionMetadata
from llmserve.model.config import ModelConfig
from llmserve.model.families.llama import LlamaModel
from llmserve.model.layers import MLP, RMSNorm
from llmserve.model.layers.cache_kinds import LayerKind
from llmserve.model.layers.short_conv import ShortConv

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


class ShortConvLayer(nn.Module):
    """An LFM2 conv layer: norm, the gated short convolution, norm, the MLP (residual adds fused with the norms,
    as the decoder's layers do)."""

    sliding = nope = False  # (what LlamaModel.forward asks of each layer)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.conv = ShortConv(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def cache_kind(self, kv_heads: int, kv_dtype: torch.dtype, state_dtype: torch.dtype) -> LayerKind:
        """Its convolution's state, per sequence (the KV plan's question: model/layers/cache_kinds.py)."""
        return self.conv.cache_kind(state_dtype)

    def forward(self, x, residual, positions, rotary, state, meta: AttentionMetadata):
        """As DecoderLayer.forward, with the layer's state tensors in place of a KV cache."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h, residual = self.post_attention_layernorm.add_forward(self.conv(h, state, meta), residual)
        return self.mlp(h), residual


class Lfm2Model(LlamaModel):
    """The Llama decoder with its conv layers (cfg.recurrent_layers) replaced by ShortConvLayers."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(cfg, max_positions)
        for i, recurrent in enumerate(cfg.recurrent_layers):
            if recurrent:
                self.layers[i] = ShortConvLayer(cfg)
