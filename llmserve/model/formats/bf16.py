"""bfloat16 weights with float32 activations: `--dtype bfloat16` on a CPU with AVX512-BF16 (or AMX).

Decode reads every weight once a step: bfloat16 halves the bytes of float32, and oneDNN's bf16 matmul
(`vdpbf16ps`, what vLLM's CPU build and OpenVINO's CPU plugin compute in) runs about 2x the best float32
path at every row count on such CPUs (BENCHMARKS.md, "bfloat16"). Only the projections and the LM head
hold bfloat16: each call rounds its input rows to bfloat16 and widens the output back (bfloat16 rows in stay
bfloat16 out: the MLP keeps its intermediate so), so norms, rotary, attention, sampling and the KV cache keep
llmserve's float32 kernels (and their accuracy). The embedding
table is bfloat16 rows, widened as looked up (one copy when tied to the head).

The interface (the loader, the model's weight packing and ops.decode_layer_args read it):
  * `supported()`: whether this CPU runs bfloat16 matmuls natively (else `--dtype auto` stays float32);
  * `to_bf16(model)`: replace a float model's Linear layers and embedding in place;
  * `BF16Linear`: a drop-in for nn.Linear (`forward`, `in_features`, `out_features`, `weight`: the plain
    bfloat16 [N, K]), `dequantize()` (float32), `kernel_args()` (how the fused decode stack reads it);
  * `BF16Embedding`: a drop-in for nn.Embedding.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmserve import envs
from llmserve.model.kernels.kinds import ProjectionKind


def supported() -> bool:
    """Native bfloat16 dot products on this CPU (AVX512-BF16 or AMX), as oneDNN reports them, and not turned
    off (LLMSERVE_CPU_BF16=0); or the portable twin asked for (LLMSERVE_CPU_BF16=emulate)."""
    return emulated() or (bool(envs.LLMSERVE_CPU_BF16) and _cpu_has_bf16())


def emulated() -> bool:
    """LLMSERVE_CPU_BF16=emulate: the bfloat16 mode runs its portable twin (PyTorch's bfloat16 matmul: bfloat16
    rows and weights, products summed in float32, the output rounded to bfloat16; the same rounding as oneDNN's
    `vdpbf16ps` / AMX path up to the order of the sums) on any CPU, so the default path of bf16 CPUs is tested
    on every CPU. Slower: for tests."""
    return envs.LLMSERVE_CPU_BF16 == "emulate"


def prefill_attention() -> bool:
    """Whether a bfloat16 model's long fresh prompt chunk attends in bfloat16 (paged_attention's bf16_prefill):
    LLMSERVE_BF16_ATTENTION, by default where the CPU has AMX-BF16 tiles, the one kind where SDPA's bfloat16 beats
    llmserve's float32 flash kernel (envs.py has the figures)."""
    asked = envs.LLMSERVE_BF16_ATTENTION
    return asked == "1" or asked == "auto" and _cpu_has_amx_bf16()


@functools.cache
def _cpu_has_amx_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False


@functools.cache
def _cpu_has_bf16() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def native(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model served in `dtype` on `device` runs as this module's layers (bfloat16 weights, float32
    activations): bfloat16 on a CPU that has native bfloat16 matmuls."""
    return dtype is torch.bfloat16 and device.type == "cpu" and supported()


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` (bfloat16 [N, K]) in oneDNN's blocked layout for its bf16 matmul, or None without it."""
    if not supported() or emulated() or weight.device.type != "cpu":
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 32)
    except RuntimeError:
        return None


def _rows_bf16(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype is torch.bfloat16 else x.to(torch.bfloat16)


class BF16Linear(nn.Module):
    """A Linear holding bfloat16 weights in oneDNN's layout (the plain [N, K] weight is not kept beside it:
    `weight` reads it back); rows of any float type in, rows of the input's type out."""

    bf16_rows = True  # bfloat16 rows in give bfloat16 rows out, unwidened (the MLP keeps its intermediate so)

    @property
    def bf16_attention(self) -> bool:
        """Whether the attention before this layer (an o_proj, whose matmul rounds its rows to bfloat16 anyway) takes
        a long fresh prompt chunk in bfloat16 (prefill_attention)."""
        return prefill_attention()

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().to(torch.bfloat16).contiguous()
        self.packed = _pack(w)
        self._plain = w if self.packed is None else None
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @property
    def weight(self) -> torch.Tensor:
        """The bfloat16 [N, K] weight (read back from the packed layout: a copy)."""
        return self._plain if self._plain is not None else self.packed.to_dense()

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self.packed is not None and x2.shape[0] > 0:
            y = torch.ops.mkldnn._linear_pointwise(_rows_bf16(x2).contiguous(), self.packed, None, "none", [], "")
        else:  # the portable twin (no native bf16, emulated, or no rows): at::linear in bfloat16
            y = F.linear(_rows_bf16(x2), self.weight)
        y = y.to(x.dtype)
        if self.bias is not None:
            y += self.bias
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def kernel_args(self) -> tuple[ProjectionKind, int, list[torch.Tensor]] | None:
        """(BF16, 0, [packed weight]): this layer as the fused decode stack reads it (emulated: the plain weight,
        which the stack multiplies through at::linear in bfloat16, the twin's arithmetic); None with a bias, or
        without native bfloat16 and not emulated."""
        if self.bias is not None:
            return None
        if self.packed is None:
            return (ProjectionKind.BF16, 0, [self._plain]) if emulated() else None
        return ProjectionKind.BF16, 0, [self.packed]

    def extra_repr(self) -> str:
        return f"bfloat16, in_features={self.in_features}, out_features={self.out_features}"


class BF16Embedding(nn.Module):
    """Embedding rows held as bfloat16, looked up as float32."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach().to(torch.bfloat16).contiguous())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids].float()


def to_bf16(model: nn.Module) -> int:
    """Replace every float nn.Linear and nn.Embedding of `model` (CPU) in place, and widen its other float
    tensors (norms, biases) to float32: the activations' type. Quantized layers are left as they are. Returns
    how many layers were replaced."""
    replaced = 0

    def convert(module: nn.Module) -> None:
        nonlocal replaced
        for name, child in list(module.named_children()):
            if getattr(child, "keep_float32", False):  # a vision tower: float32 (llmserve.model.vision)
                continue
            if isinstance(child, nn.Linear) and child.weight.is_floating_point():
                setattr(module, name, BF16Linear(child.weight, child.bias))
                replaced += 1
            elif type(child) is nn.Embedding:
                setattr(module, name, BF16Embedding(child.weight))
                replaced += 1
            else:
                convert(child)

    with torch.no_grad():
        convert(model)
        for m in model.modules():
            for table in (m._parameters, m._buffers):
                for k, t in table.items():
                    if (
                        t is not None
                        and t.is_floating_point()
                        and t.dtype is torch.bfloat16  # (an int4 layer's float16 scales stay as its kernels read them)
                        and not (isinstance(m, (BF16Linear, BF16Embedding)) and k == "weight")
                    ):
                        table[k] = nn.Parameter(t.float(), requires_grad=False) if table is m._parameters else t.float()
    return replaced
