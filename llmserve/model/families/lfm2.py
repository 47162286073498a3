"""LFM2 (Liquid AI): a hybrid decoder whose conv layers mix positions with a gated short convolution that keeps a
small state per sequence (llmserve.model.layers.short_conv; the engine keeps the states in its pool,
engine/state_pool.py), among attention layers that are the Llama decoder's own with q / k norms per head. Its spec
(the checkpoint's names onto Llama's, its MLP width from the config, its GGUF files): llmserve/model/specs/lfm2.py."""

from __future__ import annotations

import torch
import torch.nn as nn

from llmserve.model.attention import AttentionMetadata
from llmserve.model.config import ModelConfig
from llmserve.model.families.llama import LlamaModel
from llmserve.model.layers import MLP, RMSNorm
from llmserve.model.layers.cache_kinds import LayerKind
from llmserve.model.layers.short_conv import ShortConv


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
