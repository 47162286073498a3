"""Engine configuration: one dataclass, one source of truth for every flag the engine takes.

Flag names follow vLLM's (`max_num_seqs`, `max_num_batched_tokens`, `block_size`, ...) so that users
can carry their knowledge over.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields


@dataclass
class EngineConfig:
    model: str | None = None              # None: the bundled SmolLM2-135M-Instruct GGUF
    served_model_name: str | None = None
    dtype: str = "auto"                   # auto | float32 | bfloat16 | float16
    device: str = "auto"                  # auto | cpu | cuda
    quantization: str | None = None       # None/"none" | int8 | int4
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None   # default: 512 on CPU, 2048 on CUDA
    max_model_len: int | None = None      # default: the model's, capped by the KV pool
    kv_cache_memory: float | None = None  # GiB for the KV pool (CPU default: a share of free RAM)
    kv_cache_dtype: str = "auto"          # auto (= dtype) | float32 | float16 | bfloat16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None      # exact pool size; overrides the memory budget (tests)
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"       # fcfs | priority
    max_queued_requests: int | None = None
    swap_space: float = 0.0
    num_threads: int | None = None        # torch intra-op threads (default: the cores)
    seed: int = 0
    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None   # TP rendezvous (tcp://HOST:PORT, env://); default: local
    speculative_ngram: int = 0
    enforce_eager: bool = True            # vLLM compatibility only: always eager (no compile/CUDA graphs)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens: must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len: must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp16", "fp32"):
            raise ValueError(f"dtype: unknown dtype {self.dtype!r} (auto, float32, bfloat16, float16)")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp16",
                                       "fp32"):
            raise ValueError(f"kv_cache_dtype: unknown dtype {self.kv_cache_dtype!r} "
                             "(auto, float32, float16, bfloat16)")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy: must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.quantization in ("none", ""):
            self.quantization = None
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization: must be none, int8 or int4, got {self.quantization!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        if self.quantization and self.tensor_parallel_size > 1:
            raise ValueError("quantization: int8/int4 weights are not supported with tensor_parallel_size > 1 yet")
        if self.speculative_ngram < 0:
            raise ValueError(f"speculative_ngram: must be >= 0, got {self.speculative_ngram}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("max_queued_requests: must be >= 0")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def resolved_num_threads(self) -> int:
        return self.num_threads or len(os.sched_getaffinity(0))
