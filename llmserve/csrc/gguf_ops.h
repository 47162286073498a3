// GGUF's quantized blocks read in place (llmserve/csrc/gguf_ops.cpp), compiled into the same extension module
// as cpu_ops.cpp (llmserve/model/ops.py builds both): cpu_ops.cpp binds these for Python and its fused decode
// stack calls linear_parts for a GGUF projection.
#pragma once

#include <torch/extension.h>

#include <vector>

namespace llmserve_gguf {

// float32 [N, K]: the values of raw (uint8 [N, row_bytes], blocks of qtype), bit-exact with the gguf package.
at::Tensor dequantize(const at::Tensor& raw, int64_t qtype, int64_t K);

// x [M, K] @ dequantize(raw).T: integer dots below many_rows rows, dequantized tiles + at::mm from there.
at::Tensor linear(const at::Tensor& x, const at::Tensor& raw, int64_t qtype, int64_t K, int64_t many_rows);

// The same product in float32 throughout (weights widened, activations as they are).
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& raw, int64_t qtype, int64_t K, int64_t few_rows);

// x [M, K] @ [dequantize(raws[0]); dequantize(raws[1]); ...].T through the integer dots, the parts' outputs
// side by side (a packed projection whose parts may be of different types, as q / k / v in Q4_K_M files): x
// rounded once, one parallel region. Every row of x is computed as linear() computes it (the same bits).
at::Tensor linear_parts(const at::Tensor& x, const std::vector<at::Tensor>& raws, const std::vector<int64_t>& qtypes);

// Allow the AVX-512 VNNI K-quant dots or not; returns whether they run (the CPU has AVX-512 F/BW/VL + VNNI
// and they are allowed). Allowed by default; cpu_ops.cpp's set_avx512 forwards here.
bool set_avx512(bool allowed);
bool uses_avx512();

}  // namespace llmserve_gguf
