"""Granite 4.0-H (transformers' GraniteMoeHybridForCausalLM): Granite's decoder with most attention layers
replaced by Mamba-2 mixers (layers.mamba2), by the config's `layer_types`; after either, routed experts (top-k
logits, their softmax: the routing of layers.moe's `router_topk_softmax`) plus a shared gated MLP, or the shared MLP
alone (the dense variants). Granite 3.x's multipliers: embeddings, attention scale, logits; the residual one folded
into every projection that feeds the residual stream (o_proj, the mixers' out_proj, the experts' and the shared
MLP's down_proj: `adapt_weight`). Attention layers rotate q and k only with `position_embedding_type: rope`; without
it (Granite 4.0-H's own configs) they carry no position at all (the mixers do).

The checkpoint's names (after the spec's renames, llmserve.model.registry): `mamba.*` as the mixer's,
`block_sparse_moe.router` -> `mlp.gate`, its stacked experts (`input_linear` [E, 2I, hidden], `output_linear`
[E, hidden, I]) split per expert by gpt_oss.ExpertTensors, `shared_mlp.input_linear` / `output_linear` ->
`shared_mlp.gate_up_proj` / `down_proj`.

Each mixer's per-sequence state (its convolution window and scan state: `state_shapes`) lives in the engine's
recurrent-state pool, one slot per running sequence; the step's metadata says which slot each row reads and
writes (attention.StateMetadata, engine/state_pool.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from llmserve.model.attention import AttentionMetadata
from llmserve.model.config import ModelConfig
from llmserve.model.families.gpt_oss import ExpertTensors
from llmserve.model.families.llama import LlamaModel
from llmserve.model.layers import MLP, Attention, Mamba2Mixer, RMSNorm, SparseMoE
from llmserve.model.layers.cache_kinds import LayerKind


class HybridLayer(nn.Module):
    """Pre-norm block: attention or a Mamba-2 mixer, then the experts plus the shared MLP (or the shared MLP)."""

    sliding = False

    def __init__(self, cfg: ModelConfig, index: int = 0, max_positions: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        recurrent = cfg.recurrent_layers[index]
        self.mamba = Mamba2Mixer(cfg.hidden_size, cfg.mamba, cfg.rms_norm_eps) if recurrent else None
        self.self_attn = None if recurrent else Attention(cfg)
        self.nope = not recurrent and bool(cfg.nope_layers) and cfg.nope_layers[index]
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if cfg.num_experts else None
        self.shared_mlp = MLP(cfg)  # (cfg.intermediate_size: the shared MLP's, specs/granite.py)

    def cache_kind(self, kv_heads: int, kv_dtype: torch.dtype, state_dtype: torch.dtype) -> LayerKind:
        """The mixer's state per sequence, or the attention's keys and values (model/layers/cache_kinds.py)."""
        if self.mamba is not None:
            return self.mamba.cache_kind(state_dtype)
        return self.self_attn.cache_kind(kv_heads, kv_dtype)

    def forward(self, x, residual, positions, rotary, kv_cache, meta: AttentionMetadata):
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        if self.mamba is not None:
            h = self.mamba(h, kv_cache, meta.states)  # (kv_cache: its state tensors, by slot)
        else:
            h = self.self_attn(h, positions, rotary, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        out = self.shared_mlp(h)
        return (out if self.mlp is None else self.mlp(h) + out), residual


class GraniteHybridModel(LlamaModel):
    """LlamaModel's embedding, head, loading and packing around HybridLayers."""

    layer_class = HybridLayer  # (its spec has no fused decode stack: cfg.fused_decode is False)

    def adapt_weight(self, layer: str, tensor: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
        """LlamaModel's (o_proj and the shared MLP's down_proj times the residual multiplier), and the same for the
        mixers' out_proj and the experts' down_proj: every output into the residual stream."""
        tensor = super().adapt_weight(layer, tensor, order)
        rm = self.cfg.residual_multiplier
        if rm != 1.0 and (layer.endswith("mamba.out_proj") or (".experts." in layer and layer.endswith("down_proj"))):
            tensor = tensor.float() * rm
        return tensor


def checkpoint_tensors(cfg: ModelConfig, weights: Mapping) -> Mapping:
    """The checkpoint (after its renames) with its stacked experts split per expert and projection."""
    return ExpertTensors(weights, cfg.num_experts, layout="stacked")
