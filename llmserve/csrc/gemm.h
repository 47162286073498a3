// The GEMM seam every many-rows path ends in (gemm.cpp), and the float32 tiles of widened weights fed to it.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"

namespace llmserve {

// Row counts padded up for oneDNN (its primitives are cached per shape): exact to 64 rows; then steps of 16 to
// 128, of 32 to 512, of 64 beyond.
int64_t gemm_bucket(int64_t M);

// x [M, K] @ w.T through oneDNN's matmul (w plain float32 [N, K], packed float32 or bfloat16), rows padded to
// gemm_bucket.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w);

// Each row m of x [M, K] rounded to int8 with its own scale sx[m] = amax / 127, and with L == 2 what that left
// rounded again at sx[M + m] = sx[m] / 254: level l of row m at q + (l * Mb + m) * K. `u8`: stored as q + 128
// (uint8, for u8 x s8 products), else as int8. (q8_int_gemm's and q8_vnni_gemm's activations.) `hb`: each row
// rotated first by the Hadamard blocks of hb (hadamard_rows' values, not written out).
void round_rows(const float* xp, int64_t M, int64_t K, int64_t L, int64_t Mb, bool u8, uint8_t* qp, float* sx,
                int64_t hb = 0);

// hadamard_rows (kernels.h), w8a8's rotation (quant.hadamard_block): x's outlier channels spread over their block
// (the normalized transform is orthogonal and its own inverse) before one int8 level per token rounds them.
// act_bits as the int8 kernels take it: the activations' bits (8 or 16) in the low byte, w8a8's Hadamard block
// (0: none) above it (QuantLinear._act_code). Returns x rotated where asked (else x) and sets `bits`.
at::Tensor rotated_for(const at::Tensor& x, int64_t act_bits, int64_t& bits);

// out [M, N] = x @ W.T for per-channel int8 W (plain [N, K], or packed by oneDNN: [K, N]) through the integer
// GEMM, x rounded per row (round_rows: act_bits 16 two levels, 8 one).
at::Tensor q8_int_gemm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale, int64_t act_bits);

// Many rows (prefill, big batches): weight tiles widened to float32, multiplied with gemm().
// weight rows widened per gemm() call: ~4 MiB of float32, 256 to 1024 rows (fewer, larger GEMMs where K is small:
// SmolLM2's grouped int8 head at 64 rows 20.6 -> 16.4 ms with 1024 rows instead of 256)
inline int64_t tile_rows(int64_t K) { return std::clamp<int64_t>((int64_t{1} << 20) / K / 64 * 64, 256, 1024); }

template <typename Dequant>
void tiled_matmul(const at::Tensor& x, int64_t N, Dequant dequant, at::Tensor& out) {
  const int64_t K = x.size(1), T = tile_rows(K);
  at::Tensor w = at::empty({std::min(T, N), K}, x.options());
  float* wp = w.data_ptr<float>();
  for (int64_t n0 = 0; n0 < N; n0 += T) {
    const int64_t nt = std::min(T, N - n0);
    at::parallel_for(0, nt, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) dequant(n0 + r, wp + r * K);
    });
    out.narrow(1, n0, nt).copy_(gemm(x, w.narrow(0, 0, nt)));
  }
}

}  // namespace llmserve
