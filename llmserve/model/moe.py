"""Routed mixture-of-experts MLP (Mixtral, Qwen3-MoE).

Each token's router logits go through a softmax (float32); the top-k experts are kept, their weights
renormalised to sum to 1 where the model does so (Mixtral always, Qwen3-MoE with `norm_topk_prob`).
Experts run batched per expert: the rows routed to an expert are gathered, go through its gated MLP as
one matmul each (gate/up packed, then down), are scaled by their routing weights and scatter-added
into the output, experts in ascending order as transformers sums them.

Weights: the router `gate.weight` [experts, hidden] and every expert's packed `experts.gate_up_proj`
[experts, 2 * inter, hidden] and `experts.down_proj` [experts, hidden, inter], stacked from the
checkpoint's per-expert tensors by the loader (loader.checkpoint_names). They stay float under
`--quantization` (only nn.Linear layers are quantized; the router is not one either, so routing is
exact).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmserve.model.llama import ModelConfig, act_and_mul


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg.num_experts, cfg.hidden_size)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.top_k, self.renormalize, self.act = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.hidden_act
        self.all_reduce = None   # (tensor parallelism is refused for MoE models: parallel.plan_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)                 # [T, k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)            # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.gate.weight.shape[0]).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start:start + n]
            start += n
            rows = pairs // self.top_k
            h = act_and_mul(F.linear(x.index_select(0, rows), self.experts.gate_up_proj[e]), self.act)
            h = F.linear(h, self.experts.down_proj[e]) * weights.view(-1, 1)[pairs]
            out.index_add_(0, rows, h)
        return out
