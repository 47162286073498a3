"""The gated MLP (one matmul for gate/up, one for down) and its activations: SiLU, GELU-tanh, and gpt-oss's
clamped SwiGLU."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmserve.model.config import ModelConfig
from llmserve.model.kernels import ops
from llmserve.model.layers.linear import Linear


def act_and_mul(gate_up: torch.Tensor, act: str, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """act(gate) * up for a packed [..., gate | up] row. `clamped_swiglu` (gpt-oss, as transformers computes it):
    gate clamped above at `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    if act == "silu":
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    if act == "clamped_swiglu":
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return F.gelu(gate, approximate="tanh") * up


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act, self.alpha, self.limit = cfg.hidden_act, cfg.swiglu_alpha, cfg.swiglu_limit
        self.all_reduce = None  # tensor parallelism: sums the row-parallel down_proj partials

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, down = self.gate_up_proj, self.down_proj
        if (
            getattr(up, "bf16_rows", False)
            and getattr(down, "bf16_rows", False)
            and not (up._forward_hooks or down._forward_hooks)  # (LoRA's hooks add float32 rows)
        ):
            # both hold bfloat16 weights (llmserve.model.formats.bf16): their matmuls round rows to bfloat16 anyway,
            # so the 2 x intermediate-wide rows between them stay bfloat16 (a prompt's rows were widened to float32
            # and rounded back: ~20% of a 3B prefill's time) and only the hidden-wide output is widened
            h = act_and_mul(up(x.to(torch.bfloat16)), self.act, self.alpha, self.limit)
            o = down(h).to(x.dtype)
        else:
            o = self.down_proj(act_and_mul(self.gate_up_proj(x), self.act, self.alpha, self.limit))
        return o if self.all_reduce is None else self.all_reduce(o)
