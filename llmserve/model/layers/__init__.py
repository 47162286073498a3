"""The layers model files compose: projections, norms, rotary, attention, the gated MLP, routed experts, the Mamba-2
mixer."""

from llmserve.model.layers.attention import Attention
from llmserve.model.layers.linear import PACKED_PROJECTIONS, Linear, checkpoint_parts
from llmserve.model.layers.mamba2 import Mamba2Mixer
from llmserve.model.layers.mlp import MLP, act_and_mul
from llmserve.model.layers.moe import Router, SparseMoE
from llmserve.model.layers.norms import RMSNorm
from llmserve.model.layers.rotary import Rotary, head_order, head_rows, local_rope_parameters, qkv_in_head_order

__all__ = [
    "MLP",
    "PACKED_PROJECTIONS",
    "Attention",
    "Linear",
    "Mamba2Mixer",
    "RMSNorm",
    "Rotary",
    "Router",
    "SparseMoE",
    "act_and_mul",
    "checkpoint_parts",
    "head_order",
    "head_rows",
    "local_rope_parameters",
    "qkv_in_head_order",
]
