"""The model's fused CPU operations, with plain PyTorch equivalents: the model layer's one seam to its kernels.

`llmserve/csrc/` (AVX2 + FMA, one file per concern; built on first use by cpu_ext.py, which also holds the
process-wide settings, `configure` and the GEMM engine, re-exported here) is used for float32 tensors on CPU:
RMSNorm (with the residual add fused in), rotary (with the KV cache write), SiLU-and-mul, decode and prefill
attention read in place from the paged cache, and int8/int4 weight-only matmuls on the packed weights.
Elsewhere (CUDA, bfloat16, no compiler, or `LLMSERVE_CPU_KERNELS=0`) the same functions run as PyTorch ops.

The rest of llmserve calls the functions here (gguf_kernels.py its own) and never the extension itself.
Where each kernel stops and the general path takes over is `KernelConfig` (llmserve/config.py): `configure`
applies an engine's (EngineConfig.kernels) at start-up, for the whole process.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from llmserve.model.kernels import gguf_kernels
from llmserve.model.kernels.cpu_ext import calibrate_gemv as calibrate_gemv
from llmserve.model.kernels.cpu_ext import configure as configure
from llmserve.model.kernels.cpu_ext import cpu_has_int8_dots as cpu_has_int8_dots
from llmserve.model.kernels.cpu_ext import cpu_kernels, gemm_engine, gemm_rows, kernel_config
from llmserve.model.kernels.cpu_ext import fast as _fast
from llmserve.model.kernels.kinds import ProjectionKind

log = logging.getLogger("llmserve.ops")


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T; float32 with fewer rows than `gemm_rows(weight)` through the extension's GEMV (streams
    the weights at ~30 GB/s where at::linear's one-row GEMV gets ~12: the float32 LM head alone is 113 MB a
    step), the GEMM engine from there (`gemm_engine`), on `packed` (the weight in oneDNN's layout,
    `pack_weight`) where given. A packed `weight` itself: oneDNN's matmul at every row count."""
    if weight.is_mkldnn:
        ext = cpu_kernels()
        return ext.gemm(x.float(), weight) if ext is not None else F.linear(x, weight.to_dense())
    ext = _fast(x)
    if ext is not None and x.dim() == 2 and weight.dtype is torch.float32 and weight.device.type == "cpu":
        rows = gemm_rows(weight, packed)
        if x.shape[0] < rows:
            return ext.f32_linear(x, weight, rows)
        return ext.gemm(x, weight if packed is None else packed)
    return F.linear(x, weight)


def pack_weight(weight: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """(`weight` — float32 [N, K], CPU — in oneDNN's blocked layout for its matmul, whether it replaces the plain
    weight), or (None, False) where packing does not apply: KernelConfig.packed_weights False, no extension, a GEMM
    engine other than oneDNN. oneDNN re-lays out a plain weight on every call; packed once, its matmul is 1.3-1.5x
    at 16-64 rows (a 1B model's MLP, SmolLM2's layers) and 2-4x the GEMV (benchmarks/HISTORY.md, stop 28).
    vLLM's CPU backend runs every unquantized linear so. Replaced (True, or auto from `packed_min_elements`): oneDNN
    at every row count, even with the GEMV at one row on a 1B model's shapes. A copy beside the plain weight (auto,
    smaller weights): the GEMV keeps the few rows, whose lead there is oneDNN's call overhead (SmolLM2 one row 19
    vs 22 ms a token), at the copy's bytes (cheap at that size)."""
    on = kernel_config().packed_weights
    if weight.dtype is torch.int8:
        return pack_int8_weight(weight)
    if (
        on is False
        or weight.dtype is not torch.float32
        or weight.device.type != "cpu"
        or weight.dim() != 2
        or weight.is_mkldnn
        or cpu_kernels() is None
        or gemm_engine() != "onednn"
    ):
        return None, False
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 32)
    return packed, on is True or weight.numel() >= kernel_config().packed_min_elements


def vnni_pack(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 weights [N, K] in the AVX-512 VNNI layout [N / 16, K / 4, 16, 4], the int32 sum of each channel's
    values) for q8_vnni_gemm, or None where it does not run: KernelConfig.int8_vnni or int8_gemm off, no extension,
    no VNNI, N not a multiple of 16 or K of 32."""
    ext = cpu_kernels()
    n, k = qweight.shape
    if (
        not (kernel_config().int8_vnni and kernel_config().int8_gemm)
        or ext is None
        or not ext.uses_vnni()
        or qweight.dtype is not torch.int8
        or qweight.device.type != "cpu"
        or n % 16
        or k % 32
    ):
        return None
    q = qweight.detach()
    return q.reshape(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous(), q.sum(1, dtype=torch.int32)


def pack_int8_weight(qweight: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """(int8 weights [N, K] with a scale per channel in oneDNN's blocked layout for its int8 matmul, [K, N]: what
    q8_linear's integer GEMM then runs at every row count, True), or (None, False) where that does not apply:
    KernelConfig.packed_weights or int8_gemm False, a weight under packed_min_elements on auto (SmolLM2's: no
    gain at 16-64 rows, one row 10 vs 7 ms a token, prefill slower), no extension, no oneDNN int8 matmul in this
    torch. A 1B model's int8 decode step at 16 rows 168 -> 111 ms, prefill 10.0 -> 8.6 s (16 x 128 tokens)."""
    k = kernel_config()
    if (
        k.packed_weights is False
        or (k.packed_weights is None and qweight.numel() < k.packed_min_elements)
        or not k.int8_gemm
        or qweight.device.type != "cpu"
        or cpu_kernels() is None
        or not cpu_has_int8_dots()
    ):
        return None, False
    try:
        return torch.ops.onednn.qlinear_prepack(qweight.detach().contiguous(), None), True
    except (AttributeError, RuntimeError) as e:  # a torch without x86's int8 ops
        log.info("int8 weights: oneDNN's packed layout unavailable (%s)", e)
        return None, False


def quantize_int8_per_channel(w: torch.Tensor, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weights, float32 scale per row) with w ~= q * scale[:, None]. `rows` at a time, so the float32
    temporaries of a large table (a 1B model's 100M-value head: 400 MB each) never sit in memory whole."""
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for i in range(0, w.shape[0], rows):
        c = w[i : i + rows].float()
        s = scale[i : i + rows] = (c.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
        q[i : i + rows] = torch.round(c / s[:, None]).clamp(-127, 127)
    return q, scale


def head_screen(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int8 copy of a float32 head that `head_argmax` screens with: (int8 rows, per-row scale,
    per-row largest rounding error), a quarter of the head's bytes."""
    q, scale = quantize_int8_per_channel(weight)
    err = (weight.double() - q.double() * scale.double()[:, None]).abs().amax(dim=1)
    return q, scale, err.float()


def head_argmax(x: torch.Tensor, weight: torch.Tensor, screen) -> torch.Tensor | None:
    """argmax(linear(x, weight), -1) for float32 x, exactly, reading mostly the int8 screen (see
    head_argmax in csrc/linear.cpp: the few vocabulary rows that can win are computed in float32 as the GEMV of
    `linear` computes them, whatever the batch); None where the extension cannot (the
    caller computes the logits). Cheaper at any batch: 64 rows of SmolLM2's head 22 ms vs at::linear's 44."""
    ext = _fast(x)
    if (
        ext is None
        or x.dim() != 2
        or x.shape[-1] % 32
        or weight.dtype is not torch.float32
        or weight.device.type != "cpu"
    ):
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


# caches the extension's attention reads and writes in place (int8: rows with their scale, attention.quantize_kv)
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)


def rotary_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """Rotate the q and k heads of `qkv` [T, width] in place and write each row's K and V into the
    paged cache at its slot; False when the caller must do both."""
    ext = _fast(qkv)
    if (
        ext is None
        or head_dim % 16
        or qkv.stride(-1) != 1
        or cos.dtype != torch.float32
        or k_cache.dtype not in KV_DTYPES
    ):
        return False
    ext.rotary_write_kv_(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot_mapping)
    return True


def sample_rows(logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """One token per row of `logits` [rows, vocab], drawn from softmax(logits / temps) by inverting its
    cumulative sum at u (float64, one per row); -inf entries are never drawn. None without the extension
    (the caller does the same with torch ops)."""
    ext = _fast(logits)
    if ext is None or logits.dim() != 2:
        return None
    return ext.sample_rows(logits.contiguous(), temps.float().contiguous(), u.double().contiguous())


def paged_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> bool:
    """Decode rows' attention read in place from the paged cache into `out` (`sinks`: float32 [H], a logit per
    query head in the softmax's denominator; `window`: only the last `window` positions, the blocks before them
    never read); False when the caller must gather and use SDPA instead."""
    ext = _fast(q)
    if (
        ext is None
        or not kernel_config().in_place_decode
        or q.shape[-1] not in (64, 128)
        or k_cache.dtype not in KV_DTYPES
    ):
        return False
    ext.paged_decode_attention_(out, q, k_cache, v_cache, block_tables, context_lens, scale, sinks, window or 0)
    return True


def paged_prefill_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> bool:
    """One prefill chunk's causal attention (queries `q` [n, H, D] at positions context_len - n ..
    context_len - 1, their K and V already in the cache) read in place from the blocks of `block_table` into
    `out` (`sinks`, `window`: as paged_decode_attention's); False when the caller must use SDPA instead."""
    ext = _fast(q)
    if (
        ext is None
        or not kernel_config().in_place_prefill
        or q.shape[-1] not in (64, 128)
        or k_cache.dtype not in KV_DTYPES
        or block_table.dtype is not torch.int64
        or not block_table.is_contiguous()
        or q.stride(-1) != 1
        or q.stride(-2) != q.shape[-1]
        or out.stride(-1) != 1
        or out.stride(-2) != out.shape[-1]
    ):
        return False
    ext.paged_prefill_attention_(out, q, k_cache, v_cache, block_table, context_len, scale, sinks, window or 0)
    return True


def weight_kernel(kind: str):
    """The extension's matmul over packed `kind` weights ("int4": q4_linear(x, q, scale, min, many_rows);
    "int8": q8_linear(x, q, scale, many_rows, act_bits)), or None without the kernels. Quantized layers
    bind it once and call it on their hot path directly."""
    ext = cpu_kernels()
    if ext is None:
        return None
    return ext.q4_linear if kind == "int4" else ext.q8_linear


_ALL_ROWS = 2**62


def kquant_repack(qtype: int, rows: int) -> bool:
    """Whether a GGUF projection part of type `qtype` (Q4_K, Q6_K, and MXFP4 though not a K-quant) and `rows` rows is
    repacked at load into panels of 16 rows (KernelConfig.kquant_repack, where the VNNI kernels run:
    csrc/gguf_repacked.cpp)."""
    ext = cpu_kernels()
    return (
        ext is not None
        and kernel_config().kquant_repack
        and int(qtype) in (12, 14, 39)
        and rows % 16 == 0
        and ext.uses_vnni()
    )


def int4_vnni(out_features: int) -> bool:
    """Whether int4 weights with `out_features` channels take the VNNI integer GEMM from
    KernelConfig.int4_vnni_rows rows (q4_linear's many-rows path)."""
    ext = cpu_kernels()
    return ext is not None and kernel_config().int4_vnni and out_features % 64 == 0 and ext.uses_vnni()


def decode_layer_args(model) -> list | None:
    """Per layer ([tensors], [kind per projection], [activation bits], [rows from which each projection takes
    its many-rows path]) for the extension's
    decode_layer, or None where a layer does not fit it (see `decode_stack`). A quantized projection
    fits through its `kernel_args()` (llmserve.model.formats.quant's interface)."""
    if cpu_kernels() is None:
        return None
    out = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.all_reduce is not None or mlp.all_reduce is not None or attn.head_dim not in (64, 128):
            return None
        w = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        kinds, bits, many = [], [], []
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            quantized = getattr(lin, "kernel_args", None)
            if quantized is not None:
                args = quantized()
                if args is None:
                    return None
                kinds.append(args[0])
                bits.append(args[1])
                w += args[2]
                from_rows = getattr(lin, "stack_many_rows", None)  # int8's integer GEMM from there (0: packed)
                many.append(_ALL_ROWS if from_rows is None else from_rows)
            elif (
                isinstance(lin, torch.nn.Linear)
                and lin.bias is None
                and lin.weight.dtype == torch.float32
                and lin.weight.device.type == "cpu"
            ):
                # packed in place: oneDNN at every row count; else the GEMV up to the measured crossover, then
                # oneDNN on the packed copy (F32_PACKED) or the plain weight (shapes repeat: measured on the first
                # layer only)
                packed = getattr(lin, "packed", None)
                kinds.append(ProjectionKind.F32 if packed is None else ProjectionKind.F32_PACKED)
                bits.append(0)
                w += [lin.weight] if packed is None else [lin.weight, packed]
                many.append(0 if lin.weight.is_mkldnn else gemm_rows(lin.weight, packed))
            else:
                return None
        if any(t.dtype == torch.float32 and t.device.type != "cpu" for t in w):
            return None
        out.append((w, kinds, bits, many))
    return out


def decode_stack(model):
    """The extension's DecodeStack over `model` (a LlamaModel): every layer's decode_layer in one C++ call,
    `.run(x, kv_caches, positions, slot_mapping, block_tables, context_lens) -> (x, residual)`; None where
    the model does not fit it (no kernels, tensor parallelism, biases, other head sizes or layer kinds)."""
    args = decode_layer_args(model)
    if not args:
        return None
    c = model.cfg
    return cpu_kernels().DecodeStack(
        args,
        c.rms_norm_eps,
        model.rotary.cos,
        model.rotary.sin,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        model.layers[0].self_attn.scale,
    )


def lora_weights(tensors: list[torch.Tensor]):
    """The extension's LoRAWeights (one adapter's weights for DecodeStack.run_lora: per layer and projection
    A^T, B^T, see llmserve.model.lora._fused_weights), or None without the extension."""
    ext = cpu_kernels()
    return None if ext is None else ext.LoRAWeights(tensors)


def lora_linear_add_(x, out, segments, adapters, num_layers: int, layer: int, proj: int, heads: tuple) -> None:
    """out[each adapter's rows] += x[rows] @ A^T @ B^T for projection `proj` (0 qkv, 1 o, 2 gate_up, 3 down)
    of `layer`, in place: the fused stack's LoRA kernel for a module-path step (DecodeStack.run_lora's
    `segments` and `adapters`; `heads`: (heads, KV heads, head size), the qkv parts' widths)."""
    cpu_kernels().lora_linear_add_(x, out, segments, adapters, num_layers, layer, proj, *heads)


def decode_stack_fits(x: torch.Tensor) -> bool:
    """Whether a decode step of rows `x` (decode rows only, one group) may run through a DecodeStack."""
    return kernel_config().in_place_decode and x.shape[0] <= kernel_config().fused_decode_rows and _fast(x) is not None


def gguf_linear(x: torch.Tensor, raw: torch.Tensor, qtype: int, K: int, exact: bool) -> torch.Tensor:
    """x [M, K] @ W.T, float32, W a GGUF tensor's blocks (uint8 [N, row_bytes], llmserve.model.kernels.gguf_kernels):
    `exact` in float32 throughout (W widened, x as it is), otherwise llama.cpp's arithmetic (integer dots
    on the blocks, x rounded to int8 per block)."""
    return gguf_kernels.linear_f32(x, raw, qtype, K) if exact else gguf_kernels.linear(x, raw, qtype, K)


def gguf_dequantize(raw: torch.Tensor, qtype: int, K: int) -> torch.Tensor:
    """float32 [N, K]: the values of a GGUF tensor's blocks (rows of it: embedding look-ups)."""
    return gguf_kernels.dequantize(raw, qtype, K)
