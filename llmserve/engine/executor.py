"""Where the model runs: in this process (`LocalExecutor`), or split over tensor-parallel ranks
(`engine/tp.py`'s `TensorParallel`). The executor owns the runner; the engine talks to either through the
same methods:

    kv_heads                                the KV heads one rank holds (the largest share): what a block costs
    load_model(source, reader, dtype, max_positions, kv_bytes)   the model (rank 0's shard)
    local_only()                            a context: rank 0 alone (activation profiling)
    start(model, plan, dtype, kv_dtype, lora)   the runner, with the KV tensors of the plan (and the workers')
    execute(sched, argmax)                  one step: the sampled tokens (the workers run it too)
    shutdown()                              workers stopped; a no-op in one process
"""

from __future__ import annotations

import contextlib

import torch

from llmserve.engine.kv_plan import KVPlan
from llmserve.engine.outputs import SampledTokens, SchedulerOutput
from llmserve.engine.runner import ModelRunner
from llmserve.model.config import ModelConfig
from llmserve.model.loader import LoadRequest, load_model


class LocalExecutor:
    """The whole model in this process."""

    world_size = 1

    def __init__(self, config, mc: ModelConfig, device: torch.device) -> None:
        self.config = config
        self.mc = mc
        self.device = device
        self.kv_heads = mc.num_kv_heads
        self.runner: ModelRunner | None = None

    def load_model(self, source, reader, dtype: torch.dtype, max_positions: int, kv_bytes: int):
        q = self.config.quantization
        return load_model(LoadRequest(source, self.mc, reader, self.device, dtype, max_positions, q, kv_bytes))

    def local_only(self):
        return contextlib.nullcontext()

    def start(self, model, plan: KVPlan, dtype: torch.dtype, kv_dtype: torch.dtype, lora=None) -> ModelRunner:
        self.runner = ModelRunner(model, plan, self.device, dtype, kv_dtype, lora)
        return self.runner

    def execute(self, sched: SchedulerOutput, argmax: bool = False) -> list[SampledTokens]:
        return self.runner.execute(sched, argmax=argmax)

    def shutdown(self) -> None:
        pass


def make_executor(config, mc: ModelConfig, device: torch.device):
    """LocalExecutor, or TensorParallel with --tensor-parallel-size > 1 (it plans the split, or refuses
    it, and starts the workers)."""
    if config.tensor_parallel_size > 1:
        from llmserve.engine.tp import TensorParallel

        return TensorParallel(config, mc)
    return LocalExecutor(config, mc, device)
