"""A GGUF file's quantized tensors as model layers, block for block (never rounded again): `GGUFLinear` and
`GGUFEmbedding`, drop-ins for nn.Linear / nn.Embedding of kind "gguf" (any type of llmserve.model.kernels.gguf_kernels,
K-quants included), read through ops.gguf_linear / ops.gguf_dequantize; `adopt_gguf(model, tensors, exact)` puts
them in (the loader). `linear_sources` names the checkpoint tensors a Linear is made of (quant.quantize_model
reads it too)."""

from __future__ import annotations

import torch
import torch.nn as nn

from llmserve.model.kernels import ops
from llmserve.model.kernels.gguf_kernels import (
    BLOCKS,
    MANY_ROWS,
    MXFP4_16,
    NAMES,
    PACKED,
    Q4_K16,
    Q6_K16,
    gguf_kernels,
    packed_dequantize,
    packed_linear,
    repack,
    repack_panels,
)
from llmserve.model.kernels.kinds import PACKED_PART, ProjectionKind
from llmserve.model.layers.linear import checkpoint_parts


class GGUFLinear(nn.Module):
    """A Linear whose weights are a GGUF file's tensors (uint8 [rows, row_bytes] each, often views of the file's
    memory map), never rounded again: one part per checkpoint layer it packs (q, k, v may be of different
    types, as in Q4_K_M files), their outputs side by side.

    `exact`: float32 throughout (weights widened to float32 per row or tile, activations as they are): the
    values transformers computes from the same file, up to the order of float32 sums.
    Otherwise llama.cpp's arithmetic (activations rounded to int8 per block, integer dots), one kernel family
    per block format: Q4_0 / Q4_1 / Q8_0 parts are repacked here into llmserve's int4 / int8 layout (the same
    values; gguf_kernels.repack) for q4_linear / q8_linear, the other types stay blocks for GGUF's dots."""

    kind = "gguf"
    stack_many_rows = None  # int4 parts: q4_linear's VNNI GEMM from these rows (ops.decode_layer_args reads it)

    def __init__(
        self, parts: list[tuple[torch.Tensor, int]], in_features: int, bias: torch.Tensor | None, exact: bool
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(raw.shape[0] for raw, _ in parts)
        self.qtypes = [int(q) for _, q in parts]
        # per part: "gguf" (its blocks: raw{i}), "int4" / "int8" (q{i}, s{i}, m{i}) or "q4k16" / "q6k16" / "mx16"
        # (Q4_K / Q6_K / MXFP4 in panels of 16 rows where the VNNI kernels run: q{i})
        self.layouts: list[str] = []
        for i, (raw, q) in enumerate(parts):
            repacked = not exact and ops.kquant_repack(q, raw.shape[0])
            if not repacked and (exact or int(q) not in PACKED):
                self.layouts.append("gguf")
                self.register_buffer(f"raw{i}", raw)
                continue
            kind, tensors = repack_panels(raw, q, in_features) if repacked else repack(raw, q)
            self.layouts.append(kind)
            for name, t in zip("qsm", tensors):
                self.register_buffer(f"{name}{i}", t)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.exact = exact
        if "int4" in self.layouts and ops.int4_vnni(64):
            self.stack_many_rows = ops.kernel_config().int4_vnni_rows

    def parts(self) -> list[tuple[str, int, list[torch.Tensor]]]:
        """(layout, GGMLQuantizationType, its tensors) per part."""
        return [
            (lay, q, [getattr(self, f"raw{i}")] if lay == "gguf" else self._packed(i, lay))
            for i, (lay, q) in enumerate(zip(self.layouts, self.qtypes))
        ]

    def _packed(self, i: int, layout: str) -> list[torch.Tensor]:
        return [
            getattr(self, f"{n}{i}")
            for n in {"int4": "qsm", "int8": "qs", "q4k16": "q", "q6k16": "q", "mx16": "q"}[layout]
        ]

    def dequantize(self) -> torch.Tensor:
        """The float32 weights these blocks stand for."""
        return torch.cat(
            [
                ops.gguf_dequantize(t[0], q, self.in_features) if lay == "gguf" else packed_dequantize(lay, t)
                for lay, q, t in self.parts()
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = (x if x.dim() == 2 else x.reshape(-1, self.in_features)).float()
        many = MANY_ROWS if self.stack_many_rows is None else self.stack_many_rows
        ys = [
            ops.gguf_linear(x2, t[0], q, self.in_features, self.exact)
            if lay == "gguf"
            else packed_linear(x2, lay, t, many)
            for lay, q, t in self.parts()
        ]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        if self.bias is not None:
            y += self.bias
        y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def kernel_args(self) -> tuple[ProjectionKind, int, list[torch.Tensor]] | None:
        """(GGUF, the parts' count | a byte per part in the next bytes: its GGMLQuantizationType, Q4_K16 / Q6_K16 /
        MXFP4_16 for a Q4_K / Q6_K / MXFP4 in panels, or PACKED_PART + INT4 / INT8 for a Q4_0 / Q4_1 / Q8_0 repacked,
        [each part's tensors]): this layer as the fused decode stack reads it (ops.decode_layer_args; the stack runs
        gguf_linear_parts, the same kernels as forward's); None where it does not: `exact` (float32 throughout), a
        bias, float parts (F32 / F16 / BF16), no compiled kernels, off the CPU."""
        parts = self.parts()
        if (
            self.exact
            or self.bias is not None
            or not 0 < len(parts) < 8
            or any(BLOCKS[q][0] == 1 or t[0].device.type != "cpu" for _, q, t in parts)
            or gguf_kernels() is None
        ):
            return None
        code, tensors = len(parts), []
        for i, (lay, q, t) in enumerate(parts):
            part = {
                "gguf": q,
                "q4k16": Q4_K16,
                "q6k16": Q6_K16,
                "mx16": MXFP4_16,
                "int4": PACKED_PART + ProjectionKind.INT4,
                "int8": PACKED_PART + ProjectionKind.INT8,
            }[lay]
            code |= part << (8 * (i + 1))
            tensors += t
        return ProjectionKind.GGUF, code, tensors

    def extra_repr(self) -> str:
        return (
            f"gguf {'+'.join(NAMES[q] for q in self.qtypes)}, in_features={self.in_features}, "
            f"out_features={self.out_features}, exact={self.exact}"
        )


class GGUFEmbedding(nn.Module):
    """Embedding rows kept as a GGUF tensor's blocks, dequantized on lookup: a prompt reads a few rows, and
    the table stays at its file size (an 8B model's 128k x 4096 table is 2 GiB in float32, 0.4 in Q6_K)
    and is shared with a tied LM head."""

    kind = "gguf"

    def __init__(self, raw: torch.Tensor, qtype: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("raw", raw)
        self.qtype, self.dim = int(qtype), dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.raw.index_select(0, ids.reshape(-1).to(self.raw.device))
        return ops.gguf_dequantize(rows, self.qtype, self.dim).view(*ids.shape, self.dim)


def linear_sources(name: str, path: str, tied: bool, available) -> list[str]:
    """The checkpoint tensors (names without "model." and ".weight") the Linear at `path` is made of: a tied
    LM head reads the embedding; a packed projection its parts, or itself where `available` holds it packed
    (Phi-3's GGUF attn_qkv, ffn_up)."""
    if name == "lm_head":
        return ["embed_tokens" if tied else "lm_head"]
    return [path] if path in available else list(checkpoint_parts(path))


def adopt_gguf(model: nn.Module, tensors: dict[str, tuple[torch.Tensor, int]], exact: bool, floats=None) -> set[str]:
    """Replace in place each Linear / Embedding of `model` (which may still be on the meta device) whose
    checkpoint tensors are all in `tensors` ({Hugging Face name without "model." and ".weight": (raw
    blocks, GGMLQuantizationType number)}) by a GGUFLinear / GGUFEmbedding over them; a layer's bias is
    read from `floats` (a mapping of Hugging Face names to float tensors; the loader's GGUFTensors also releases
    the file's pages of a part GGUFLinear repacked). Returns the checkpoint names
    (Hugging Face's) the new layers stand for."""
    tied = getattr(getattr(model, "cfg", None), "tie_word_embeddings", False)
    adapt = getattr(model, "adapt_weight", None)
    consumed: set[str] = set()

    def release(n: str) -> None:
        """GGUFTensors.release (loader/gguf.py): a tensor's pages of the file's memory map handed back, so that resident
        memory does not count a repacked part twice (read again, they come back from the page cache)."""
        if hasattr(floats, "release"):
            floats.release("lm_head.weight" if n == "lm_head" else f"model.{n}.weight")

    def convert(module: nn.Module, prefix: str) -> None:
        for name, child in list(module.named_children()):
            path = prefix + name
            if isinstance(child, nn.Linear):
                names = linear_sources(name, path, tied, tensors)
                if not all(n in tensors for n in names):
                    continue
                bias = None if child.bias is None else torch.cat([floats[f"model.{n}.bias"] for n in names])
                if bias is not None and adapt is not None:  # (the blocks' row order: partial or interleaved rotary)
                    bias = adapt(path, bias)
                lin = GGUFLinear([tensors[n] for n in names], child.in_features, bias, exact)
                setattr(module, name, lin)
                for n, layout in zip(names, lin.layouts):
                    if layout != "gguf":  # a part repacked into a copy: the file's pages of it go back to the OS
                        release(n)
            elif type(child) is nn.Embedding:
                if path not in tensors:
                    continue
                names = [path]
                setattr(module, name, GGUFEmbedding(*tensors[path], child.embedding_dim))
            else:
                convert(child, path + ".")
                continue
            consumed.update("lm_head.weight" if n == "lm_head" else f"model.{n}.weight" for n in names)
            if isinstance(child, nn.Linear) and child.bias is not None:
                consumed.update(f"model.{n}.bias" for n in names)

    convert(model, "")
    return consumed
