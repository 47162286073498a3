"""Where the model runs: in this process (`LocalExecutor`), or split over tensor-parallel ranks
(`engine/tp.py`'s `TensorParallel`). The engine talks to either through the same methods:

    kv_bytes_per_block(block_size, dtype)   one KV block's bytes (per rank)
    load_model(source, reader, dtype, max_positions, kv_bytes)   the model (rank 0's shard)
    local_only()                            a context: rank 0 alone (activation profiling)
    attach(runner, num_blocks, block_size)  the runner is ready (the workers make their KV pools)
    shutdown()                              workers stopped; a no-op in one process
"""

from __future__ import annotations

import contextlib

import torch

from llmserve.engine.runner import kv_bytes_per_block
from llmserve.model.config import ModelConfig
from llmserve.model.loader import load_model


class LocalExecutor:
    """The whole model in this process."""

    world_size = 1

    def __init__(self, config, mc: ModelConfig, device: torch.device) -> None:
        self.config = config
        self.mc = mc
        self.device = device

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return kv_bytes_per_block(self.mc, block_size, dtype)

    def load_model(self, source, reader, dtype: torch.dtype, max_positions: int, kv_bytes: int):
        q = self.config.quantization
        return load_model(source, self.mc, reader, self.device, dtype, max_positions, q, kv_bytes=kv_bytes)

    def local_only(self):
        return contextlib.nullcontext()

    def attach(self, runner, num_blocks: int, block_size: int) -> None:
        pass

    def shutdown(self) -> None:
        pass


def make_executor(config, mc: ModelConfig, device: torch.device):
    """LocalExecutor, or TensorParallel with --tensor-parallel-size > 1 (it plans the split, or refuses
    it, and starts the workers)."""
    if config.tensor_parallel_size > 1:
        from llmserve.engine.tp import TensorParallel

        return TensorParallel(config, mc)
    return LocalExecutor(config, mc, device)
