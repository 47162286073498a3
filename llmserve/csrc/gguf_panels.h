// The activations of GGUF's integer dots (gguf_dots.cpp rounds them), and the K-quant dots of many rows over
// panels of 16 weight rows (gguf_panels.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "gguf_blocks.h"

namespace llmserve::gguf {

// Each row of x rounded to int8 in blocks of B values (256 for the K-quants, 32 otherwise), scale dx = max|x| / 127
// per block, and the sums of every 16 rounded values.
struct Acts {
  int64_t K, B;
  std::vector<int8_t> q;        // [M, K]
  std::vector<float> dx;        // [M, K / B]
  std::vector<int16_t> sum16;   // [M, K / 16]
  Acts(const at::Tensor& x, int64_t B);
};

// Whether the panels take qtype's dots of M rows: a K-quant of unsigned values (Q2_K .. Q6_K), at least
// toggles.kq_panel_rows rows (3x that for Q2_K, Q3_K, Q6_K), where the VNNI kernels run (vnni_kernels(): the
// instructions or their twins).
bool panels_take(int64_t qtype, int64_t M);

// out[m, n] for every row m of x and weight rows [n0, n1) of w (qtype, panels_take holds): panels of 16 rows,
// the rest (fewer than 16 at the end) left to the caller. Returns the first row not done.
int64_t panel_dots(const Acts& a, int64_t M, const Layout& w, int64_t qtype, int64_t n0, int64_t n1, float* out,
                   int64_t ldo);

}  // namespace llmserve::gguf
