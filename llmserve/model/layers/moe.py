"""Routed mixture-of-experts MLP (Mixtral, Qwen3-MoE).

Each token's router logits go through a softmax (float32); the top-k experts are kept, their weights
renormalised to sum to 1 where the model does so (Mixtral always, Qwen3-MoE with `norm_topk_prob`).
Experts run batched per expert: the rows routed to an expert are gathered, go through its gated MLP (the
`MLP` layer: one matmul for gate/up, one for down), are scaled by their routing weights and
scatter-added into the output, experts in ascending order as transformers sums them.

Weights: the router `gate.weight` [experts, hidden] and each expert's `experts.N.gate_proj / up_proj /
down_proj` (Qwen3-MoE's names; the loader renames Mixtral's w1 / w3 / w2: its spec's
checkpoint_renames, llmserve.model.registry), packed into
`experts.N.gate_up_proj` as any MLP's. The experts are ordinary Linear layers, so `--quantization`
quantizes them too; the router is not one and stays float (routing is not perturbed).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmserve.model.config import ModelConfig
from llmserve.model.layers.mlp import MLP


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg.num_experts, cfg.hidden_size)
        expert = dataclasses.replace(cfg, intermediate_size=cfg.moe_intermediate_size, mlp_bias=False)
        self.experts = nn.ModuleList(MLP(expert) for _ in range(cfg.num_experts))
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.all_reduce = None  # (tensor parallelism is refused for MoE models: parallel.plan_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype).view(-1, 1)
        flat = chosen.view(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, n in zip(self.experts, counts):
            if n == 0:
                continue
            pairs = order[start : start + n]
            start += n
            rows = pairs // self.top_k
            out.index_add_(0, rows, expert(x.index_select(0, rows)) * weights[pairs])
        return out
