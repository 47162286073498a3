// GGUF's quantized blocks read in place (AVX2 + FMA + F16C, float32 activations; AVX-512 VNNI K-quant dots
// where the CPU has them), compiled into cpu_ops.cpp's extension module by llmserve/model/ops.py (the
// functions of gguf_ops.h: cpu_ops.cpp binds them, and its fused decode stack calls linear_parts). The
// weights stay as the file holds them, byte for byte: raw is a uint8 tensor [N, row_bytes], each row K
// values in the type's blocks.
//
//  * dequantize(raw, qtype, K) -> float32 [N, K], bit-exact with the gguf package's NumPy code: the same
//    float operations in the same order (a product is never fused with the add after it).
//  * linear(x, raw, qtype, K, many_rows) -> x [M, K] @ dequantize(raw).T. Fewer than many_rows rows
//    (decode): integer dot products on the blocks, each block unpacked once for up to 4 rows of x, x
//    rounded to int8 per 256 values for the K-quants (as llama.cpp's Q8_K) and per 32 for the 32-value
//    types (as its Q8_0), with the sums of every 16 rounded values for the blocks' offsets and mins.
//    Many rows (prefill): tiles of weights dequantized to float32 and multiplied with at::mm.
//
// Each type is a struct (its layout in a comment, then how to read it): kValues values in kBytes bytes;
// quants(block, i) the i-th 32 quants as bytes, in value order; header(block) the scales. A value is
//   d_g * (q - kZero) + min_g     (g: its group of 16 values for the K-quants, the block otherwise)
// Half floats ("f16") and all multi-byte fields are little endian.
#include "gguf_ops.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

enum QType : int64_t {   // GGMLQuantizationType's numbers
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// The compiler may fuse a * b + c into one FMA (one rounding instead of NumPy's two); passing the
// product through here forbids that.
inline __m256 unfused(__m256 v) {
  asm("" : "+x"(v));
  return v;
}

inline __m256i low4() { return _mm256_set1_epi8(0x0F); }

// ---------------------------------------------------------------------------------------------
// The 32-value types: one scale d (and a min m for _1) per block of 32 values.

struct Scales32 {
  float d, m;
};

// Q4_0, 18 bytes: f16 d | qs[16]. Value j < 16: the low nibble of qs[j], j + 16: its high nibble;
// d * (q - 8).
struct TQ4_0 {
  static constexpr int64_t kValues = 32, kBytes = 18;
  static constexpr int kZero = 8;
  static constexpr bool kMin = false, kSigned = false;
  static Scales32 header(const uint8_t* b) { return {f16(b), 0.0f}; }
  static __m256i quants(const uint8_t* b) { return nibbles(b + 2); }
  static __m256i nibbles(const uint8_t* qs) {   // 16 bytes -> their low nibbles, then their high ones
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4());
  }
};

// Q4_1, 20 bytes: f16 d | f16 m | qs[16] as Q4_0's; d * q + m.
struct TQ4_1 {
  static constexpr int64_t kValues = 32, kBytes = 20;
  static constexpr int kZero = 0;
  static constexpr bool kMin = true, kSigned = false;
  static Scales32 header(const uint8_t* b) { return {f16(b), f16(b + 2)}; }
  static __m256i quants(const uint8_t* b) { return TQ4_0::nibbles(b + 4); }
};

// The fifth bits of Q5_0 / Q5_1: bit j of the little-endian uint32 qh is bit 4 of value j.
inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  // byte j of the vector gets byte j / 8 of qh; then keep bit j % 8 of it, and move it to bit 4
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(h)),
                                            _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                               0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}

// Q5_0, 22 bytes: f16 d | uint32 qh | qs[16]. q = Q4_0's nibble | (bit j of qh) << 4; d * (q - 16).
struct TQ5_0 {
  static constexpr int64_t kValues = 32, kBytes = 22;
  static constexpr int kZero = 16;
  static constexpr bool kMin = false, kSigned = false;
  static Scales32 header(const uint8_t* b) { return {f16(b), 0.0f}; }
  static __m256i quants(const uint8_t* b) { return _mm256_or_si256(TQ4_0::nibbles(b + 6), fifth_bits(b + 2)); }
};

// Q5_1, 24 bytes: f16 d | f16 m | uint32 qh | qs[16], q as Q5_0's; d * q + m.
struct TQ5_1 {
  static constexpr int64_t kValues = 32, kBytes = 24;
  static constexpr int kZero = 0;
  static constexpr bool kMin = true, kSigned = false;
  static Scales32 header(const uint8_t* b) { return {f16(b), f16(b + 2)}; }
  static __m256i quants(const uint8_t* b) { return _mm256_or_si256(TQ4_0::nibbles(b + 8), fifth_bits(b + 4)); }
};

// Q8_0, 34 bytes: f16 d | int8 qs[32]; q * d.
struct TQ8_0 {
  static constexpr int64_t kValues = 32, kBytes = 34;
  static constexpr int kZero = 0;
  static constexpr bool kMin = false, kSigned = true;
  static Scales32 header(const uint8_t* b) { return {f16(b), 0.0f}; }
  static __m256i quants(const uint8_t* b) { return load32(b + 2); }
};

// ---------------------------------------------------------------------------------------------
// The K-quants: super-blocks of 256 values, an f16 d (and dmin) scaling small integer scales (and mins)
// of 16- or 32-value groups. header() gives them per 16 values: sc[g], mn[g] (int8), so that value k
// of group g is (d * sc[g]) * (q - kZero) - dmin * mn[g].

struct ScalesK {
  float d, dmin;
  __m128i sc, mn;   // 16 int8 each, one per 16 values
};

// Q4_K, 144 bytes: f16 d | f16 dmin | scales[12] | qs[128]. Eight 32-value sub-blocks, each with a 6-bit
// scale and min packed in `scales`: for j < 4 the low 6 bits of bytes j (scale) and j + 4 (min); for
// j >= 4 the scale is (byte j + 4 & 15) | (byte j - 4 >> 6) << 4, the min (byte j + 4 >> 4) | (byte j >> 6)
// << 4. qs[32c .. 32c + 31]: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1.
// Value: (d * scale) * q - dmin * min.
struct TQ4_K {
  static constexpr int64_t kValues = 256, kBytes = 144;
  static constexpr int kZero = 0;
  static constexpr bool kMin = true;
  static ScalesK header(const uint8_t* b) {
    uint32_t u[3];
    std::memcpy(u, b + 4, 12);
    const uint32_t sc_lo = u[0] & 0x3F3F3F3F, mn_lo = u[1] & 0x3F3F3F3F;
    const uint32_t sc_hi = (u[2] & 0x0F0F0F0F) | ((u[0] >> 2) & 0x30303030);
    const uint32_t mn_hi = ((u[2] >> 4) & 0x0F0F0F0F) | ((u[1] >> 2) & 0x30303030);
    const __m128i v = _mm_setr_epi32(static_cast<int>(sc_lo), static_cast<int>(sc_hi), static_cast<int>(mn_lo),
                                     static_cast<int>(mn_hi));   // bytes: 8 scales, 8 mins
    const __m128i twice = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);   // one per 16 values
    return {f16(b), f16(b + 2), _mm_shuffle_epi8(v, twice), _mm_shuffle_epi8(v, _mm_add_epi8(twice, _mm_set1_epi8(8)))};
  }
  static __m256i quants(const uint8_t* b, int i) { return low_or_high(load32(b + 16 + 32 * (i / 2)), i % 2); }
  static __m256i low_or_high(__m256i v, int high) {
    return _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, low4());
  }
};

// Q5_K, 176 bytes: f16 d | f16 dmin | scales[12] | qh[32] | qs[128]. As Q4_K, and bit i of qh[l] is bit 4
// of value l of sub-block i.
struct TQ5_K {
  static constexpr int64_t kValues = 256, kBytes = 176;
  static constexpr int kZero = 0;
  static constexpr bool kMin = true;
  static ScalesK header(const uint8_t* b) { return TQ4_K::header(b); }
  static __m256i quants(const uint8_t* b, int i) {
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(load32(b + 16), i), _mm256_set1_epi8(1));
    return _mm256_or_si256(TQ4_K::low_or_high(load32(b + 48 + 32 * (i / 2)), i % 2), _mm256_slli_epi16(hi, 4));
  }
};

// Q6_K, 210 bytes: ql[128] | qh[64] | int8 scales[16] | f16 d. Two halves of 128 values; in half h, with
// L = ql + 64h and H = qh + 32h, value l of its four 32-value quarters is
//   (L[l] & 15 | (H[l] & 3) << 4), (L[l + 32] & 15 | (H[l] >> 2 & 3) << 4),
//   (L[l] >> 4 | (H[l] >> 4 & 3) << 4), (L[l + 32] >> 4 | (H[l] >> 6) << 4).
// One scale per 16 values; value: (d * scale) * (q - 32).
struct TQ6_K {
  static constexpr int64_t kValues = 256, kBytes = 210;
  static constexpr int kZero = 32;
  static constexpr bool kMin = false;
  static ScalesK header(const uint8_t* b) {
    return {f16(b + 208), 0.0f, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)), _mm_setzero_si128()};
  }
  static __m256i quants(const uint8_t* b, int i) {
    const int h = i / 4, quarter = i % 4;
    const __m256i low = TQ4_K::low_or_high(load32(b + 64 * h + 32 * (quarter % 2)), quarter / 2);
    const __m256i H = load32(b + 128 + 32 * h);
    // bits 2 * quarter and 2 * quarter + 1 of H, moved to bits 4 and 5 (16-bit shifts: the mask drops
    // what crosses from the neighbouring byte)
    const __m256i two = quarter == 0 ? _mm256_slli_epi16(H, 4) : quarter == 1 ? _mm256_slli_epi16(H, 2)
                        : quarter == 2 ? H : _mm256_srli_epi16(H, 2);
    return _mm256_or_si256(low, _mm256_and_si256(two, _mm256_set1_epi8(0x30)));
  }
};

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
        dequant32<false, T::kMin>(T::quants(b, i), T::kZero, s.d * sc[2 * i], s.d * sc[2 * i + 1],
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

// f(T{}) with T the struct of a quantized qtype; false for the plain types (F32, F16, BF16).
template <typename F>
bool with_quant_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case Q4_0: f(TQ4_0{}); return true;
    case Q4_1: f(TQ4_1{}); return true;
    case Q5_0: f(TQ5_0{}); return true;
    case Q5_1: f(TQ5_1{}); return true;
    case Q8_0: f(TQ8_0{}); return true;
    case Q4_K: f(TQ4_K{}); return true;
    case Q5_K: f(TQ5_K{}); return true;
    case Q6_K: f(TQ6_K{}); return true;
    default: return false;
  }
}

// The row layout of raw for qtype and K; raw's rows may be strided (stride(0) >= row_bytes).
struct Layout {
  int64_t N, row_bytes, ld;
  const uint8_t* p;
};

Layout check_layout(const at::Tensor& raw, int64_t qtype, int64_t K, const char* what) {
  int64_t block = 1, bytes = 0;
  if (qtype == F32) bytes = 4;
  else if (qtype == F16 || qtype == BF16) bytes = 2;
  else if (!with_quant_type(qtype, [&](auto t) { block = decltype(t)::kValues, bytes = decltype(t)::kBytes; }))
    TORCH_CHECK(false, what, ": unsupported GGUF quantization type ", qtype,
                " (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)");
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.dim() == 2, what,
              ": raw must be a uint8 CPU tensor [N, row_bytes]");
  TORCH_CHECK(K > 0 && K % block == 0, what, ": K = ", K, " is not a multiple of the type's ", block, "-value blocks");
  const int64_t row_bytes = K / block * bytes;
  TORCH_CHECK(raw.size(1) == row_bytes, what, ": raw has ", raw.size(1), " bytes a row; K = ", K, " takes ", row_bytes);
  TORCH_CHECK(raw.stride(1) == 1 && (raw.size(0) <= 1 || raw.stride(0) >= row_bytes), what,
              ": raw's rows must each be contiguous");
  return {raw.size(0), row_bytes, raw.size(0) <= 1 ? row_bytes : raw.stride(0), raw.data_ptr<uint8_t>()};
}

void dequant_any_row(const Layout& w, int64_t qtype, int64_t K, int64_t n, float* out) {
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
// Activations for the integer dots: each row of x rounded to int8 in blocks of B values (256 for the
// K-quants, 32 otherwise), scale dx = max|x| / 127 per block, and the sums of every 16 rounded values.

// B values of x -> q[0..B-1], *dx, sum16[0..B/16-1].
void round_block(const float* v, int64_t B, int8_t* q, float* dx, int16_t* sum16) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 mx = _mm256_setzero_ps();
  for (int64_t k = 0; k < B; k += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + k)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  *dx = amax / 127.0f;
  const __m256 inv = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
  for (int64_t k = 0; k < B; k += 32) {
    __m256i i[4];
    for (int j = 0; j < 4; ++j)
      i[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + k + 8 * j), inv),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // packs work within 128-bit lanes; the permute puts the 32 values back in order
    const __m256i p = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), p);
    int32_t t[16];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(t), _mm256_add_epi32(i[0], i[1]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(t + 8), _mm256_add_epi32(i[2], i[3]));
    for (int h = 0; h < 2; ++h) {
      int32_t sum = 0;
      for (int j = 0; j < 8; ++j) sum += t[8 * h + j];
      sum16[k / 16 + h] = static_cast<int16_t>(sum);
    }
  }
}

struct Acts {
  int64_t K, B;
  std::vector<int8_t> q;        // [M, K]
  std::vector<float> dx;        // [M, K / B]
  std::vector<int16_t> sum16;   // [M, K / 16]
  Acts(const at::Tensor& x, int64_t B) : K(x.size(1)), B(B), q(x.numel()), dx(x.numel() / B), sum16(x.numel() / 16) {
    const float* xp = x.data_ptr<float>();
    at::parallel_for(0, x.numel() / B, 4096 / B, [&](int64_t b, int64_t e) {
      for (int64_t blk = b; blk < e; ++blk)
        round_block(xp + blk * B, B, q.data() + blk * B, dx.data() + blk, sum16.data() + blk * B / 16);
    });
  }
};

// ---------------------------------------------------------------------------------------------
// Integer dots, few rows: out[m, n] for MR rows of x (from x row m0) and weight rows [n0, n1).

// K-quants. Per super-block and row, in int32: sum_g sc[g] * (sum of q * x over group g), the int16
// products of two 32-value vectors at a time summed pairwise (maddubs, hadd) and scaled (madd); less
// kZero * sum_g sc[g] * sum16[g]. Times d * dx; less dmin * dx * sum_g mn[g] * sum16[g].
template <typename T, int MR>
void kquant_dot(const Acts& a, int64_t m0, const Layout& w, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  const int64_t S = a.K / 256;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.p + n * w.ld;
    __m256 acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      const uint8_t* b = row + s * T::kBytes;
      const ScalesK h = T::header(b);
      __m256i dot[MR];
      for (int m = 0; m < MR; ++m) dot[m] = _mm256_setzero_si256();
      for (int i = 0; i < 8; i += 2) {   // two 32-value vectors at a time
        const __m256i q0 = T::quants(b, i), q1 = T::quants(b, i + 1);
        // hadd of their int16 products leaves groups 2i, 2i + 2 in the low lane, 2i + 1, 2i + 3 in the high
        // one (4 sums each; at most 4 * 63 * 127 in magnitude, within int16): their scales, as 16 int16
        const int64_t g = 2 * i, four = 0x01010101;
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
            h.sc, _mm_set_epi64x(four * (g + 3) << 32 | four * (g + 1), four * (g + 2) << 32 | four * g)));
        for (int m = 0; m < MR; ++m) {
          const int8_t* xm = a.q.data() + (m0 + m) * a.K + 256 * s + 32 * i;
          const __m256i p =
              _mm256_hadd_epi16(_mm256_maddubs_epi16(q0, load32(xm)), _mm256_maddubs_epi16(q1, load32(xm + 32)));
          dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(p, sc));
        }
      }
      const __m256i sc16 = _mm256_cvtepi8_epi16(h.sc), mn16 = _mm256_cvtepi8_epi16(h.mn);
      const __m256i zsc16 = _mm256_mullo_epi16(sc16, _mm256_set1_epi16(T::kZero));
      for (int m = 0; m < MR; ++m) {
        const int64_t blk = (m0 + m) * (a.K / 256) + s;
        const __m256i sums = load32(a.sum16.data() + 16 * blk);
        if constexpr (T::kZero != 0) dot[m] = _mm256_sub_epi32(dot[m], _mm256_madd_epi16(zsc16, sums));
        const float dx = a.dx[blk];
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), _mm256_set1_ps(h.d * dx), acc[m]);
        if constexpr (T::kMin)
          acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mn16, sums)), _mm256_set1_ps(h.dmin * dx),
                                    acc[m]);
      }
    }
    for (int m = 0; m < MR; ++m) out[m * ldo + n] = hsum(acc[m]);
  }
}

// The AVX-512 VNNI variant of kquant_dot for Q4_K and Q6_K (use_avx512(): chosen at run time; compiled for
// AVX-512 only inside these functions, the rest of the file stays AVX2). 64 values a vector: vpmaddubsw
// gives the int16 sums of value pairs, vpdpwssd multiplies them by their 16-value group's scale and adds
// them into int32 lanes (AVX2: maddubs, hadd, madd and an add per 64 values). The same integer sums as
// kquant_dot; the float sums of the super-blocks run over 16 lanes instead of 8 (results agree to float
// rounding), and a row's result never depends on the rows around it.
#define LLMSERVE_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

bool cpu_has_avx512_vnni() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return ok;
}

bool avx512_allowed = true;

bool use_avx512() { return avx512_allowed && cpu_has_avx512_vnni(); }

// values 64c .. 64c + 63 of a Q4_K super-block: qs[32c ..] low nibbles (sub-block 2c), then high (2c + 1)
LLMSERVE_AVX512 inline __m512i q4k_quants64(const uint8_t* b, int c) {
  const __m256i v = load32(b + 16 + 32 * c);
  return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1),
                          _mm512_set1_epi8(0x0F));
}

// values 64c .. 64c + 63 of a Q6_K super-block (TQ6_K's layout: half h = c / 2, its quarters 0, 1 for even
// c, 2, 3 for odd): the low nibbles or high ones of L[0 .. 63], bits 4 and 5 from H (first 32 values) and
// H >> 2 (next 32), shifted by 4 (even c) or not (odd c); 16-bit shifts, the masks keep each byte's own bits
LLMSERVE_AVX512 inline __m512i q6k_quants64(const uint8_t* b, int c) {
  const int h = c / 2;
  const __m512i L = _mm512_loadu_si512(b + 64 * h);
  const __m256i H = load32(b + 128 + 32 * h);
  const __m512i H2 = _mm512_inserti64x4(_mm512_castsi256_si512(H), _mm256_srli_epi16(H, 2), 1);
  const __m512i low4 = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30);
  if (c % 2 == 0)
    return _mm512_or_si512(_mm512_and_si512(L, low4), _mm512_and_si512(_mm512_slli_epi16(H2, 4), two));
  return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), low4), _mm512_and_si512(H2, two));
}

template <typename T, int MR>
LLMSERVE_AVX512 void kquant_dot_avx512(const Acts& a, int64_t m0, const Layout& w, int64_t n0, int64_t n1, float* out,
                                       int64_t ldo) {
  const int64_t S = a.K / 256;
  // int16 lane j of chunk c's products covers values 64c + 2j, + 1: group 4c + j / 8
  __m512i gidx[4];
  for (int c = 0; c < 4; ++c) {
    alignas(64) int16_t idx[32];
    for (int j = 0; j < 32; ++j) idx[j] = static_cast<int16_t>(4 * c + j / 8);
    gidx[c] = _mm512_load_si512(idx);
  }
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.p + n * w.ld;
    __m512 acc[MR], macc[MR];   // (two chains: the scales' and the mins' products)
    for (int m = 0; m < MR; ++m) acc[m] = macc[m] = _mm512_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      const uint8_t* b = row + s * T::kBytes;
      const ScalesK h = T::header(b);
      const __m256i sc16 = _mm256_cvtepi8_epi16(h.sc), mn16 = _mm256_cvtepi8_epi16(h.mn);
      __m512i q[4], sc[4];
      for (int c = 0; c < 4; ++c) {
        q[c] = std::is_same_v<T, TQ4_K> ? q4k_quants64(b, c) : q6k_quants64(b, c);
        sc[c] = _mm512_permutexvar_epi16(gidx[c], _mm512_castsi256_si512(sc16));
      }
      const __m256i zsc16 = _mm256_mullo_epi16(sc16, _mm256_set1_epi16(T::kZero));
      for (int m = 0; m < MR; ++m) {
        const int8_t* xm = a.q.data() + (m0 + m) * a.K + 256 * s;
        __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();   // two chains
        for (int c = 0; c < 4; c += 2) {
          d0 = _mm512_dpwssd_epi32(d0, _mm512_maddubs_epi16(q[c], _mm512_loadu_si512(xm + 64 * c)), sc[c]);
          d1 = _mm512_dpwssd_epi32(d1, _mm512_maddubs_epi16(q[c + 1], _mm512_loadu_si512(xm + 64 * c + 64)), sc[c + 1]);
        }
        __m512i dot = _mm512_add_epi32(d0, d1);
        const int64_t blk = (m0 + m) * S + s;
        const __m256i sums = load32(a.sum16.data() + 16 * blk);
        if constexpr (T::kZero != 0) dot = _mm512_sub_epi32(dot, _mm512_zextsi256_si512(_mm256_madd_epi16(zsc16, sums)));
        const float dx = a.dx[blk];
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(h.d * dx), acc[m]);
        if constexpr (T::kMin)
          macc[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(_mm512_zextsi256_si512(_mm256_madd_epi16(mn16, sums))),
                                     _mm512_set1_ps(h.dmin * dx), macc[m]);
      }
    }
    for (int m = 0; m < MR; ++m) out[m * ldo + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], macc[m]));
  }
}

// 32-value types. Per block and row: sum q * x in int32 (Q8_0's signed q: |q| times x with q's sign),
// less kZero * sum x; times d * dx; plus m * dx * sum x.
template <typename T, int MR>
void block32_dot(const Acts& a, int64_t m0, const Layout& w, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  const int64_t G = a.K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.p + n * w.ld;
    __m256 acc[MR];
    float macc[MR] = {};
    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* b = row + g * T::kBytes;
      const Scales32 h = T::header(b);
      const __m256i q = T::quants(b);
      const __m256i uq = T::kSigned ? _mm256_sign_epi8(q, q) : q;
      for (int m = 0; m < MR; ++m) {
        const int64_t blk = (m0 + m) * G + g;
        __m256i xv = load32(a.q.data() + 32 * blk);
        if constexpr (T::kSigned) xv = _mm256_sign_epi8(xv, q);
        __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(uq, xv), ones);
        const int32_t xsum = a.sum16[2 * blk] + a.sum16[2 * blk + 1];
        if constexpr (T::kZero != 0)   // (in one lane: the lanes are summed in the end)
          dot = _mm256_sub_epi32(dot, _mm256_setr_epi32(T::kZero * xsum, 0, 0, 0, 0, 0, 0, 0));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(h.d * a.dx[blk]), acc[m]);
        if constexpr (T::kMin) macc[m] += h.m * a.dx[blk] * static_cast<float>(xsum);
      }
    }
    for (int m = 0; m < MR; ++m) out[m * ldo + n] = hsum(acc[m]) + macc[m];
  }
}

constexpr int64_t kTileBytes = 256 << 10;   // weight rows revisited for every 4 rows of x, while in L2

// The dots of T's rows [n0, n1) of w for every row of x: tiles of rows, each read once per 4 rows of x.
template <typename T>
void dot_range(const Acts& a, int64_t M, const Layout& w, int64_t n0, int64_t n1, float* op, int64_t ldo) {
  constexpr bool kWide = std::is_same_v<T, TQ4_K> || std::is_same_v<T, TQ6_K>;   // with an AVX-512 variant
  const bool wide = kWide && use_avx512();
  const int64_t tile = std::max<int64_t>(1, kTileBytes / w.row_bytes);
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(n1, t0 + tile);
    for (int64_t m = 0; m < M; m += 4) {
      float* o = op + m * ldo;
      auto run = [&](auto mr) {
        constexpr int MR = decltype(mr)::value;
        if constexpr (T::kValues == 256) {
          if constexpr (kWide) {
            if (wide) return kquant_dot_avx512<T, MR>(a, m, w, t0, t1, o, ldo);
          }
          kquant_dot<T, MR>(a, m, w, t0, t1, o, ldo);
        } else {
          block32_dot<T, MR>(a, m, w, t0, t1, o, ldo);
        }
      };
      switch (std::min<int64_t>(4, M - m)) {
        case 1: run(std::integral_constant<int, 1>{}); break;
        case 2: run(std::integral_constant<int, 2>{}); break;
        case 3: run(std::integral_constant<int, 3>{}); break;
        default: run(std::integral_constant<int, 4>{}); break;
      }
    }
  }
}

// One GGUF tensor of a projection: its N rows are the output's columns [col, col + N).
struct Part {
  Layout w;
  int64_t qtype, col;
};

// out [M, ldo]: every part's columns = x @ dequantize(part).T through the integer dots (quantized types
// only). x is rounded once per block size; one parallel region over all the parts' rows.
void dot_parts(const at::Tensor& x, const std::vector<Part>& parts, int64_t ldo, float* op) {
  const int64_t M = x.size(0);
  std::optional<Acts> a256, a32;
  for (const Part& p : parts) {
    with_quant_type(p.qtype, [&](auto t) {
      if (decltype(t)::kValues == 256 && !a256) a256.emplace(x, 256);
      if (decltype(t)::kValues == 32 && !a32) a32.emplace(x, 32);
    });
  }
  at::parallel_for(0, ldo, 16, [&](int64_t b, int64_t e) {
    for (const Part& p : parts) {
      const int64_t n0 = std::max(b, p.col) - p.col, n1 = std::min(e, p.col + p.w.N) - p.col;
      if (n0 >= n1) continue;
      with_quant_type(p.qtype, [&](auto t) {
        using T = decltype(t);
        dot_range<T>(T::kValues == 256 ? *a256 : *a32, M, p.w, n0, n1, op + p.col, ldo);
      });
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Many rows (prefill, big batches): tiles of weight rows dequantized to float32, multiplied with at::mm.

constexpr int64_t kDequantTileRows = 256;

void tiled_matmul(const at::Tensor& x, const Layout& w, int64_t qtype, at::Tensor& out) {
  const int64_t K = x.size(1), N = w.N;
  at::Tensor t = at::empty({std::min(kDequantTileRows, N), K}, x.options());
  float* tp = t.data_ptr<float>();
  for (int64_t n0 = 0; n0 < N; n0 += kDequantTileRows) {
    const int64_t nt = std::min(kDequantTileRows, N - n0);
    at::parallel_for(0, nt, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) dequant_any_row(w, qtype, K, n0 + r, tp + r * K);
    });
    out.narrow(1, n0, nt).copy_(at::mm(x, t.narrow(0, 0, nt).t()));
  }
}

// Few rows, float32 activations (the float32-exact mode): each weight row dequantized once into a buffer
// that stays in L1 and dotted with every row of x in float32. One parallel region a call, where the tiles
// take one (and an at::mm) per 256 weight rows.
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

// out [M, N] = x [M, K] @ dequantize(raw).T in float32 (weights widened, activations as they are): up to
// few_rows rows through float_rows, more through the tiles and at::mm.
at::Tensor linear_f32(const at::Tensor& x_in, const at::Tensor& raw, int64_t qtype, int64_t K, int64_t few_rows) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "linear_f32: x must be a float32 CPU tensor [M, K]");
  TORCH_CHECK(x_in.size(1) == K, "linear_f32: x has ", x_in.size(1), " columns, the weights K = ", K);
  const Layout w = check_layout(raw, qtype, K, "linear_f32");
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), w.N}, x.options());
  if (x.size(0) == 0 || w.N == 0) return out;
  if (x.size(0) <= few_rows) float_rows(x, w, qtype, out);
  else tiled_matmul(x, w, qtype, out);
  return out;
}

// out [M, N] = x [M, K] @ dequantize(raw).T; rows < many_rows through the integer dots (the quantized
// types; F32 / F16 / BF16 always through the tiles).
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& raw, int64_t qtype, int64_t K, int64_t many_rows) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "linear: x must be a float32 CPU tensor [M, K]");
  TORCH_CHECK(x_in.size(1) == K, "linear: x has ", x_in.size(1), " columns, the weights K = ", K);
  const Layout w = check_layout(raw, qtype, K, "linear");
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), w.N}, x.options());
  if (x.size(0) == 0 || w.N == 0) return out;
  if (x.size(0) < many_rows && with_quant_type(qtype, [](auto) {})) {
    dot_parts(x, {{w, qtype, 0}}, w.N, out.data_ptr<float>());
    return out;
  }
  tiled_matmul(x, w, qtype, out);
  return out;
}

// x [M, K] @ the parts' weights side by side, through the integer dots (see gguf_ops.h).
at::Tensor linear_parts(const at::Tensor& x_in, const std::vector<at::Tensor>& raws, const std::vector<int64_t>& qtypes) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "linear_parts: x must be a float32 CPU tensor [M, K]");
  TORCH_CHECK(!raws.empty() && raws.size() == qtypes.size(), "linear_parts: one qtype per part");
  const int64_t K = x_in.size(1);
  std::vector<Part> parts;
  int64_t N = 0;
  for (size_t i = 0; i < raws.size(); ++i) {
    TORCH_CHECK(with_quant_type(qtypes[i], [](auto) {}), "linear_parts: ", qtypes[i], " is not a quantized type");
    parts.push_back({check_layout(raws[i], qtypes[i], K, "linear_parts"), qtypes[i], N});
    N += parts.back().w.N;
  }
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) > 0 && N > 0) dot_parts(x, parts, N, out.data_ptr<float>());
  return out;
}

}  // namespace

namespace llmserve_gguf {

at::Tensor dequantize(const at::Tensor& raw, int64_t qtype, int64_t K) { return ::dequantize(raw, qtype, K); }

at::Tensor linear(const at::Tensor& x, const at::Tensor& raw, int64_t qtype, int64_t K, int64_t many_rows) {
  return ::linear(x, raw, qtype, K, many_rows);
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& raw, int64_t qtype, int64_t K, int64_t few_rows) {
  return ::linear_f32(x, raw, qtype, K, few_rows);
}

at::Tensor linear_parts(const at::Tensor& x, const std::vector<at::Tensor>& raws, const std::vector<int64_t>& qtypes) {
  return ::linear_parts(x, raws, qtypes);
}

bool set_avx512(bool allowed) {
  avx512_allowed = allowed;
  return use_avx512();
}

bool uses_avx512() { return use_avx512(); }

}  // namespace llmserve_gguf
