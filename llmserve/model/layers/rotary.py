"""Rotary position embeddings: the cos/sin tables (default, linear, llama3, yarn and longrope scaling; a set
per layer type where the config has one, Gemma 3; partial rotary) and the rotation the PyTorch path applies.

Partial rotary (`partial_rotary_factor` < 1: Phi-4-mini) rotates the first R of each head's D dimensions as
rotate-half pairs (i, i + R/2) and passes the rest. The kernels (and the fused decode stack) rotate pairs
(i, i + D/2) of a [positions, D] table, so the model loads each q and k head's rows in `head_order`: the
rotated pairs land D/2 apart, the passed dimensions between them with cos 1, sin 0. q . k is the same in
any order shared by q and k, so nothing else changes (v and the output keep theirs). Interleaved rotary
(GLM-4: pairs (2i, 2i + 1), partial) is loaded the same way, each pair's halves D/2 apart."""

from __future__ import annotations

import torch
import torch.nn as nn

from llmserve.model.config import ModelConfig


class Rotary(nn.Module):
    """cos/sin table for every position up to max_positions, indexed by the batch's positions.
    `layer_type`: Gemma 3's sliding layers have rope parameters of their own."""

    def __init__(self, cfg: ModelConfig, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs, scale = self._freqs(cfg, layer_type, t)
        passed = cfg.head_dim // 2 - freqs.shape[1]  # (partial rotary: the dimensions that do not rotate)
        cos = torch.cat([freqs.cos() * scale, torch.ones(len(t), passed, device=t.device)], dim=-1)
        sin = torch.cat([freqs.sin() * scale, torch.zeros(len(t), passed, device=t.device)], dim=-1)
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat([sin, sin], dim=-1), persistent=False)
        # M-RoPE: the position axis (0 t, 1 h, 2 w) by which each of a head's dimensions turns (None: 1-D rotary)
        self.register_buffer("mrope_axes", mrope_axes(cfg), persistent=False)

    def multimodal(self, positions: torch.Tensor) -> Rotary:
        """The rotation of a step's rows at multimodal positions `positions` [3, T]: a table of T rows (row i:
        each dimension's angle at row i's position on that dimension's axis), to be read at 0..T-1."""
        t, d = positions.shape[1], self.cos.shape[1]
        index = self.mrope_axes.view(1, 1, d).expand(1, t, d)
        rot = nn.Module.__new__(Rotary)
        nn.Module.__init__(rot)
        rot.register_buffer("cos", self.cos[positions].gather(0, index)[0], persistent=False)
        rot.register_buffer("sin", self.sin[positions].gather(0, index)[0], persistent=False)
        return rot

    @classmethod
    def identity(cls, cfg: ModelConfig, max_positions: int) -> Rotary:
        """The rotation that leaves q and k as they are (cos 1, sin 0): SmolLM3's NoPE layers, through the
        same kernels as the rotated ones."""
        rot = nn.Module.__new__(cls)
        nn.Module.__init__(rot)
        rot.register_buffer("cos", torch.ones(max_positions, cfg.head_dim), persistent=False)
        rot.register_buffer("sin", torch.zeros(max_positions, cfg.head_dim), persistent=False)
        return rot

    @classmethod
    def _freqs(cls, cfg: ModelConfig, layer_type: str | None, t: torch.Tensor) -> tuple[torch.Tensor, float]:
        """[positions, R/2] angles and the cos/sin scale. longrope (Phi-3 / Phi-4 long context): transformers
        uses the short factors while a sequence fits in original_max_position_embeddings and the long ones (for
        every position: it recomputes the cache on crossing) beyond; one table per model serves both only
        one way, so, as vLLM does, the long factors when the model serves more positions than that (the
        table's spare row for a verified proposal aside), the short ones otherwise; the attention factor on both."""
        params = local_rope_parameters(cfg, layer_type) or cfg.rope_scaling or {}
        if params.get("rope_type", params.get("type")) != "longrope":
            inv_freq, scale = cls._inv_freq(cfg, layer_type)
            return torch.outer(t, inv_freq.to(t.device)), scale
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        original = params.get("original_max_position_embeddings") or cfg.hf_config.original_max_position_embeddings
        seq_len = original + 1 if len(t) > original + 1 else None  # (None: the short factors)
        with torch.device("cpu"):
            inv_freq, scale = ROPE_INIT_FUNCTIONS["longrope"](cfg.hf_config, "cpu", seq_len=seq_len)
        return torch.outer(t, inv_freq.float().to(t.device)), float(scale)

    @staticmethod
    def _inv_freq(cfg: ModelConfig, layer_type: str | None) -> tuple[torch.Tensor, float]:
        params = local_rope_parameters(cfg, layer_type) or cfg.rope_scaling or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "su":  # (Phi-3's early name of longrope)
            raise ValueError("model: rope scaling 'su' is not supported (name it 'longrope' in the config)")
        if rope_type != "default" and cfg.hf_config is not None:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"model: unsupported rope scaling {rope_type!r}")
            kw = {"layer_type": layer_type} if layer_type else {}
            with torch.device("cpu"):  # (also when the model is being built on the meta device)
                inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](cfg.hf_config, "cpu", **kw)
            return inv_freq.float(), float(scale)
        d, theta = rotary_dim(cfg), params.get("rope_theta", cfg.rope_theta)
        return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)), 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rotary_dim(cfg: ModelConfig) -> int:
    """How many of each head's dimensions rotate (R: all of them, but for partial rotary)."""
    params = cfg.rope_scaling or getattr(cfg.hf_config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(cfg.hf_config, "partial_rotary_factor", None)) or 1.0
    return int(cfg.head_dim * factor)


def mrope_axes(cfg: ModelConfig) -> torch.Tensor | None:
    """M-RoPE (`cfg.mrope_section`, summing to half the head): the axis (0 temporal, 1 height, 2 width) whose
    position turns each of a head's dimensions, [head_dim] (both halves of a rotate-half pair alike); None
    without it. Consecutive sections (Qwen2.5-VL): the first s0 frequencies t, the next s1 h, the rest w;
    interleaved (Qwen3-VL): frequency i is h where i % 3 == 1 and i < 3 * s1, w where i % 3 == 2 and i < 3 * s2,
    else t."""
    sec = cfg.mrope_section
    if not sec:
        return None
    half = cfg.head_dim // 2
    if sum(sec) != half or len(sec) != 3:
        raise ValueError(f"model: mrope_section {list(sec)} must be three sections summing to {half} (half a head)")
    if cfg.mrope_interleaved:
        axes = torch.zeros(half, dtype=torch.long)
        for axis in (1, 2):
            axes[axis : 3 * sec[axis] : 3] = axis
    else:
        axes = torch.cat([torch.full((n,), axis, dtype=torch.long) for axis, n in enumerate(sec)])
    return torch.cat([axes, axes])


def head_order(cfg: ModelConfig) -> torch.Tensor | None:
    """The order each q and k head's rows are loaded in (see the module's doc), None: the checkpoint's.
    Interleaved rotary (GLM-4: pairs (2i, 2i + 1)) is the same move: the pairs' first halves, half the passed
    dimensions, their second halves, the other passed half."""
    d, r = cfg.head_dim, rotary_dim(cfg)
    if r == d and not cfg.rotary_interleaved:
        return None
    if r % 2 or (d - r) % 2:
        raise ValueError(f"model: partial rotary over {r} of {d} dimensions (odd) is not supported")
    p = (d - r) // 2
    step, half = (2, 1) if cfg.rotary_interleaved else (1, r // 2)
    parts = [(0, half if step == 1 else r), (r, r + p), (half, r), (r + p, d)]
    return torch.cat([torch.arange(a, b, step if i in (0, 2) else 1, device="cpu") for i, (a, b) in enumerate(parts)])


def head_rows(rows: torch.Tensor, order: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`rows` [heads * head_dim, ...] with each head's rows in `order`."""
    heads = rows.shape[0] // head_dim
    index = (torch.arange(heads, device=order.device)[:, None] * head_dim + order[None, :]).reshape(-1)
    return rows.index_select(0, index.to(rows.device))


def local_rope_parameters(cfg: ModelConfig, layer_type: str | None) -> dict | None:
    """The rope parameters of `layer_type`'s layers where the config has a set per layer type (Gemma 3)."""
    params = getattr(cfg.hf_config, "rope_parameters", None)
    return params.get(layer_type) if layer_type and isinstance(params, dict) else None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def qkv_in_head_order(qkv: torch.Tensor, cfg: ModelConfig, order: torch.Tensor) -> torch.Tensor:
    """A packed q/k/v projection's rows [q | k | v, ...] with each q and k head's rows in `order` (v's kept)."""
    q, k = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return torch.cat(
        [head_rows(qkv[:q], order, cfg.head_dim), head_rows(qkv[q : q + k], order, cfg.head_dim), qkv[q + k :]]
    )
