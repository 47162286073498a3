"""How the fused decode stack reads a projection: the kind a layer's `kernel_args()` names (ops.decode_layer_args
gathers them for the extension's decode_layer). The C++ twin is llmserve/csrc/projection_kinds.h; the extension's
`projection_kinds()` returns its table, and a unit test holds the two equal."""

from __future__ import annotations

import enum


class ProjectionKind(enum.IntEnum):
    """The kind, and the tensors it hands over (in order)."""

    F32 = 0  # float32 weight, plain or packed in oneDNN's layout
    F32_PACKED = 1  # float32: the plain weight and its oneDNN-packed copy
    BF16 = 2  # bfloat16 weight packed for oneDNN (llmserve.model.formats.bf16)
    INT4 = 4  # int4: q, scale, min (llmserve.model.formats.quant)
    INT8 = 8  # int8: q, scale
    INT8_VNNI = 9  # int8 in the VNNI layout: q, channel sums, scale
    GGUF = 16  # a GGUF projection's parts (llmserve.model.formats.gguf_layers), each its tensors


# INT4's activation bits where x's int8 blocks are stored as llama.cpp's Q8_1 (float16 scale and sum: a GGUF's Q4_0 /
# Q4_1 blocks in gguf mode, QuantLinear.q8_1); projection_kinds.h's kQ8_1Rounding
Q8_1_ROUNDING = 1

# A GGUF projection's part code (a byte of GGUF's activation bits): its GGMLQuantizationType when it stays blocks,
# PACKED_PART + INT4 / INT8 when repacked (Q4_0 / Q4_1 / Q8_0 on llmserve's own kernels)
PACKED_PART = 128
