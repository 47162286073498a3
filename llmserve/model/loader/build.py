"""Build the model: dtypes, the memory check, the model of a config's family on the meta device, its
weights loaded from a mapping (under the names its checkpoints give them, renamed per family), quantized
where asked."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from llmserve.config import DTYPE_ALIASES
from llmserve.model.config import ModelConfig
from llmserve.model.formats import bf16
from llmserve.model.formats.quant import is_quantized, quantize_model
from llmserve.model.memory import CGROUP_ROOT, PROC_CGROUP, available_memory
from llmserve.model.registry import arch_spec, make_model

GiB = 1 << 30


class DoesNotFit(ValueError):
    """check_fits' refusal: `needed` and `available` bytes (a server of several models may free some first)."""

    def __init__(self, message: str, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed, self.available = needed, available


# what a load needs beyond its weights and KV cache. On the host (whose available RAM does not count this
# process): activations, the tokenizer and the process itself. Under a cgroup limit (whose headroom is the
# limit less what the process has charged already, ~0.36 GiB for an imported server) the load's own
# transient, measured about as large: the bundled model (0.25 GiB as served) is killed by the kernel
# while it loads under 1100m and serves from 1150m up (deploy/smoke.sh's image, cgroup v1), and this
# allowance refuses the first and admits the second
RUNTIME = GiB // 2


def check_fits(path: str, weights: int, kv_bytes: int, root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> None:
    """Refuse a model whose weights and asked KV cache exceed the memory available now, before allocating:
    the host's available RAM, or what a container's cgroup memory limit leaves where that is less
    (llmserve.model.memory, which reads the cgroup folders at `root` for the cgroups `proc_cgroup` names)."""
    available, limit = available_memory(root, proc_cgroup)
    runtime = RUNTIME
    if weights + kv_bytes + runtime > available:
        where = (
            f"under the cgroup memory limit of {limit.limit / GiB:.2f} GiB, {limit.path}" if limit else "the host's RAM"
        )
        free = "raise the container's memory limit" if limit else "free memory"
        raise DoesNotFit(
            f"model: {path} does not fit in memory: its weights take {weights / GiB:.2f} GiB as served, the KV cache "
            f"{kv_bytes / GiB:.2f} GiB (--kv-cache-memory), the runtime ~{runtime / GiB:.2f} GiB, and "
            f"{available / GiB:.2f} GiB are available ({where}); lower --kv-cache-memory, use a smaller "
            f"quantization (a Q4_K_M file, --quantization int4 for float files), or {free}",
            weights + kv_bytes + runtime,
            available,
        )


class Lazy(Mapping):
    """`source`'s entries named in `names` (a name -> its name in `source`, or None: the same), each read
    when asked."""

    def __init__(self, source: Mapping, names: dict) -> None:
        self.source, self.names = source, names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        return self.source[self.names[name] or name]

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


# -- per-architecture weight names ----------------------------------------------------------------
def checkpoint_names(cfg: ModelConfig, weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """A checkpoint's tensors under the names the model loads (LlamaModel.load_hf_state_dict), still
    read only when asked: the family's renames, then its checkpoint_tensors (gpt-oss's experts split)."""
    spec = arch_spec(cfg.architecture)
    renames = spec.checkpoint_renames
    if renames:
        names = {}
        for k in weights:
            new = k
            for old, repl in renames:
                new = new.replace(old, repl)
            names[new] = k
        weights = Lazy(weights, names)
    return weights if spec.checkpoint_tensors is None else spec.checkpoint_tensors(cfg, weights)


def resolve_dtype(dtype: str, device: torch.device, plain: bool = True) -> torch.dtype:
    """The weights' type. `auto`: bfloat16 on CUDA, and on a CPU with native bfloat16 matmuls (AVX512-BF16
    or AMX: llmserve.model.formats.bf16, as vLLM's CPU build picks) when the model is `plain` (no quantization, LoRA
    or tensor parallelism, whose kernels are float32's); float32 elsewhere."""
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype == "auto":
        native = device.type == "cpu" and plain and bf16.supported()
        return torch.bfloat16 if device.type == "cuda" or native else torch.float32
    return TORCH_DTYPES[dtype]


def activation_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The activations' type for weights in `dtype`: float32 where bfloat16 weights run as llmserve.model.formats.bf16's
    layers (float32 norms, attention, KV cache and sampling around bfloat16 matmuls), else `dtype`."""
    return torch.float32 if bf16.native(dtype, device) else dtype


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """The KV cache's element type: `auto` stores keys and values in the activations' dtype; int8 rows
    carry their scale (llmserve.model.attention.quantize_kv). fp8 (float8 e4m3) only where the hardware has
    FP8 arithmetic, a CUDA GPU of compute capability 8.9+ (Ada, Hopper): no CPU llmserve runs on has it (its
    conversions would be emulated in software), so there int8 is the 8-bit cache."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        if device is None or device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            where = "this CPU" if device is None or device.type != "cuda" else "this GPU"
            raise ValueError(
                f"kv_cache_dtype: fp8 needs FP8 hardware (a CUDA GPU of compute capability 8.9+); {where} has "
                "none: use --kv-cache-dtype int8 (a scale per token and head)"
            )
        return torch.float8_e4m3fn
    if kv_cache_dtype == "int8":
        return torch.int8
    return TORCH_DTYPES[DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)]


def build_model(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    quantization: str | None = None,
    model: nn.Module | None = None,
) -> nn.Module:
    """The model of `cfg` (its family's model class, registry.make_model) holding `weights` (Hugging Face
    names, after the family's checkpoint_renames), on `device` in `dtype`, ready for inference; with
    `quantization` (int8 | int4) its projections and embedding hold quantized weights. `weights` may be a
    mapping that reads each tensor when asked.
    `model`: one already built on the meta device whose quantized layers were made already (a GGUF file's
    blocks, or rounded as read): only its other tensors are made and loaded from `weights`."""
    if model is None:
        with torch.device("meta"):
            model = make_model(cfg, max_positions)
    _materialize(model)
    # each tensor copied (and widened) into its float32 parameter (`weights` under the model's names already:
    # checkpoint_names, which renaming twice would break where renames chain, GLM-4's norms)
    model.load_hf_state_dict(weights)
    if any(is_quantized(m) for m in model.modules()):
        for p in model.parameters():  # (CPU) the float layers only: the adopted ones keep their formats
            p.data = p.data.to(dtype)
    else:  # (a vision tower stays float32: `keep_float32`)
        for child in model.children():
            child.to(device=device, dtype=torch.float32 if getattr(child, "keep_float32", False) else dtype)
    model.make_rotary(max_positions, device)  # float32 tables, whatever the dtype
    model = model.eval().requires_grad_(False)
    if quantization:
        del weights
        quantize_model(model, quantization)  # the layers no GGUF block covered: rounded from float32
        release_freed_memory()  # the float32 copies: ~270 MiB of resident memory for SmolLM2
    if bf16.native(dtype, device):  # bfloat16 weights in oneDNN's layout, float32 activations around them
        bf16.to_bf16(model)
        release_freed_memory()
    return model


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _materialize(model: nn.Module) -> None:
    """Real (uninitialised) float32 CPU tensors for the meta ones; tensors already real are kept
    (Module.to_empty would replace those too)."""
    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for k, t in table.items():
                if t is not None and t.device.type == "meta":
                    real = torch.empty_like(t, device="cpu", dtype=torch.float32 if t.is_floating_point() else t.dtype)
                    table[k] = nn.Parameter(real, requires_grad=False) if table is m._parameters else real


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc keeps it otherwise); a no-op elsewhere."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
