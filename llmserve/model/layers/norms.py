"""RMSNorm, with the residual add fused where the kernel runs."""

from __future__ import annotations

import torch
import torch.nn as nn

from llmserve.model.kernels import ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), in place where the fused kernel runs."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)
