// How the fused decode stack (decode_stack.cpp) reads a layer's projection: the kind a Python layer hands over
// with its tensors (its kernel_args(), gathered by llmserve/model/kernels/ops.py's decode_layer_args). Python's twin is
// llmserve/model/kernels/kinds.py's ProjectionKind; bindings.cpp's projection_kinds() exports this table so that a unit
// test holds the two equal.
#pragma once

#include <cstdint>

namespace llmserve {

// The tensors each kind takes, in order, in decode_layer's weights.
enum ProjectionKind : int64_t {
  kF32 = 0,         // float32 weight, plain or packed in oneDNN's layout: the GEMV, then gemm()
  kF32Packed = 1,   // float32, plain weight and its oneDNN-packed copy: the GEMV below many_rows, oneDNN from there
  kBF16 = 2,        // bfloat16 weight packed for oneDNN (llmserve/model/formats/bf16.py): rows rounded to bfloat16
  kInt4 = 4,        // int4 (q, scale, min): q4_linear
  kInt8 = 8,        // int8 (q, scale): q8_linear
  kInt8VNNI = 9,    // int8 in the VNNI layout (q, channel sums, scale): q8_vnni_gemm at every row count
  kGGUF = 16,       // a GGUF projection's parts; act_bits: the parts' count, then a byte per part (below)
};

// kInt4's act_bits: kQ8_1Rounding where x's int8 blocks are stored as llama.cpp's Q8_1 (a GGUF's Q4_0 / Q4_1 blocks
// in gguf mode: q4_linear's q8_1), anything else for llmserve's own int4 rounding (float32 scale and sum).
inline constexpr int64_t kQ8_1Rounding = 1;

// A GGUF projection's part: a GGMLQuantizationType whose integer dots are gguf_dots.cpp's (one tensor: the
// file's blocks), or kPackedPart + kInt4 / kInt8: Q4_0 / Q4_1 / Q8_0 repacked at load into q4_linear's (q, scale,
// min) / q8_linear's (q, scale) layout, so that each block format has one kernel family.
inline constexpr int64_t kPackedPart = 128;
inline int64_t part_tensors(int64_t code) {
  return code == kPackedPart + kInt4 ? 3 : code == kPackedPart + kInt8 ? 2 : 1;
}

// The table Python checks its enum against: (the Python member's name, the value).
inline constexpr struct {
  const char* name;
  ProjectionKind kind;
} kProjectionKinds[] = {
    {"F32", kF32},   {"F32_PACKED", kF32Packed}, {"BF16", kBF16}, {"INT4", kInt4},
    {"INT8", kInt8}, {"INT8_VNNI", kInt8VNNI},   {"GGUF", kGGUF},
};

}  // namespace llmserve
