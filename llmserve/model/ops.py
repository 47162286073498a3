"""The model's fused CPU operations, with plain PyTorch equivalents.

`llmserve/csrc/cpu_ops.cpp` (AVX2 + FMA) is compiled on first use with torch's C++ extension
builder (about a minute, cached under ~/.cache/torch_extensions) and used for float32 tensors on
CPU: RMSNorm (with the residual add fused in), rotary (with the KV cache write), SiLU-and-mul, decode
attention read in place from the paged cache, and int8/int4 weight-only matmuls on the packed weights. Elsewhere (CUDA,
bfloat16, no compiler, or `LLMSERVE_CPU_KERNELS=0`) the same functions run as PyTorch ops.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

log = logging.getLogger("llmserve.ops")

_EXT = None
_TRIED = False
IN_PLACE_DECODE = True   # False: decode attention gathers blocks for SDPA (benchmarks/long_context.py compares)
GEMV_ROWS = 64   # float32 x with up to this many rows: the extension's GEMV (faster than at::linear here up to
# ~48 rows: 30 layers' projections at 17 / 32 rows 61 / 82 ms vs 74 / 100; at 64 even)


def cpu_kernels():
    """The compiled extension module, or None where it cannot be used (built once per process)."""
    global _EXT, _TRIED
    if _TRIED:
        return _EXT
    _TRIED = True
    if os.environ.get("LLMSERVE_CPU_KERNELS", "1") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.info("cpu kernels: this CPU lacks AVX2; using PyTorch ops")
        return None
    try:
        from torch.utils.cpp_extension import load
        src = os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc", "cpu_ops.cpp")
        _EXT = load(name="llmserve_cpu_ops", sources=[src], verbose=False,
                    extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
                    extra_ldflags=["-fopenmp"])
    except Exception as e:   # no compiler, no ninja: the PyTorch ops do the same work, slower
        log.warning("cpu kernels: could not build llmserve/csrc/cpu_ops.cpp (%s); using PyTorch ops", e)
        _EXT = None
    return _EXT


def _fast(x: torch.Tensor):
    if x.dtype is not torch.float32 or x.is_cuda:
        return None
    return _EXT if _TRIED else cpu_kernels()


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T; float32 with up to GEMV_ROWS rows through the extension's GEMV (streams the weights at
    ~30 GB/s here where at::linear's gets ~12: the float32 LM head alone is 113 MB a step; at 16 rows,
    four passes, ~18 ms vs at::linear's ~33)."""
    ext = _fast(x)
    if ext is not None and x.dim() == 2 and x.shape[0] <= GEMV_ROWS and weight.dtype is torch.float32 \
            and weight.device.type == "cpu":
        return ext.f32_linear(x, weight, GEMV_ROWS + 1)
    return F.linear(x, weight)


def head_screen(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int8 copy of a float32 head that `head_argmax` screens with: (int8 rows, per-row scale,
    per-row largest rounding error), a quarter of the head's bytes."""
    from llmserve.model.quant import quantize_int8_per_channel
    q, scale = quantize_int8_per_channel(weight)
    err = (weight.double() - q.double() * scale.double()[:, None]).abs().amax(dim=1)
    return q, scale, err.float()


def head_argmax(x: torch.Tensor, weight: torch.Tensor, screen) -> torch.Tensor | None:
    """argmax(linear(x, weight), -1) for float32 x, exactly, reading mostly the int8 screen (see
    head_argmax in cpu_ops.cpp: the few vocabulary rows that can win are computed in float32 as `linear`
    computes them for up to GEMV_ROWS rows, whatever the batch); None where the extension cannot (the
    caller computes the logits). Cheaper at any batch: 64 rows of SmolLM2's head 22 ms vs at::linear's 44."""
    ext = _fast(x)
    if ext is None or x.dim() != 2 or x.shape[-1] % 32 or weight.dtype is not torch.float32 \
            or weight.device.type != "cpu":
        return None
    tokens = ext.head_argmax(x, weight, *screen)
    return None if bool((tokens < 0).any()) else tokens


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ext = _fast(x)
    if ext is not None and x.shape[-1] % 8 == 0:
        return ext.rms_norm(x, weight, eps)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual); the fused kernel writes both in place."""
    ext = _fast(x)
    if ext is not None and x.shape[-1] % 8 == 0 and x.is_contiguous() and residual.is_contiguous():
        ext.add_rms_norm_(x, residual, weight, eps)
        return x, residual
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    ext = _fast(gate_up)
    if ext is not None and (gate_up.shape[-1] // 2) % 8 == 0:
        return ext.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


KV_DTYPES = (torch.float32, torch.float16)   # caches the extension's attention reads and writes in place


def rotary_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    num_heads: int, num_kv_heads: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> bool:
    """Rotate the q and k heads of `qkv` [T, width] in place and write each row's K and V into the
    paged cache at its slot; False when the caller must do both."""
    ext = _fast(qkv)
    if ext is None or head_dim % 16 or qkv.stride(-1) != 1 or cos.dtype != torch.float32 \
            or k_cache.dtype not in KV_DTYPES:
        return False
    ext.rotary_write_kv_(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot_mapping)
    return True


def paged_decode_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> bool:
    """Decode rows' attention read in place from the paged cache into `out`; False when the
    caller must gather and use SDPA instead."""
    ext = _fast(q)
    if ext is None or not IN_PLACE_DECODE or q.shape[-1] not in (64, 128) or k_cache.dtype not in KV_DTYPES:
        return False
    ext.paged_decode_attention_(out, q, k_cache, v_cache, block_tables, context_lens, scale)
    return True


def decode_layer_args(model) -> list | None:
    """Per layer ([tensors], [kind per projection], [activation bits]) for the extension's
    decode_layer, or None where a layer does not fit it (see LlamaModel._fused_decode)."""
    from llmserve.model.quant import QuantLinear
    if cpu_kernels() is None:
        return None
    out = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.all_reduce is not None or mlp.all_reduce is not None or attn.head_dim not in (64, 128):
            return None
        w = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        kinds, bits = [], []
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if isinstance(lin, QuantLinear) and lin._kernel is not None and lin.bias is None:
                kinds.append(4 if lin.kind == "int4" else 8)
                bits.append(lin.act_bits)
                w += [lin.qweight, lin.scale] + ([lin.minv] if lin.kind == "int4" else [])
            elif isinstance(lin, torch.nn.Linear) and lin.bias is None and lin.weight.dtype == torch.float32 \
                    and lin.weight.device.type == "cpu":
                kinds.append(0)
                bits.append(0)
                w.append(lin.weight)
            else:
                return None
        if any(t.dtype == torch.float32 and t.device.type != "cpu" for t in w):
            return None
        out.append((w, kinds, bits))
    return out
