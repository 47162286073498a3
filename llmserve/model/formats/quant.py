"""Weight-only quantization: `--quantization int8 | int4`.

int8: weights rounded to int8 per output channel (symmetric). int4: weights rounded to 4 bits per group
of 32 inputs (asymmetric: min + scale * q, GGUF Q4_1's grid, so the bundled Q4_1 model keeps its own
values); the LM head stays int8, as llama.cpp keeps its output tensor at 6-8 bits. The embedding table
is int8 rows with a scale per row (shared with the LM head when the two are tied).

Kernels (CPU, float32 activations), chosen per call by the number of rows (BENCHMARKS.md, "Weight
kernels"; the row limits are KernelConfig's `few_rows`, `int4_dot_rows`, `int8_dot_rows`, read when a
layer is built):
  * few rows (decode of a few requests): llmserve's AVX2 kernels (llmserve/csrc/linear.cpp) read the
    packed int8 / int4 weights directly, activations rounded per 32 values (int4: to int8, as
    llama.cpp's Q4_1 x Q8_1 dot; int8: to int16, relative error ~1e-5), dot products summed in int32.
    Reading 1 or 0.6 byte per weight instead of 4 is what makes single-stream decode fast: it is
    bound by memory traffic;
  * many rows (prefill, large batches), int8 with a scale per output channel: an integer GEMM (torch's
    `_int_mm`, oneDNN's int8 matmul, VNNI on this CPU: 3-5x the float32 GEMM), activations rounded per
    token in two int8 levels (the second rounds what the first left: ~15 bits, relative error ~4e-5;
    `act_bits` 8: one level, ~9e-3); KernelConfig.int8_gemm. Otherwise (int4, grouped int8, or
    int8_gemm off): fbgemm's packed float16 GEMM (`quantized::linear_dynamic_fp16`, float32 accumulation)
    on the rounded weights held as float16 (exact for int4 and for int8 times its scale), or float32 tiles
    of the packed weights through the float32 GEMM. fbgemm's own int8 GEMM rounds activations per tensor
    to 7 bits, which costs this model 3.7x in perplexity.
Elsewhere (CUDA): int8 values and a per-channel scale, widened per call, the scale applied to the output.

The interface the model, the loader and the kernels' seam (ops.py) use; nothing else of this module is
read from outside it:
  * `quantize_model(model, mode, blocks, only_blocks)`: replace a LlamaModel's Linear layers and its
    embedding in place (the loader; `blocks` are a GGUF file's own, from loader.GGUFPackedBlocks);
  * `QuantLinear`: a drop-in for nn.Linear (`forward`, `in_features`, `out_features`), plus `kind`
    ("int8" | "int4"), `dequantize()` (the float32 weights it stands for), its buffers `qweight`, `scale`,
    `minv` (int4), `bias`, and `kernel_args()` (ops.decode_layer_args: how the fused decode stack reads it);
  * `Int8Embedding`: a drop-in for nn.Embedding (`forward(ids)`), buffers `qweight` and `scale`;
  * `GGUFLinear` / `GGUFEmbedding` (llmserve.model.formats.gguf_layers, imported here): the same drop-ins holding a GGUF
    file's tensors as the file has them; `adopt_gguf` (there) puts them in;
  * `is_quantized(module)`: whether a module is one of these (it holds no float parameters).
The tensor-parallel shards (parallel.py) are float only: the engine refuses quantization with them.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmserve.model.formats.gguf_layers import GGUFEmbedding, GGUFLinear, linear_sources
from llmserve.model.kernels import ops
from llmserve.model.kernels.gguf_kernels import packed_dequantize, unpack_int4  # noqa: F401 (unpack_int4: quant's API)
from llmserve.model.kernels.kinds import Q8_1_ROUNDING, ProjectionKind
from llmserve.model.kernels.ops import quantize_int8_per_channel

GROUP_SIZE = 32
# --quantization's rounded-weight modes -> the kind of their layers (w8a8: int8 weights, one-level activations)
WEIGHT_KIND = {"int8": "int8", "w8a8": "int8", "int4": "int4"}
ONE_LEVEL_BITS = 8  # QuantLinear.act_bits of w8a8's layers: each row of activations one int8 level per token
# ... but the LM head, which keeps int8 mode's two levels (the logits; one row a token at decode)
TWO_LEVEL_LAYERS = ("lm_head",)
# w8a8's one-level layers take their input rotated by a block-diagonal Walsh-Hadamard matrix (blocks of
# HADAMARD_BLOCK, or the largest of 32 / 16 that divides the input size), their weights by the same one at load:
# (W H)(H x) = W x, H orthogonal, but H x spreads an outlier channel over its block before one int8 level per token
# rounds it (QuaRot's online rotation, without calibration). The bundled model, the float32 model's inputs of each
# projection on tests/data/alice.txt, relative error of the output against float32, one level without -> with
# blocks of 64: qkv 3.1% -> 0.9%, o 1.6% -> 1.3%, gate/up 2.3% -> 1.0%, down (the SwiGLU product's outliers) 3.2%
# -> 1.1% (two levels, unrotated: 0.9%). The transform costs 6 additions a value (csrc hadamard_rows).
HADAMARD_BLOCK = 64


def hadamard_block(in_features: int) -> int:
    """The rotation's block for an input of `in_features` (64, 32 or 16; 0 where none divides it)."""
    return next((b for b in (HADAMARD_BLOCK, 32, 16) if in_features % b == 0), 0)


def hadamard_matrix(b: int) -> torch.Tensor:
    """The normalized Walsh-Hadamard matrix of size b (a power of two): symmetric, orthogonal, its own inverse."""
    h = torch.ones(1, 1)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / b**0.5


def rotate_rows(x: torch.Tensor, b: int) -> torch.Tensor:
    """x [..., K] times the block-diagonal Hadamard matrix of blocks of b, along its last dimension (the reference
    for csrc hadamard_rows; the weights' rotation at load: W [N, K] -> W H)."""
    return (x.float().reshape(*x.shape[:-1], -1, b) @ hadamard_matrix(b)).reshape(x.shape)


def quantize_int4(w: torch.Tensor, group_size: int = GROUP_SIZE):
    """(q [N, K] uint8 in 0..15, scale [N, K/group], min [N, K/group]) with w ~= min + scale * q."""
    out_features, in_features = w.shape
    if in_features % group_size:
        raise ValueError(f"quantization: int4 needs input sizes divisible by {group_size}, got {in_features}")
    g = w.float().reshape(out_features, in_features // group_size, group_size)
    lo = g.amin(dim=-1)
    scale = ((g.amax(dim=-1) - lo) / 15.0).clamp(min=1e-10)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(out_features, in_features), scale, lo


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K/2] bytes: per 32-value group, byte j holds value j (low nibble)
    and value j + 16 (high nibble), GGUF's Q4 block layout."""
    n, k = q.shape
    g = q.reshape(n, k // 32, 2, 16)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


class QuantLinear(nn.Module):
    """A Linear with int8 (per channel) or int4 (per group of 32) weights.

    `int8`: (q int8 [N, K], scale [N]); `int4`: (q packed [N, K/2], scale and min [N, K/32]).
    CPU: few rows through the integer-dot kernels on the packed weights, many rows through
    fbgemm's float16 GEMM on the same values widened to float16 (see the module's docstring).
    Elsewhere (CUDA): int8 values and a per-channel scale, widened per call."""

    def __init__(
        self,
        kind: str,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        minv: torch.Tensor | None,
        bias: torch.Tensor | None,
        fp16_gemm: bool = True,
        hadamard: int = 0,
    ) -> None:
        super().__init__()
        self.kind = kind
        # w8a8: the weights were rotated by the block-diagonal Hadamard matrix of blocks of `hadamard` (0: not), and
        # the kernels rotate x alike (HADAMARD_BLOCK; `_act_code`); dequantize() gives the weights unrotated
        self.hadamard = hadamard
        self.act_bits = 16  # int8 weights: x rounded to int16 on the integer-dot path (8: faster, less exact)
        # w8a8 (act_bits 8): x rounded to one int8 level per token by the integer GEMM at every row count, its
        # weights laid out for it as int8 mode's are (pack_weight); without it act_bits 8 rounds x per 32 values
        # on the dots (int4 mode's LM head: Q8_0 x Q8_0)
        self.per_token = False
        # int4: x's int8 blocks stored as llama.cpp's Q8_1 (float16 scale and sum; `round_x_as_llama_cpp`, a GGUF's
        # Q4_0 / Q4_1 blocks in gguf mode) rather than with a float32 scale and float sum (int4 mode's own rounding)
        self.q8_1 = False
        self.out_features = qweight.shape[0]
        self.in_features = qweight.shape[1] * (2 if kind == "int4" else 1)
        self.register_buffer("qweight", qweight.contiguous())
        # int4: scale and min as float16 (Q4_1's block: 5 bits a weight in all); int8: float32 scales
        sdt = torch.float16 if kind == "int4" else torch.float32
        self.register_buffer("scale", scale.to(sdt).reshape(self.out_features, -1).contiguous())
        self.register_buffer("minv", None if minv is None else minv.to(sdt).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.register_buffer("csum", None)  # the VNNI layout's int32 sum per channel (pack_weight)
        cpu = qweight.device.type == "cpu"
        self.kernels = cpu and ops.weight_kernel(kind) is not None and self.in_features % 32 == 0
        self._packed = None
        self._many = None  # a copy of the weights for many rows (pack_weight)
        if cpu and (fp16_gemm or not self.kernels) and "fbgemm" in torch.backends.quantized.supported_engines:
            with warnings.catch_warnings():  # torch.ao is deprecated; its fbgemm kernels are not gone
                warnings.simplefilter("ignore")
                self._packed = torch.ops.quantized.linear_prepack_fp16(self.dequantize(), self.bias)
        self._bind()

    _many_rows = None  # rows from which forward() takes `_many`

    def _bind(self) -> None:
        """(kernel, its weight arguments, the rows it takes) for the few-rows path, kept as plain
        attributes: the hot path avoids nn.Module's attribute lookup. Rebound whenever the buffers are
        replaced. The row limits are ops.kernel_config()'s at this moment."""
        self._many_rows = None
        if not self.kernels:
            self._kernel = None
            return
        k = ops.kernel_config()
        self._bias = self.bias
        if self.qweight.dim() == 4:  # the VNNI layout (pack_weight): llmserve's integer GEMM at every row count
            self._kernel, self._few_rows, self.stack_many_rows = ops.cpu_kernels().q8_vnni_gemm, None, 0
            self._kargs = (self.qweight, self.csum, self.scale, self._act_code)
            return
        if self._packed is not None:  # beyond few_rows: fbgemm's float16 GEMM
            limit = self._few_rows = k.few_rows
        else:  # all rows here: the kernel tiles float32 beyond its limit
            limit, self._few_rows = k.int4_dot_rows if self.kind == "int4" else k.int8_dot_rows, None
        many = limit + 1
        # int8 with a scale per channel: the integer GEMM (KernelConfig.int8_gemm) from int8_gemm_rows, in the
        # fused decode stack too (`stack_many_rows`; elsewhere the stack keeps the dots at every row count)
        self.stack_many_rows = None
        if self.qweight.is_mkldnn:  # packed (`pack_weight`): the integer GEMM at every row count
            many = self.stack_many_rows = 0
        elif (
            self.kind == "int8"
            and self.scale.shape[1] == 1
            and self._packed is None
            and k.int8_gemm
            and ops.cpu_has_int8_dots()  # torch's _int_mm is a slow fallback without VNNI / AMX
            and self.rounds_per_token
        ):
            many = self.stack_many_rows = k.int8_gemm_rows
        elif self.kind == "int4" and self._packed is None and ops.int4_vnni(self.out_features):
            many = self.stack_many_rows = k.int4_vnni_rows  # the VNNI integer GEMM from there, in the stack too
        self._kernel = ops.weight_kernel(self.kind)
        if self.kind == "int4":
            self._kargs = (self.qweight, self.scale, self.minv, many, self.q8_1)
        else:
            self._kargs = (self.qweight, self.scale, many, self._act_code)
        if self._many is not None:  # a copy for many rows (pack_weight): (function, its weight arguments)
            self._many_rows = k.int8_gemm_rows
            if self._many[0] == "vnni":
                self._many_fn, self._many_args = ops.cpu_kernels().q8_vnni_gemm, (*self._many[1:], self._act_code)
            else:
                self._many_fn, self._many_args = self._kernel, (*self._many[1:], 0, self._act_code)

    @property
    def _act_code(self) -> int:
        """act_bits as the int8 kernels take it: the bits in the low byte, the Hadamard block above it."""
        return self.act_bits | self.hadamard << 8

    @property
    def rounds_per_token(self) -> bool:
        """Whether x is rounded per token (int8's two int16 levels, or w8a8's one int8 level), the rounding the
        integer GEMM computes; else per 32 values on the dots (int4 mode's LM head: Q8_0 x Q8_0)."""
        return self.act_bits > 8 or self.per_token

    def _copy_for_many_rows(self, q: torch.Tensor, scale: torch.Tensor) -> tuple | None:
        """int8 [N, K] with a scale per channel, laid out for many rows' integer GEMM: llmserve's own VNNI one
        (ops.vnni_pack) where it runs, else oneDNN's packed weight; None where neither applies."""
        vnni = ops.vnni_pack(q)
        if vnni is not None:
            return ("vnni", *vnni, scale.reshape(-1).contiguous())
        packed, _ = ops.pack_weight(q)
        return None if packed is None else ("onednn", packed, scale.reshape(-1, 1).contiguous())

    def pack_weight(self, grouped_copy: bool = False) -> bool:
        """int8 with a scale per channel on the CPU kernels' integer GEMM, at every row count from then on: the
        weights in the AVX-512 VNNI layout in place of the plain ones, for llmserve's own integer GEMM
        (ops.vnni_pack, q8_vnni_gemm: the integer sums of oneDNN's, 1.2-4x faster from one row to 128, even at
        a prefill's 1,024); without VNNI, weights of at least `packed_min_elements` in oneDNN's blocked layout
        (ops.pack_int8_weight). The same bytes either way. Whether packed.

        `grouped_copy` (the LM head): int8 with a scale per 32 values (a Q8_0 file's tied table, which the
        embedding shares) gets beside it a copy rounded again to one scale per channel, packed as above, for
        batches from `int8_gemm_rows` rows (what the projections' integer GEMM starts at); fewer rows keep the
        file's values on the dots. SmolLM2's head at 64 rows 13.7 -> 5.6 ms, 16 rows 4.0 -> 1.7 ms, for a
        quarter of its float32 bytes (+28 MB); greedy agreement with float32 as one prefill 97.4% -> 96.3%
        (docs/engine.md)."""
        if not (
            self.kind == "int8"
            and self._kernel is not None
            and self._packed is None
            and self.rounds_per_token  # (int4 mode's head: Q8_0 x Q8_0 per block, not per token)
            and not self.qweight.is_mkldnn
            and self.qweight.dim() == 2
            and self._many is None
        ):
            return False
        if self.scale.shape[1] > 1:
            if not grouped_copy or self.bias is not None:
                return False
            self._many = self._copy_for_many_rows(*self._requantize_per_channel())
        elif (vnni := ops.vnni_pack(self.qweight)) is not None:
            self.qweight, self.csum = vnni
        else:
            packed, _ = ops.pack_weight(self.qweight)
            if packed is None:
                return False
            self.qweight = packed
        self._bind()
        return True

    def _requantize_per_channel(self, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
        """int8 with a scale per 32 values (plain [N, K] layout) rounded again to one scale per channel, `rows`
        at a time: the float32 values are never widened whole (a 1B model's tied head is 400 MB of them)."""
        parts = [
            quantize_int8_per_channel(packed_dequantize("int8", [self.qweight[i : i + rows], self.scale[i : i + rows]]))
            for i in range(0, self.out_features, rows)
        ]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self.kernels = self.kernels and self.qweight.device.type == "cpu"
        self._bind()
        return out

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, fp16_gemm: bool = True, hadamard: int = 0
    ) -> "QuantLinear":
        """`hadamard` (int8, w8a8's one-level layers): the weights rotated by that block's Hadamard matrix before
        they are rounded (rotate_rows), as the kernels will rotate x."""
        if kind == "int4":
            q, scale, lo = quantize_int4(weight)
            return cls("int4", pack_int4(q), scale, lo, bias, fp16_gemm)
        q, scale = quantize_int8_per_channel(rotate_rows(weight, hadamard) if hadamard else weight)
        return cls("int8", q, scale, None, bias, fp16_gemm, hadamard)

    def dequantize(self) -> torch.Tensor:
        """The float32 weights these values stand for."""
        n, k = self.out_features, self.in_features
        if self.kind == "int4":
            return packed_dequantize("int4", [self.qweight, self.scale, self.minv])
        q = self.qweight
        if q.is_mkldnn:  # oneDNN's packed [K, N]
            q = q.to_dense().t()
        elif q.dim() == 4:  # the VNNI layout [N / 16, K / 4, 16, 4]
            q = q.permute(0, 2, 1, 3).reshape(n, k)
        w = packed_dequantize("int8", [q, self.scale])
        return rotate_rows(w, self.hadamard) if self.hadamard else w  # (H is its own inverse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if (
            self._kernel is not None
            and x2.dtype is torch.float32
            and (self._few_rows is None or x2.shape[0] <= self._few_rows)
        ):
            if self._many_rows is not None and x2.shape[0] >= self._many_rows:
                y = self._many_fn(x2, *self._many_args)  # the copy for many rows
            else:
                y = self._kernel(x2, *self._kargs)  # the decode hot path
            if self._bias is not None:
                y += self._bias
        elif self._packed is not None:
            y = torch.ops.quantized.linear_dynamic_fp16(x2.float(), self._packed).to(x.dtype)
        else:  # CUDA, or a CPU without the kernels and fbgemm
            y = F.linear(x2, self.dequantize().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def kernel_args(self) -> tuple[ProjectionKind, int, list[torch.Tensor]] | None:
        """(INT4 | INT8 | INT8_VNNI, activation bits, [qweight, scale(, minv)]): this layer as the fused decode
        stack reads it (ops.decode_layer_args); None where it does not run on the CPU kernels."""
        if self._kernel is None or self.bias is not None:
            return None
        if self.kind == "int4":
            return ProjectionKind.INT4, Q8_1_ROUNDING if self.q8_1 else 0, [self.qweight, self.scale, self.minv]
        if self.qweight.dim() == 4:  # q8_vnni_gemm at every row count
            return ProjectionKind.INT8_VNNI, self._act_code, [self.qweight, self.csum, self.scale]
        return ProjectionKind.INT8, self._act_code, [self.qweight, self.scale]

    def extra_repr(self) -> str:
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}"


def round_x_as_llama_cpp(model: nn.Module) -> int:
    """gguf mode: every int4 layer of `model` (a GGUF's Q4_0 / Q4_1 blocks as they are) rounds its activations as
    llama.cpp's Q8_1 blocks (QuantLinear.q8_1), the reference that mode is judged against. Returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.kind == "int4":
            m.q8_1 = True
            m._bind()
            n += 1
    return n


class Int8Embedding(nn.Module):
    """Embedding rows held as int8 with a scale per row (or per group of 32, as GGUF's Q8_0)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.float().reshape(qweight.shape[0], -1))

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "Int8Embedding":
        return cls(*quantize_int8_per_channel(weight))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q, s = self.qweight[ids].float(), self.scale[ids]
        return (q.view(*q.shape[:-1], s.shape[-1], -1) * s.unsqueeze(-1)).view(q.shape)


def is_quantized(module: nn.Module) -> bool:
    """A QuantLinear, an Int8Embedding or a GGUF layer: quantized weights, no float parameters."""
    return isinstance(module, (QuantLinear, Int8Embedding, GGUFLinear, GGUFEmbedding))


def _from_blocks(blocks: dict, names: list[str], bias, mode: str) -> QuantLinear | None:
    """A QuantLinear from a GGUF file's own blocks (`bias`: a tensor, None, or a function reading it, called only
    when the blocks are taken), when every part is there in one kind: Q8_0 in either
    mode, Q4_0 / Q4_1 under int4 (never rounded again). Under int8 a Q4 tensor is not adopted: int8 is the
    accurate mode, whose int16 activations the Q4 kernels lack (they round x to int8: greedy agreement with
    float32 fell from 97.4% to 92.8% on the bundled model), so it is rounded to int8 per channel from the
    file's values instead. Parts are stacked by rows. No float16 copy for fbgemm: the file's size is what
    it holds (many rows go through the kernels' float32 tiles)."""
    if not all(n in blocks for n in names):
        return None
    parts = [blocks[n] for n in names]  # (a loader's mapping may convert each part only now)
    if len({p[0] for p in parts}) != 1 or mode == "int8" and parts[0][0] == "int4":
        return None
    bias = bias() if callable(bias) else bias
    cat = [
        None if parts[0][i] is None else parts[0][i] if len(parts) == 1 else torch.cat([p[i] for p in parts])
        for i in (1, 2, 3)
    ]
    kind = parts[0][0]
    del parts
    return QuantLinear(kind, cat[0], cat[1], cat[2], bias, fp16_gemm=False)


def quantize_model(
    model: nn.Module, mode: str, blocks: dict | None = None, only_blocks: bool = False, weights=None
) -> set[str]:
    """Replace every Linear (and the embedding) of `model` in place; float weights are freed.

    `blocks` (llmserve.model.loader.GGUFPackedBlocks, a mapping): a GGUF file's quantized tensors, used as they
    are where they cover a layer (no re-rounding); other layers are rounded from their float weights.
    `only_blocks`: replace only the layers the blocks cover, leaving the others as they are (the model
    may still be on the meta device: the loader then reads only the float weights nothing adopted).
    `weights` (a mapping of Hugging Face names to float tensors, read when asked): where a layer is still on
    the meta device its weights are read from there, one layer at a time, so that a float checkpoint is
    never widened to float32 whole.
    Returns the checkpoint's weight names (Hugging Face's) the blocks or `weights` stood in for."""
    if mode not in WEIGHT_KIND:
        raise ValueError(f"quantization: must be none, int8, w8a8 or int4, got {mode!r}")
    # w8a8: int8 mode's weights, its activations rounded to one int8 level per token (ONE_LEVEL_BITS), rotated first
    # (hadamard_block), but at the layers of TWO_LEVEL_LAYERS
    act_bits = ONE_LEVEL_BITS if mode == "w8a8" else None
    mode = WEIGHT_KIND[mode]
    blocks = blocks or {}
    tied = getattr(getattr(model, "cfg", None), "tie_word_embeddings", False)
    # int8 (the throughput mode) runs big batches through the integer GEMM (KernelConfig.int8_gemm) or, without
    # it, keeps float16 copies for fbgemm's GEMM; int4 (the memory mode) holds only its packed weights: 0.6
    # byte a weight.
    fp16_gemm = mode == "int8" and not (ops.kernel_config().int8_gemm and ops.weight_kernel("int8") is not None)
    consumed: set[str] = set()

    def read(t: torch.Tensor | None, names: list[str], kind: str, path: str = "") -> torch.Tensor | None:
        if t is None or not t.is_meta:
            return t
        keys = ["lm_head.weight" if n == "lm_head" else f"model.{n}.{kind}" for n in names]
        if path and f"model.{path}.{kind}" in weights:  # a checkpoint that packs the projection itself (Phi-3)
            keys = [f"model.{path}.{kind}"]
        consumed.update(keys)
        t = torch.cat([weights[k].float() for k in keys])
        adapt = getattr(model, "adapt_weight", None)  # (the model's own row order and folded scales)
        return t if adapt is None or not path else adapt(path, t)

    def convert(module: nn.Module, prefix: str) -> None:
        for name, child in list(module.named_children()):
            path = prefix + name
            if isinstance(child, nn.Linear):
                names = linear_sources(name, path, tied, blocks)
                bias, q = child.bias, None
                if bias is not None and bias.is_meta and weights is not None:  # read only when the blocks are taken
                    bias = lambda c=child, names=names, path=path: read(c.bias, names, "bias", path)  # noqa: E731
                if bias is None or callable(bias) or not bias.is_meta:
                    q = _from_blocks(blocks, names, bias, mode)
                if q is None and only_blocks:
                    continue
                one_level = act_bits is not None and name not in TWO_LEVEL_LAYERS
                if q is None:  # the LM head stays int8, as in llama.cpp's Q4 files
                    q = QuantLinear.from_float(
                        read(child.weight, names, "weight", path).detach(),
                        read(child.bias, names, "bias", path),
                        "int8" if name == "lm_head" else mode,
                        fp16_gemm,
                        hadamard_block(child.in_features) if one_level else 0,
                    )
                elif not (name == "lm_head" and tied):  # a tied head reads the embedding's weight
                    consumed.update(f"model.{n}.weight" if n != "lm_head" else "lm_head.weight" for n in names)
                setattr(module, name, q)
                if mode == "int4" and q.kind == "int8":
                    q.act_bits = 8  # int4 mode's LM head: Q8_0 x Q8_0 as llama.cpp (measured: no loss of agreement)
                    q._bind()
                elif one_level and q.kind == "int8":
                    q.act_bits, q.per_token = act_bits, q.scale.shape[1] == 1  # (a Q8_0 file's blocks: per 32)
                    q._bind()
            elif isinstance(child, nn.Embedding):
                b = blocks[path] if path in blocks else None
                if b is not None and b[0] == "int8":
                    setattr(module, name, Int8Embedding(b[1], b[2]))
                    consumed.add(f"model.{path}.weight")
                elif not only_blocks:
                    setattr(module, name, Int8Embedding.from_float(read(child.weight, [path], "weight")))
            else:
                convert(child, path + ".")

    with torch.no_grad():
        convert(model, "")
        emb, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
        if (
            tied
            and isinstance(emb, Int8Embedding)
            and isinstance(head, QuantLinear)
            and head.kind == "int8"
            and torch.equal(emb.qweight, head.qweight)
            and torch.equal(emb.scale, head.scale)
        ):
            emb.qweight, emb.scale = head.qweight, head.scale  # one copy of the tied table
    return consumed
