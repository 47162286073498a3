// GGUF's quantized blocks read in place (AVX2 + FMA + F16C, float32 activations; gguf_blocks.h has the types,
// gguf_dots.cpp the integer dots), the functions kernels.h declares in llmserve::gguf. The fused decode stack
// calls linear_parts for a GGUF projection.
//
//  * dequantize(raw, qtype, K) -> float32 [N, K], bit-exact with the gguf package's NumPy code: the same
//    float operations in the same order (a product is never fused with the add after it).
//  * linear(x, raw, qtype, K, many_rows) -> x [M, K] @ dequantize(raw).T. Fewer than many_rows rows: the
//    integer dots (gguf_dots.cpp). Many rows: tiles of weights dequantized to float32 and multiplied with gemm().
//  * linear_f32: the same product in float32 throughout; linear_parts: a packed projection's parts side by side.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "gemm.h"
#include "gguf_blocks.h"
#include "gguf_panels.h"
#include "kernels.h"
#include "projection_kinds.h"
#include "vec.h"

namespace llmserve::gguf {

namespace {

// ---------------------------------------------------------------------------------------------
// Dequantization, bit-exact with NumPy: the products rounded to float32 before the add.

// 32 quants (signed bytes for Q8_0, unsigned otherwise) -> out[0..31] = a * (q - zero) + b, with
// (a0, b0) for the first 16 values and (a1, b1) for the rest.
template <bool Signed, bool Add>
inline void dequant32(__m256i q, int zero, float a0, float a1, float b0, float b1, float* out) {
  const __m256i z = _mm256_set1_epi32(zero);
  for (int part = 0; part < 4; ++part) {   // 8 values at a time
    const __m128i half = part < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
    const __m128i bytes = part % 2 ? _mm_srli_si128(half, 8) : half;
    const __m256i i32 = Signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    __m256 v = unfused(_mm256_mul_ps(_mm256_set1_ps(part < 2 ? a0 : a1), _mm256_cvtepi32_ps(_mm256_sub_epi32(i32, z))));
    if constexpr (Add) v = _mm256_add_ps(v, _mm256_set1_ps(part < 2 ? b0 : b1));
    _mm256_storeu_ps(out + 8 * part, v);
  }
}

template <typename T>
void dequant_row(const uint8_t* row, int64_t K, float* out) {
  for (int64_t blk = 0; blk < K / T::kValues; ++blk) {
    const uint8_t* b = row + blk * T::kBytes;
    float* o = out + blk * T::kValues;
    const auto s = T::header(b);
    if constexpr (T::kValues == 32) {
      dequant32<T::kSigned, T::kMin>(T::quants(b), T::kZero, s.d, s.d, s.m, s.m, o);
    } else {
      int8_t sc[16], mn[16];
      _mm_storeu_si128(reinterpret_cast<__m128i*>(sc), s.sc);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(mn), s.mn);
      for (int i = 0; i < 8; ++i)
        dequant32<T::kSigned, T::kMin>(T::quants(b, i), T::kZero, s.d * sc[2 * i], s.d * sc[2 * i + 1],
                                  -(s.dmin * mn[2 * i]), -(s.dmin * mn[2 * i + 1]), o + 32 * i);
    }
  }
}

void dequant_plain_row(const uint8_t* row, int64_t qtype, int64_t K, float* out) {   // F32, F16, BF16
  int64_t k = 0;
  if (qtype == F32) {
    std::memcpy(out, row, K * sizeof(float));
    return;
  }
  if (qtype == F16) {
    for (; k + 8 <= K; k += 8)
      _mm256_storeu_ps(out + k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k))));
    for (; k < K; ++k) out[k] = f16(row + 2 * k);
    return;
  }
  for (; k + 8 <= K; k += 8) {   // BF16: the upper half of a float32
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k)));
    _mm256_storeu_ps(out + k, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
  }
  for (; k < K; ++k) {
    const uint32_t bits = static_cast<uint32_t>(row[2 * k] | row[2 * k + 1] << 8) << 16;
    std::memcpy(out + k, &bits, 4);
  }
}

}  // namespace

Layout check_layout(const at::Tensor& raw, int64_t qtype, int64_t K, const char* what) {
  int64_t block = 1, bytes = 0;
  if (qtype == F32) bytes = 4;
  else if (qtype == F16 || qtype == BF16) bytes = 2;
  else if (qtype == Q4_K16) block = 256, bytes = kQ4K16Bytes / 16;
  else if (qtype == Q6_K16) block = 256, bytes = kQ6K16Bytes / 16;
  else if (qtype == MXFP4_16) block = 32, bytes = kMX16Bytes / 16;
  else if (!with_quant_type(qtype, [&](auto t) { block = decltype(t)::kValues, bytes = decltype(t)::kBytes; }))
    TORCH_CHECK(false, what, ": unsupported GGUF quantization type ", qtype,
                " (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, "
                "Q6_K, IQ4_XS)");
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.dim() == 2, what,
              ": raw must be a uint8 CPU tensor [N, row_bytes]");
  TORCH_CHECK(K > 0 && K % block == 0, what, ": K = ", K, " is not a multiple of the type's ", block, "-value blocks");
  const int64_t row_bytes = K / block * bytes;
  TORCH_CHECK(raw.size(1) == row_bytes, what, ": raw has ", raw.size(1), " bytes a row; K = ", K, " takes ", row_bytes);
  TORCH_CHECK(raw.stride(1) == 1 && (raw.size(0) <= 1 || raw.stride(0) >= row_bytes), what,
              ": raw's rows must each be contiguous");
  return {raw.size(0), row_bytes, raw.size(0) <= 1 ? row_bytes : raw.stride(0), raw.data_ptr<uint8_t>()};
}

// Row n of a repacked Q4_K / Q6_K tensor (Q4_K16, Q6_K16), as dequant_row<TQ4_K / TQ6_K> widens the file's block
void dequant_repacked_row(const Layout& w, int64_t qtype, int64_t K, int64_t n, float* out) {
  alignas(32) uint8_t q[256];
  int8_t sc[16];
  uint8_t mn[16];
  float d, dmin;
  const int64_t bytes = qtype == Q4_K16 ? kQ4K16Bytes : kQ6K16Bytes;
  for (int64_t s = 0; s < K / 256; ++s) {
    repacked_unpack(qtype, w.p + ((n / 16) * (K / 256) + s) * bytes, static_cast<int>(n % 16), q, &d, &dmin, sc, mn);
    for (int i = 0; i < 8; ++i) {
      if (qtype == Q4_K16)
        dequant32<false, true>(load32(q + 32 * i), 0, d * sc[2 * i], d * sc[2 * i + 1], -(dmin * mn[2 * i]),
                               -(dmin * mn[2 * i + 1]), out + 256 * s + 32 * i);
      else
        dequant32<false, false>(load32(q + 32 * i), TQ6_K::kZero, d * sc[2 * i], d * sc[2 * i + 1], 0.0f, 0.0f,
                                out + 256 * s + 32 * i);
    }
  }
}

void dequant_any_row(const Layout& w, int64_t qtype, int64_t K, int64_t n, float* out) {
  if (qtype == MXFP4_16) {   // each block as the file holds it
    uint8_t block[TMXFP4::kBytes];
    for (int64_t g = 0; g < K / 32; ++g) {
      mx16_block(w.p + ((n / 16) * (K / 32) + g) * kMX16Bytes, static_cast<int>(n % 16), block);
      dequant_row<TMXFP4>(block, 32, out + 32 * g);
    }
    return;
  }
  if (is_repacked(qtype)) return dequant_repacked_row(w, qtype, K, n, out);
  const uint8_t* row = w.p + n * w.ld;
  if (!with_quant_type(qtype, [&](auto t) { dequant_row<decltype(t)>(row, K, out); }))
    dequant_plain_row(row, qtype, K, out);
}

at::Tensor dequantize(const at::Tensor& raw, int64_t qtype, int64_t K) {
  const Layout w = check_layout(raw, qtype, K, "dequantize");
  at::Tensor out = at::empty({w.N, K}, at::TensorOptions().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, w.N, 16, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) dequant_any_row(w, qtype, K, n, o + n * K);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Many rows (prefill, big batches): tiles of weight rows dequantized to float32, multiplied with gemm()
// (tiled_matmul, gemm.h).

namespace {

// Few rows, float32 activations (the float32-exact mode): each weight row dequantized once into a buffer
// that stays in L1 and dotted with every row of x in float32. One parallel region a call, where the tiles
// take one (and a gemm()) per tile of weight rows.
void float_rows(const at::Tensor& x, const Layout& w, int64_t qtype, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = w.N;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    std::vector<float> row(K);
    for (int64_t n = b; n < e; ++n) {
      dequant_any_row(w, qtype, K, n, row.data());
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = xp + m * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
          a0 = _mm256_fmadd_ps(_mm256_loadu_ps(row.data() + k), _mm256_loadu_ps(xr + k), a0);
          a1 = _mm256_fmadd_ps(_mm256_loadu_ps(row.data() + k + 8), _mm256_loadu_ps(xr + k + 8), a1);
        }
        float sum = hsum(_mm256_add_ps(a0, a1));
        for (; k < K; ++k) sum += row[k] * xr[k];
        op[m * N + n] = sum;
      }
    }
  });
}

}  // namespace

// out [M, N] = x [M, K] @ dequantize(raw).T in float32 (weights widened, activations as they are): up to
// few_rows rows through float_rows, more through the tiles and gemm().
at::Tensor linear_f32(const at::Tensor& x_in, const at::Tensor& raw, int64_t qtype, int64_t K, int64_t few_rows) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "linear_f32: x must be a float32 CPU tensor [M, K]");
  TORCH_CHECK(x_in.size(1) == K, "linear_f32: x has ", x_in.size(1), " columns, the weights K = ", K);
  const Layout w = check_layout(raw, qtype, K, "linear_f32");
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), w.N}, x.options());
  if (x.size(0) == 0 || w.N == 0) return out;
  if (x.size(0) <= few_rows) float_rows(x, w, qtype, out);
  else tiled_matmul(x, w.N, [&](int64_t n, float* row) { dequant_any_row(w, qtype, K, n, row); }, out);
  return out;
}

// out [M, N] = x [M, K] @ dequantize(raw).T; rows < many_rows through the integer dots (with_dot_type's types;
// the others always through the tiles: Q4_0 / Q4_1 / Q8_0's dots are q4_linear / q8_linear's, on their blocks
// repacked).
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& raw, int64_t qtype, int64_t K, int64_t many_rows) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "linear: x must be a float32 CPU tensor [M, K]");
  TORCH_CHECK(x_in.size(1) == K, "linear: x has ", x_in.size(1), " columns, the weights K = ", K);
  const Layout w = check_layout(raw, qtype, K, "linear");
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), w.N}, x.options());
  if (x.size(0) == 0 || w.N == 0) return out;
  if ((x.size(0) < many_rows && with_dot_type(qtype, [](auto) {})) || is_repacked(qtype)) {
    dot_parts(x, {{w, qtype, 0}}, w.N, out.data_ptr<float>());
    return out;
  }
  tiled_matmul(x, w.N, [&](int64_t n, float* row) { dequant_any_row(w, qtype, K, n, row); }, out);
  return out;
}

// x [M, K] @ the parts' weights side by side (see kernels.h): the GGUF dots' parts in one parallel region, then
// each packed part through its own kernel into its columns.
at::Tensor linear_parts(const at::Tensor& x_in, const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& codes,
                        int64_t many_rows) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "linear_parts: x must be a float32 CPU tensor [M, K]");
  TORCH_CHECK(!codes.empty(), "linear_parts: no parts");
  const int64_t K = x_in.size(1);
  std::vector<Part> parts;
  struct Packed {
    int64_t code;
    size_t t;      // its first tensor
    int64_t col;   // its first column
  };
  std::vector<Packed> packed;
  size_t at = 0;
  int64_t N = 0;
  for (const int64_t code : codes) {
    const size_t n = part_tensors(code);
    TORCH_CHECK(at + n <= tensors.size(), "linear_parts: ", tensors.size(), " tensors for more parts");
    if (n > 1) {
      packed.push_back({code, at, N});
    } else {
      TORCH_CHECK(is_repacked(code) || with_dot_type(code, [](auto) {}), "linear_parts: ", code,
                  " is not a type of GGUF's integer dots (Q4_0 / Q4_1 / Q8_0 come repacked)");
      parts.push_back({check_layout(tensors[at], code, K, "linear_parts"), code, N});
    }
    N += tensors[at].size(0);
    at += n;
  }
  TORCH_CHECK(at == tensors.size(), "linear_parts: ", tensors.size(), " tensors for parts that take ", at);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0 || N == 0) return out;
  if (!parts.empty()) dot_parts(x, parts, N, out.data_ptr<float>());
  constexpr int64_t kAllRows = int64_t{1} << 62;
  for (const Packed& p : packed) {   // int8: Q8_0 x Q8_0 as llama.cpp (x rounded to int8 per 32), dots at every row count
    const at::Tensor* w = tensors.data() + p.t;
    const at::Tensor y = p.code == kPackedPart + kInt4
                             ? q4_linear(x, w[0], w[1], w[2], w[0].size(0) % 64 == 0 ? many_rows : kAllRows, true)
                             : q8_linear(x, w[0], w[1], kAllRows, 8);
    out.narrow(1, p.col, y.size(1)).copy_(y);
  }
  return out;
}

}  // namespace llmserve::gguf
