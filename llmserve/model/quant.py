"""Weight-only quantization: `--quantization int8 | int4`.

int8: weights rounded to int8 per output channel (symmetric). int4: weights rounded to 4 bits per group
of 32 inputs (asymmetric: min + scale * q, GGUF Q4_1's grid, so the bundled Q4_1 model keeps its own
values); the LM head stays int8, as llama.cpp keeps its output tensor at 6-8 bits. The embedding table
is int8 rows with a scale per row.

The kernel (CPU): fbgemm's packed float16 GEMM (`quantized::linear_dynamic_fp16`: float32 activations
and accumulation, weights widened inside the kernel). Measured on this 2-core AVX2 machine
(BENCHMARKS.md, "Weight kernels"), it is the fastest accurate choice torch offers: 1.3-4.5x faster than
the float32 matmul, while torch's weight-only int8/int4 kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`) are 2-35x slower than float32 and fbgemm's int8 GEMM quantizes
activations per tensor to 7 bits, which costs this model 3.7x in perplexity. So the rounded values are
held as float16 (exact for int4; within float16's 11 bits for int8 times its scale): the arithmetic is
the quantized model's, the memory 2 bytes per weight. Elsewhere (CUDA): int8 values and a per-channel
scale, widened per call, the scale applied to the output.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

GROUP_SIZE = 32


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weights, float32 scale per row) with w ~= q * scale[:, None]."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def fake_quantize_int4(w: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """w rounded to a 4-bit grid per group of `group_size` inputs: min + scale * q, q in 0..15."""
    out_features, in_features = w.shape
    if in_features % group_size:
        raise ValueError(f"quantization: int4 needs input sizes divisible by {group_size}, got {in_features}")
    g = w.float().reshape(out_features, in_features // group_size, group_size)
    lo = g.amin(dim=-1, keepdim=True)
    scale = ((g.amax(dim=-1, keepdim=True) - lo) / 15.0).clamp(min=1e-10)
    q = torch.round((g - lo) / scale).clamp(0, 15)
    return (lo + q * scale).reshape(out_features, in_features)


class QuantLinear(nn.Module):
    """A Linear whose weights are rounded to int8 (per channel) or int4 (per group) values.

    CPU: the rounded weights go into fbgemm's packed float16 GEMM (`quantized::linear_dynamic_fp16`:
    float32 activations and accumulation, float16 weights widened in the kernel). Every int8 value
    times its channel scale is exact to float16's 11 bits, so the arithmetic is the quantized model's;
    the weights take 2 bytes each. Elsewhere (CUDA): int8 values and a per-channel scale, widened per
    call, the scale applied to the output."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.fbgemm = weight.device.type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines
        if self.fbgemm:
            with warnings.catch_warnings():   # torch.ao is deprecated; its fbgemm kernels are not gone
                warnings.simplefilter("ignore")
                self._packed = torch.ops.quantized.linear_prepack_fp16(
                    weight.float().contiguous(), None if bias is None else bias.float())
            self.register_buffer("qweight", None)
        else:
            q, scale = quantize_int8_per_channel(weight)
            self.register_buffer("qweight", q)
            self.register_buffer("scale", scale.to(weight.dtype))
            self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fbgemm:
            shape = x.shape
            y = torch.ops.quantized.linear_dynamic_fp16(x.reshape(-1, self.in_features).float(), self._packed)
            return y.reshape(*shape[:-1], self.out_features).to(x.dtype)
        y = F.linear(x, self.qweight.to(x.dtype)) * self.scale
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int8Embedding(nn.Module):
    """Embedding rows held as int8 with one scale per row."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        q, scale = quantize_int8_per_channel(weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale.to(weight.dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].to(self.scale.dtype) * self.scale[ids].unsqueeze(-1)


def quantize_model(model: nn.Module, mode: str) -> nn.Module:
    """Replace every Linear (and the embedding) of `model` in place; float weights are freed."""
    if mode not in ("int8", "int4"):
        raise ValueError(f"quantization: must be none, int8 or int4, got {mode!r}")

    def convert(module: nn.Module) -> None:
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                w = child.weight.detach()
                if mode == "int4" and name != "lm_head":   # the LM head stays int8, as in llama.cpp's Q4 files
                    w = fake_quantize_int4(w)
                else:
                    q, scale = quantize_int8_per_channel(w)
                    w = q.float() * scale[:, None]
                setattr(module, name, QuantLinear(w.to(child.weight.dtype), child.bias))
            elif isinstance(child, nn.Embedding):
                setattr(module, name, Int8Embedding(child.weight.detach()))
            else:
                convert(child)

    with torch.no_grad():
        convert(model)
    return model
