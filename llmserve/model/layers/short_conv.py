"""LFM2's gated short convolution, the recurrent mixer of its conv layers: in_proj splits each row into (b, c, x);
a depthwise causal convolution of width `kernel` runs over b * x along the sequence; c gates its output;
out_proj. What a sequence carries from step to step (its state) is its last kernel - 1 inputs b * x.

The layer reads and writes its sequences' states in the slots the step's `StateMetadata` names
(engine/state_pool.py): the decode rows (one token per sequence) all at once (their slots gathered, one window
product, scattered back), each prefill chunk as one convolution over its state and its rows, whose last
kernel - 1 inputs become the state the next chunk or decode step starts from."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmserve.model.attention import AttentionMetadata
from llmserve.model.config import ModelConfig
from llmserve.model.layers.cache_kinds import RecurrentState
from llmserve.model.layers.linear import Linear


class ShortConv(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, self.kernel = cfg.hidden_size, cfg.conv_kernel
        self.in_proj = Linear(h, 3 * h, bias=cfg.conv_bias)
        # (a Conv1d for its checkpoint layout, [hidden, 1, kernel]: the weights are read, never called as a module)
        self.conv = nn.Conv1d(h, h, self.kernel, groups=h, bias=cfg.conv_bias)
        self.out_proj = Linear(h, h, bias=cfg.conv_bias)

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """One sequence's state: its last kernel - 1 inputs to the convolution, [kernel - 1, hidden]."""
        return ((self.kernel - 1, self.conv.in_channels),)

    def cache_kind(self, state_dtype: torch.dtype) -> RecurrentState:
        return RecurrentState(self.state_shapes(), state_dtype)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden]: the step's rows (decodes first); state: ([slots, kernel - 1, hidden],)."""
        (cache,) = state
        seqs, keep = meta.states, self.kernel - 1
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        bx = b * h
        w = self.conv.weight.squeeze(1).to(bx.dtype)  # [hidden, kernel]
        out = torch.empty_like(bx)
        nd = seqs.num_decodes
        if nd:  # every decode row at once: its window is its slot's inputs and its own
            slots = seqs.slots[:nd]
            window = torch.cat([cache.index_select(0, slots), bx[:nd].unsqueeze(1)], dim=1)  # [nd, kernel, hidden]
            out[:nd] = (window * w.t()).sum(1)
            cache.index_copy_(0, slots, window[:, 1:].to(cache.dtype))
        for i in range(nd, len(seqs.slot_list)):  # each prefill chunk after its state (zeros when fresh)
            s, n, slot = seqs.query_start[i], seqs.query_len[i], seqs.slot_list[i]
            run = torch.cat([cache[slot].to(bx.dtype), bx[s : s + n]])  # [keep + n, hidden]
            out[s : s + n] = F.conv1d(run.t().unsqueeze(0), w.unsqueeze(1), groups=w.shape[0])[0].t()
            cache[slot] = run[run.shape[0] - keep :]
        if self.conv.bias is not None:
            out = out + self.conv.bias.to(out.dtype)
        return self.out_proj(c * out)
