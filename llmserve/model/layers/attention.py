"""The attention layer a decoder composes: packed Q/K/V, optional q/k norms (per head, or over the whole
projection: OLMo 2), rotary and the KV write
(fused where the kernel runs), paged attention over the cache (llmserve.model.attention), o_proj (with a bias:
gpt-oss). gpt-oss's sinks: a learned logit per query head that joins the softmax's denominator (`sinks`)."""

from __future__ import annotations

import torch
import torch.nn as nn

from llmserve.model.attention import AttentionMetadata, paged_attention
from llmserve.model.config import ModelConfig
from llmserve.model.kernels import ops
from llmserve.model.layers.cache_kinds import FullAttention, SlidingWindow
from llmserve.model.layers.linear import Linear
from llmserve.model.layers.norms import RMSNorm
from llmserve.model.layers.rotary import Rotary


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.attn_sinks else None
        self.scale = cfg.attn_scale or self.head_dim**-0.5
        # per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2: one norm across all heads)
        self.norm_width = None if not cfg.qk_norm else self.q_size if cfg.qk_norm_whole else self.head_dim
        self.q_norm = RMSNorm(self.norm_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        kv_width = self.kv_size if cfg.qk_norm_whole else self.head_dim
        self.k_norm = RMSNorm(kv_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.window, self.softcap = window, cfg.attn_softcap
        self.all_reduce = None  # tensor parallelism: sums the row-parallel o_proj partials

    def cache_kind(self, kv_heads: int, kv_dtype: torch.dtype) -> FullAttention:
        """Every position's keys and values, or the last `window` positions' where a window is in effect."""
        if self.window is not None:
            return SlidingWindow(kv_heads, self.head_dim, kv_dtype, self.window)
        return FullAttention(kv_heads, self.head_dim, kv_dtype)

    def forward(self, x, positions, rotary: Rotary, kv_cache, meta: AttentionMetadata):
        T = x.shape[0]
        if self.window is not None and meta.window is not None:  # the window layers' own blocks
            meta = meta.window
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:  # each head normed on its own (or all of them as one row), before rotary
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.reshape(-1, self.norm_width)).view(T, self.q_size)
            k = self.k_norm(k.reshape(-1, self.k_norm.weight.shape[0])).view(T, self.kv_size)
            qkv = torch.cat([q, k, v], dim=-1)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        written = ops.rotary_write_kv(
            qkv,
            positions,
            rotary.cos,
            rotary.sin,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            k_cache,
            v_cache,
            meta.slot_mapping,
        )
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if not written:
            q, k = rotary(q, k, positions)
        o = paged_attention(
            q,
            k,
            v,
            k_cache,
            v_cache,
            meta,
            self.scale,
            kv_written=written,
            window=self.window,
            softcap=self.softcap,
            sinks=self.sinks,
            bf16_prefill=getattr(self.o_proj, "bf16_attention", False),
        )
        o = self.o_proj(o.reshape(T, self.q_size))
        return o if self.all_reduce is None else self.all_reduce(o)
