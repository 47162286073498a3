// The activations of GGUF's integer dots (gguf_dots.cpp rounds them), the K-quant dots of many rows over panels of
// 16 weight rows packed per call (gguf_panels.cpp), and Q4_K repacked at load into such panels (gguf_repacked.cpp).
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

// Q4_K, Q6_K and MXFP4 repacked at load (gguf_repacked.cpp; qtypes Q4_K16, Q6_K16, MXFP4_16): a tensor [N, K / 256 * kQ4K16Bytes / 16]
// (Q6_K: kQ6K16Bytes / 16, the file's 210) uint8 whose 16-row panels hold a super-block of 16 rows in that many bytes.
// repack_panels: a Q4_K / Q6_K / MXFP4 tensor's blocks (N a multiple of 16) in that layout, the same values; repacked_dots:
// out[m, n] for every row m of x and rows [n0, n1) of w (multiples of 16), at any row count; repacked_unpack: row i
// of a panel's super-block P back to its 256 quants, d, dmin and 16 scales and mins (per 16 values, as ScalesK).
// MXFP4 (MXFP4_16): [N, K / 32 * 17], the file's bytes a row, a panel's block of 32 values in kMX16Bytes = 16 x 17;
// mx16_block: row i's block of a panel's block P as the file holds it (17 bytes).
inline constexpr int64_t kQ4K16Bytes = 2368, kQ6K16Bytes = 3360, kMX16Bytes = 272;
at::Tensor repack_panels(const at::Tensor& raw, int64_t qtype, int64_t K);
void mx16_block(const uint8_t* P, int i, uint8_t* block);
void repacked_dots(int64_t qtype, const Acts& a, int64_t M, const Layout& w, int64_t n0, int64_t n1, float* out,
                   int64_t ldo);
void repacked_unpack(int64_t qtype, const uint8_t* P, int i, uint8_t* q, float* d, float* dmin, int8_t* sc, uint8_t* mn);

}  // namespace llmserve::gguf
