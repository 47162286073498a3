"""Rotary position embeddings: the cos/sin tables (default, linear, llama3 and yarn scaling; a set per
layer type where the config has one, Gemma 3) and the rotation the PyTorch path applies."""

from __future__ import annotations

import torch
import torch.nn as nn

from llmserve.model.config import ModelConfig


class Rotary(nn.Module):
    """cos/sin table for every position up to max_positions, indexed by the batch's positions.
    `layer_type`: Gemma 3's sliding layers have rope parameters of their own."""

    def __init__(self, cfg: ModelConfig, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        inv_freq, scale = self._inv_freq(cfg, layer_type)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(t.device))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    @staticmethod
    def _inv_freq(cfg: ModelConfig, layer_type: str | None) -> tuple[torch.Tensor, float]:
        params = local_rope_parameters(cfg, layer_type) or cfg.rope_scaling or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type in ("longrope", "su"):  # Phi-3's long-context variants: factors that change with the length
            raise ValueError(
                f"model: rope scaling {rope_type!r} is not supported (llmserve runs default, linear, llama3 and yarn)"
            )
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("model: partial rotary embeddings (partial_rotary_factor < 1) are not supported")
        if rope_type != "default" and cfg.hf_config is not None:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"model: unsupported rope scaling {rope_type!r}")
            kw = {"layer_type": layer_type} if layer_type else {}
            with torch.device("cpu"):  # (also when the model is being built on the meta device)
                inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](cfg.hf_config, "cpu", **kw)
            return inv_freq.float(), float(scale)
        d, theta = cfg.head_dim, params.get("rope_theta", cfg.rope_theta)
        return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)), 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def local_rope_parameters(cfg: ModelConfig, layer_type: str | None) -> dict | None:
    """The rope parameters of `layer_type`'s layers where the config has a set per layer type (Gemma 3)."""
    params = getattr(cfg.hf_config, "rope_parameters", None)
    return params.get(layer_type) if layer_type and isinstance(params, dict) else None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
