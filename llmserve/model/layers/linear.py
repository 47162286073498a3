"""The projections: `Linear` (float32 CPU matmuls through the kernels) and the packed projections a decoder
fuses (Q/K/V, gate/up) with the checkpoint layers each is made of."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmserve.model.kernels import ops

# llmserve's packed projections -> the checkpoint's (Hugging Face's) layers they are made of, in row order
PACKED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_parts(name: str) -> tuple[str, ...]:
    """The checkpoint layers behind one of this model's: `layers.0.mlp.gate_up_proj` ->
    (`layers.0.mlp.gate_proj`, `layers.0.mlp.up_proj`); any other name stands for itself."""
    prefix, dot, leaf = name.rpartition(".")
    return tuple(prefix + dot + part for part in PACKED_PROJECTIONS.get(leaf, (leaf,)))


class Linear(nn.Linear):
    """nn.Linear whose float32 CPU matmul runs through ops.linear (the GEMV, or the GEMM engine measured fastest
    on this CPU: oneDNN's or MKL's, see ops.gemm_engine)."""

    packed = None  # the weight in oneDNN's layout beside the plain one (LlamaModel.pack_weights), or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is not torch.float32 or x.is_cuda or self.weight.dtype is not torch.float32:
            return F.linear(x, self.weight, self.bias)
        y = ops.linear(x.reshape(-1, x.shape[-1]), self.weight, self.packed).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias
