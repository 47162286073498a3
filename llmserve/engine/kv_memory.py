"""What the KV cache may take on this machine, measured for the plan (kv_plan.Memory): on CPU the memory this
process may still take (llmserve.model.memory: the host's, or less under a container's limit), on CUDA the
device's free memory and the activations' peak of one forward (`profile_activations`)."""

from __future__ import annotations

import torch

from llmserve.engine.kv_plan import Memory, RecurrentState, layer_kinds
from llmserve.engine.state_pool import StatePool
from llmserve.model.attention import AttentionMetadata, PrefillChunk, StateMetadata, kv_cache_shape
from llmserve.model.memory import available_memory


def measure_memory(config, device: torch.device, profile) -> Memory:
    """Nothing where --num-kv-blocks or --kv-cache-memory decides; CUDA: --gpu-memory-utilization's share less
    other processes' use, and `profile()` (the activations' peak); CPU: the available memory."""
    if config.num_kv_blocks is not None or config.kv_cache_memory is not None:
        return Memory(device.type)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return Memory("cuda", int(total * config.gpu_memory_utilization) - (total - free), profile())
    available, limit = available_memory()
    return Memory("cpu", available, 0, limit)


@torch.inference_mode()
def profile_activations(model, n: int, block_size: int, kv_dtype: torch.dtype, device: torch.device) -> int:
    """CUDA: peak memory of one forward of `n` prompt tokens (without KV), with a margin."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    mc = model.cfg  # this rank's head counts under tensor parallelism
    nb = (n + block_size - 1) // block_size
    shape = kv_cache_shape(nb, block_size, mc.num_kv_heads, mc.head_dim, kv_dtype)
    cache = torch.zeros(shape, dtype=kv_dtype, device=device)
    ids = torch.zeros(n, dtype=torch.long, device=device)
    pos = torch.arange(n, device=device)
    meta = AttentionMetadata(slot_mapping=pos, prefills=[PrefillChunk(0, n, n, torch.arange(nb, device=device))])
    caches = [cache] * mc.num_layers
    kinds = layer_kinds(model, mc.num_kv_heads, kv_dtype, torch.float32)
    shapes = [k.shapes if isinstance(k, RecurrentState) else None for k in kinds]
    if any(s is not None for s in shapes):  # a hybrid model's recurrent layers: one fresh state slot each
        one = StatePool(1, shapes)
        caches = [cache if s is None else one.tensors(i, torch.float32, device) for i, s in enumerate(shapes)]
        flags = torch.ones(1, dtype=torch.bool, device=device)
        meta.states = StateMetadata(torch.zeros(1, dtype=torch.long, device=device), [0], [0], [n], flags)
    model(ids, pos, caches, meta, torch.tensor([n - 1], device=device))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del cache
    torch.cuda.empty_cache()
    return int(peak * 1.2)
