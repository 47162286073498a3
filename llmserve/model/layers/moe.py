"""Routed mixture-of-experts MLP (Mixtral, Qwen3-MoE, gpt-oss).

Each token's router logits go through a softmax (float32); the top-k experts are kept, their weights
renormalised to sum to 1 where the model does so (Mixtral always, Qwen3-MoE with `norm_topk_prob`). gpt-oss
(`router_topk_softmax`): the router has a bias, the top-k logits are kept and their softmax is the weights;
its experts' projections have biases and its activation is the clamped SwiGLU (layers.mlp).
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
    def __init__(self, num_experts: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg.num_experts, cfg.hidden_size, cfg.router_bias)
        expert = dataclasses.replace(cfg, intermediate_size=cfg.moe_intermediate_size, mlp_bias=cfg.expert_bias)
        self.experts = nn.ModuleList(MLP(expert) for _ in range(cfg.num_experts))
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.topk_softmax = cfg.router_topk_softmax
        self.all_reduce = None  # (tensor parallelism is refused for MoE models: parallel.plan_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gate.weight, self.gate.bias)
        if self.topk_softmax:  # (gpt-oss) the softmax of the top-k logits
            top, chosen = logits.topk(self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1, dtype=top.dtype)
        else:
            weights, chosen = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(self.top_k, dim=-1)  # [T, k]
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
