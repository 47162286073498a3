"""GGUF's quantized tensors used as the file holds them: dequantization and matmuls on the raw blocks.

`llmserve/csrc/gguf_*.cpp` (AVX2 + FMA + F16C; the Q4_K / Q6_K dots also in AVX-512 VNNI, chosen at run
time as the other kernels' AVX-512 variants, `LLMSERVE_AVX512=0` keeps AVX2) is compiled into the kernels'
one extension module by cpu_ext.cpu_kernels(), so that the fused decode stack reads GGUF projections too
(`LLMSERVE_CPU_KERNELS=0`, a CPU without AVX2 or no compiler: the NumPy / PyTorch fallbacks below do the same
work, slower). A weight is the tensor's bytes, a uint8 tensor [N, row_bytes] (N output rows, each row K values
in the type's blocks):

* `dequantize(raw, qtype, K)` -> float32 [N, K], bit-exact with `gguf.quants.dequantize`;
* `linear(x, raw, qtype, K, many_rows)` -> x [M, K] @ dequantize(raw).T: below many_rows rows integer dot
  products straight on the blocks (x rounded to int8 per 256 values for the K-quants, per 32 for the
  rest), from many_rows on (and always for F32 / F16 / BF16) weight tiles dequantized to float32 and
  multiplied with at::mm;
* `linear_f32(x, raw, qtype, K)` -> the same product in float32 throughout (activations never rounded):
  few rows dot each weight row widened in L1, many rows the float32 tiles.

Types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS (qtype: a
GGMLQuantizationType, its number or its name). IQ4_NL / IQ4_XS hold 4-bit indices into a table of 16 int8
values, MXFP4 (gpt-oss's experts) 4-bit E2M1 values (doubled in its table: 0 .. 12) with an E8M0 exponent per 32;
their dots run on those signed values (x rounded per 32 / per 256 as llama.cpp's).

One kernel family per block format: Q4_0 / Q4_1 / Q8_0 are llmserve's own int4 / int8 layouts in other bytes, so
their integer dots are `q4_linear` / `q8_linear` (csrc/linear.cpp, VNNI GEMMs included) on the blocks repacked
once (`repack`, `packed_linear`); csrc/gguf_dots.cpp's dots take Q5_0, Q5_1, IQ4_NL, MXFP4, the K-quants and IQ4_XS.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from llmserve.model.kernels import cpu_ext

log = logging.getLogger("llmserve.gguf_kernels")

# GGMLQuantizationType's numbers -> (values per block, bytes per block)
BLOCKS = {
    0: (1, 4),
    1: (1, 2),
    30: (1, 2),
    2: (32, 18),
    3: (32, 20),
    6: (32, 22),
    7: (32, 24),
    8: (32, 34),
    20: (32, 18),
    39: (32, 17),
    10: (256, 84),
    11: (256, 110),
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
    23: (256, 136),
}
NAMES = {
    0: "F32",
    1: "F16",
    30: "BF16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    20: "IQ4_NL",
    39: "MXFP4",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    23: "IQ4_XS",
}
PACKED = {2: "int4", 3: "int4", 8: "int8"}  # Q4_0, Q4_1, Q8_0 -> the packed layout their dots read (`repack`)
# Q4_K / Q6_K / MXFP4 repacked into panels of 16 rows where the VNNI kernels run (`repack_panels`;
# csrc/gguf_repacked.cpp): llmserve's codes for those layouts (csrc/gguf_blocks.h's Q4_K16, Q6_K16, MXFP4_16; not
# GGMLQuantizationTypes), their kinds, and bytes a row per block of so many values
Q4_K16, Q6_K16, MXFP4_16 = 100, 101, 102
REPACKED = {12: ("q4k16", Q4_K16, 256, 148), 14: ("q6k16", Q6_K16, 256, 210), 39: ("mx16", MXFP4_16, 32, 17)}
_REPACKED_KIND = {kind: (code, block, row) for kind, code, block, row in REPACKED.values()}

# x with fewer rows than this: the integer dots (each pass over the weights serving 4 rows of x), more:
# float32 tiles + at::mm, float32-exact but slower at every batch size measured on 8B shapes (one thread:
# 1.4x at 256 to 1024 rows, benchmarks/kernels/gguf_kernels.py), so by default never (as llama.cpp, whose
# prefill also rounds activations to int8); a caller wanting float32-exact prefill passes many_rows.
MANY_ROWS = 1 << 62

_EXT = None
_TRIED = False


class _Kernels:
    """The extension's GGUF functions under this module's names: dequantize, linear, linear_f32, linear_parts."""

    def __init__(self, ext) -> None:
        self.dequantize, self.linear, self.linear_f32 = ext.gguf_dequantize, ext.gguf_linear, ext.gguf_linear_f32
        self.linear_parts, self.uses_avx512 = ext.gguf_linear_parts, ext.gguf_uses_avx512
        self.q4_linear, self.q8_linear, self.packed_part = ext.q4_linear, ext.q8_linear, ext.packed_part
        self.repack_panels = ext.gguf_repack_panels


def gguf_kernels():
    """The compiled GGUF kernels (cpu_ext.cpu_kernels()' module, its gguf_* functions), or None where they cannot
    be used."""
    global _EXT, _TRIED
    if _TRIED:
        return _EXT
    _TRIED = True
    ext = cpu_ext.cpu_kernels()
    if ext is None:
        log.info("gguf kernels: no compiled kernels (see llmserve.model.kernels.cpu_ext); using NumPy / PyTorch")
    _EXT = None if ext is None else _Kernels(ext)
    return _EXT


def qtype_number(qtype) -> int:
    """A GGMLQuantizationType, its number or its name -> its number; ValueError for the unsupported."""
    if isinstance(qtype, str):
        num = next((n for n, name in NAMES.items() if name == qtype.upper()), None)
    else:
        num = int(qtype)
    if num not in BLOCKS:
        raise ValueError(
            f"gguf kernels: unsupported quantization type {qtype!r} (supported: {', '.join(NAMES.values())})"
        )
    return num


def row_bytes(qtype, K: int) -> int:
    """Bytes of one row of K values."""
    num = qtype_number(qtype)
    block, size = BLOCKS[num]
    if K <= 0 or K % block:
        raise ValueError(f"gguf kernels: K = {K} is not a multiple of {NAMES[num]}'s {block}-value blocks")
    return K // block * size


def _check(raw: torch.Tensor, num: int, K: int) -> None:
    if raw.dtype is not torch.uint8 or raw.dim() != 2:
        raise ValueError(f"gguf kernels: raw must be a uint8 tensor [N, row_bytes], got {raw.dtype} {tuple(raw.shape)}")
    if raw.shape[1] != row_bytes(num, K):
        raise ValueError(
            f"gguf kernels: raw has {raw.shape[1]} bytes a row; K = {K} of {NAMES[num]} takes {row_bytes(num, K)}"
        )


def _numpy_dequantize(raw: torch.Tensor, num: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    data = raw.contiguous().numpy()
    if num == 30:  # older gguf packages lack BF16: the upper half of a float32
        w = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        w = quants.dequantize(data, GGMLQuantizationType(num))
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))


def dequantize(raw: torch.Tensor, qtype, K: int) -> torch.Tensor:
    """float32 [N, K]: the values of raw (uint8 [N, row_bytes], GGUF blocks of qtype), as gguf computes them."""
    num = qtype_number(qtype)
    _check(raw, num, K)
    ext = gguf_kernels()
    if ext is not None and raw.device.type == "cpu":
        return ext.dequantize(raw, num, K)
    return _numpy_dequantize(raw.cpu(), num).to(raw.device)


def linear(x: torch.Tensor, raw: torch.Tensor, qtype, K: int, many_rows: int = MANY_ROWS) -> torch.Tensor:
    """x [M, K] @ dequantize(raw).T, float32 [M, N]; fewer than many_rows rows through the integer dots (Q4_0 /
    Q4_1 / Q8_0: `packed_linear` on the blocks repacked here, per call; layers repack once)."""
    num = qtype_number(qtype)
    _check(raw, num, K)
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"gguf kernels: x must be [M, {K}], got {tuple(x.shape)}")
    ext = gguf_kernels()
    if ext is not None and x.dtype is torch.float32 and x.device.type == "cpu" and raw.device.type == "cpu":
        if num in PACKED and x.shape[0] < many_rows:
            return packed_linear(x, *repack(raw, num))
        return ext.linear(x, raw, num, K, many_rows)
    return x.float() @ dequantize(raw, num, K).to(x.device).t()


def repack(raw: torch.Tensor, qtype) -> tuple[str, list[torch.Tensor]]:
    """A Q4_0 / Q4_1 / Q8_0 tensor's blocks in llmserve's packed layout (llmserve.model.formats.quant.QuantLinear's; no
    value changes): ("int4", [q [N, K/2] uint8 nibbles as the blocks hold them, scale and min [N, K/32]
    float16; Q4_0's min is -8 d]) or ("int8", [q [N, K] int8, scale [N, K/32] float32])."""
    num = qtype_number(qtype)
    if num not in PACKED:
        raise ValueError(f"gguf kernels: {NAMES[num]} has no packed layout (Q4_0, Q4_1 and Q8_0 have)")
    data = raw.cpu().numpy()
    rows = data.shape[0]
    b = data.reshape(rows, -1, BLOCKS[num][1])
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
    if num == 8:
        parts = [np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1), d.astype(np.float32)]
    else:
        off = 4 if num == 3 else 2
        m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0] if off == 4 else d * np.float16(-8)
        parts = [np.ascontiguousarray(b[..., off:]).reshape(rows, -1), d, m]
    return PACKED[num], [torch.from_numpy(np.ascontiguousarray(a)) for a in parts]


def repack_panels(raw: torch.Tensor, qtype, K: int) -> tuple[str, list[torch.Tensor]]:
    """A Q4_K / Q6_K / MXFP4 tensor's blocks (rows a multiple of 16) in panels of 16 rows, the same values: ("q4k16" /
    "q6k16" / "mx16", [uint8 [N, K / 256 * 148 / 210, or K / 32 * 17]]), read by `packed_linear` / `packed_dequantize`
    and the fused decode stack (parts Q4_K16 / Q6_K16 / MXFP4_16)."""
    num = qtype_number(qtype)
    if num not in REPACKED:
        raise ValueError(f"gguf kernels: {NAMES[num]} is not repacked into panels (Q4_K, Q6_K and MXFP4 are)")
    _check(raw, num, K)
    return REPACKED[num][0], [gguf_kernels().repack_panels(raw.cpu().contiguous(), num, K)]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] bytes in the Q4 blocks' nibble order -> [N, K] values 0..15."""
    n, half = packed.shape
    g = packed.reshape(n, half // 16, 16)
    return torch.stack([g & 15, g >> 4], dim=2).reshape(n, half * 2)


def packed_dequantize(kind: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """float32 [N, K]: the values of `repack`'s layout (int4: min + scale * q per 32 values; int8: q * scale)."""
    if kind in _REPACKED_KIND:
        code, block, row = _REPACKED_KIND[kind]
        return gguf_kernels().dequantize(tensors[0], code, tensors[0].shape[1] // row * block)
    q, scale = tensors[0], tensors[1].float()
    n = q.shape[0]
    if kind == "int4":
        w = unpack_int4(q).float().reshape(n, scale.shape[1], -1) * scale[..., None] + tensors[2].float()[..., None]
        return w.reshape(n, -1)
    return (q.float().reshape(n, scale.shape[1], -1) * scale[..., None]).reshape(n, -1)


def packed_linear(x: torch.Tensor, kind: str, tensors: list[torch.Tensor], many_rows: int = MANY_ROWS) -> torch.Tensor:
    """x [M, K] @ packed_dequantize(kind, tensors).T, float32: llama.cpp's arithmetic on llmserve's kernels (int4:
    q4_linear, x rounded to int8 per 32 as llama.cpp's Q8_1 blocks (float16 scale and sum), its VNNI GEMM from
    `many_rows` rows; int8: q8_linear's dots with x rounded to int8 per 32, Q8_0 x Q8_0, at every row count)."""
    ext = gguf_kernels()
    if ext is None or x.dtype is not torch.float32 or x.device.type != "cpu":
        return x.float() @ packed_dequantize(kind, tensors).to(x.device).t()
    if kind in _REPACKED_KIND:
        return ext.linear(x, tensors[0], _REPACKED_KIND[kind][0], x.shape[1], MANY_ROWS)
    if kind == "int4":
        return ext.q4_linear(x, *tensors, many_rows if tensors[0].shape[0] % 64 == 0 else MANY_ROWS, True)
    return ext.q8_linear(x, *tensors, MANY_ROWS, 8)


# float32-exact linear_f32: up to this many rows each weight row is widened once in L1 and dotted with every
# row of x (one pass over the weights); more rows go through float32 tiles and at::mm.
F32_FEW_ROWS = 16


def linear_f32(x: torch.Tensor, raw: torch.Tensor, qtype, K: int, few_rows: int = F32_FEW_ROWS) -> torch.Tensor:
    """x [M, K] @ dequantize(raw).T, float32 [M, N], computed in float32 throughout (no activation rounding):
    the values transformers computes from the same file, up to the order of float32 sums."""
    num = qtype_number(qtype)
    _check(raw, num, K)
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"gguf kernels: x must be [M, {K}], got {tuple(x.shape)}")
    ext = gguf_kernels()
    if ext is not None and x.dtype is torch.float32 and x.device.type == "cpu" and raw.device.type == "cpu":
        return ext.linear_f32(x, raw, num, K, few_rows)
    return x.float() @ dequantize(raw, num, K).to(x.device).t()


def from_reader(tensor) -> tuple[torch.Tensor, int, int]:
    """(raw, qtype number, K) of a gguf.GGUFReader tensor, raw read in place from the file's memory map
    (no copy: the kernels never write to it); a 1-D tensor is one row."""
    import warnings

    num = qtype_number(int(tensor.tensor_type))
    K = int(tensor.shape[0])  # GGUF lists the dimensions innermost first
    data = (
        tensor.data.reshape(-1, row_bytes(num, K))
        if tensor.data.dtype == np.uint8
        else tensor.data.reshape(-1, K).view(np.uint8)
    )
    with warnings.catch_warnings():  # the memory map is read-only
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data), num, K


# byte offsets of the float16 scale / min fields in each quantized block
_HALF_FIELDS = {
    2: (0,),
    3: (0, 2),
    6: (0,),
    7: (0, 2),
    8: (0,),
    20: (0,),
    10: (80, 82),
    11: (108,),
    12: (0, 2),
    13: (0, 2),
    14: (208,),
    23: (0,),
}


def random_blocks(qtype, n: int, k: int, seed: int = 0, d_max: float = 0.05) -> torch.Tensor:
    """n rows of k values of qtype as random blocks, uint8 [n, row_bytes] (tests and benchmarks): random
    bytes, the float16 scale fields set to finite values of either sign (|d| in [d_max / 500, d_max), 2% of
    them subnormal; MXFP4's exponents: see below); F32 / F16 / BF16: normal values."""
    num = qtype_number(qtype)
    rng = np.random.default_rng(seed)
    if num in (0, 1, 30):
        w = torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32))
        return w.to({0: torch.float32, 1: torch.float16, 30: torch.bfloat16}[num]).view(torch.uint8)
    block, size = BLOCKS[num]
    data = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    if num == 39:  # MXFP4: E8M0 exponents around 2^-5 .. 2^-3 (doubled values up to 12), 2% of them 0 or 1 (subnormal)
        e = rng.integers(121, 125, (n, k // block)).astype(np.uint8)
        e[rng.random(e.shape) < 0.02] = rng.integers(0, 2, dtype=np.uint8)
        data[:, :, 0] = e
    for off in _HALF_FIELDS.get(num, ()):
        h = (rng.uniform(d_max / 500, d_max, (n, k // block)) * rng.choice([-1, 1], (n, k // block))).astype(np.float16)
        h[rng.random(h.shape) < 0.02] = np.float16(3e-6)
        data[:, :, off : off + 2] = h.view(np.uint8).reshape(n, k // block, 2)
    return torch.from_numpy(data.reshape(n, -1))
