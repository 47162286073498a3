"""What a layer keeps between steps, its cache kind, as the layer declares it (`layer.cache_kind(...)`); the KV plan
(llmserve/engine/kv_plan.py) prices each kind and decides the budget from them.

    FullAttention(kv_heads, head_dim, dtype)           keys and values of every position, in paged blocks
    SlidingWindow(kv_heads, head_dim, dtype, window)   the same, but only the last `window` positions are read:
                                                       its own pool, where passed blocks go back (engine/kv_window.py)
    RecurrentState(shapes, dtype)                      a fixed-size state per sequence (engine/state_pool.py), no blocks

Every decoder layer has `cache_kind(kv_heads, kv_dtype, state_dtype) -> LayerKind`: `kv_heads` the KV heads a rank
holds, `kv_dtype` the KV cache's dtype, `state_dtype` a recurrent state's (the engine's choices, not the layer's)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmserve.model.attention import kv_row_width


@dataclass(frozen=True)
class FullAttention:
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def block_bytes(self, block_size: int) -> int:
        """One block of this layer's keys and values (an int8 cache's rows with their scales)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * block_size * self.kv_heads * kv_row_width(self.head_dim, self.dtype) * elem


@dataclass(frozen=True)
class SlidingWindow(FullAttention):
    window: int = 0


@dataclass(frozen=True)
class RecurrentState:
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype

    def slot_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(math.prod(s) * elem for s in self.shapes)


LayerKind = FullAttention | SlidingWindow | RecurrentState
