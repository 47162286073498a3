// Vector helpers every kernel file shares (AVX2 + FMA + F16C; exp16 in AVX-512): horizontal sums and maxima,
// exp, float16 loads and stores, and the argument check of a float32 CPU tensor.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "isa.h"

namespace llmserve {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// _mm512_reduce_add_ps's sum of 16 lanes in its order (GCC's avx512fintrin.h: the halves added, then the quarters,
// then lanes 0 + 2 and 1 + 3), for the portable twins of the AVX-512 kernels (AVX2 floor, any CPU)
inline float reduce_add16(const float (&v)[16]) {
  float h[8], q[4];
  for (int i = 0; i < 8; ++i) h[i] = v[8 + i] + v[i];
  for (int i = 0; i < 4; ++i) q[i] = h[4 + i] + h[i];
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// [sum(v[0]), ..., sum(v[7])]: eight horizontal sums at once
inline __m256 hsum8(const __m256 (&v)[8]) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);   // lanes: v0..v3 low | v0..v3 high
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for 8 floats: x = n ln2 + r, |r| <= ln2/2, exp(r) by its Taylor series to r^7 (relative
// error below 1e-7 on that interval), times 2^n. Inputs are clamped to [-87, 88].
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// exp(x) for 16 floats x <= 0 (scores minus their max): exp8's series, 2^n applied with vscalefps (x
// clamped below only, at -87 as exp8).
LLMSERVE_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 8 float16 values -> 8 floats
inline __m256 load_half8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 bfloat16 values -> 8 floats (exact: a bfloat16 is a float32's upper 16 bits; AVX2, no bf16 instruction)
inline __m256 load_bf16x8(const at::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// 8 values of a KV cache (float32, float16 or bfloat16) as floats, and back
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return load_half8(p); }
inline __m256 load8(const at::BFloat16* p) { return load_bf16x8(p); }
inline void store_kv(const float* src, int64_t n, float* dst) { std::copy(src, src + n, dst); }
inline void store_kv(const float* src, int64_t n, at::Half* dst) {   // n % 8 == 0; round to nearest even
  for (int64_t i = 0; i < n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// float32 -> bfloat16 rounded to nearest even, as torch's .to(torch.bfloat16) rounds finite values and infinities, in
// integer AVX2 so that every CPU writes the same bits (AVX512-BF16's vcvtneps2bf16 rounds the same way). A NaN is
// written as the quiet NaN 0x7FC0 (torch's own paths differ there: its vectorized conversion wrote 0xFFFF; a NaN
// stays a NaN either way)
inline void store_kv(const float* src, int64_t n, at::BFloat16* dst) {   // n % 8 == 0
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF), qnan = _mm256_set1_epi32(0x7FC0);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    const __m256i b = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(bias, lsb)), 16);
    r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), w);
  }
}

// int8 KV rows (--kv-cache-dtype int8, llmserve.model.attention.quantize_kv): a head's D values rounded to int8,
// then their scale (max |x| / 127) as a float32 in the next 4 bytes; a row is D + kKVScale elements wide.
constexpr int64_t kKVScale = 4;
inline __m256 load8(const int8_t* p) {   // 8 int8 values as floats (the row's scale not applied)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float kv_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof(float));
  return s;
}
// One head's D floats (D % 8 == 0) into an int8 row: the same bits as quantize_kv (x / s rounded to nearest
// even, s = amax / 127 in float32; s = 0 and zeros for a row of zeros).
inline void quantize_kv_row(const float* src, int64_t D, int8_t* dst) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(src + i), abs_mask));
  const float scale = hmax(m) / 127.0f;
  const __m256 div = _mm256_set1_ps(scale > 0.0f ? scale : 1.0f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  for (int64_t i = 0; i < D; i += 8) {
    __m256i q = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(src + i), div));   // MXCSR: nearest even
    q = _mm256_min_epi32(_mm256_max_epi32(q, lo), hi);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), _mm_packs_epi16(w, w));
  }
  std::memcpy(dst + D, &scale, sizeof(float));
}
// Keys or values of one token (heads x D floats) into a cache row of each type: `heads` rows of D (+ the scale)
template <typename T>  // float, at::Half, at::BFloat16: the heads' rows are contiguous
inline void store_kv_heads(const float* src, int64_t heads, int64_t D, T* dst) {
  store_kv(src, heads * D, dst);
}
inline void store_kv_heads(const float* src, int64_t heads, int64_t D, int8_t* dst) {
  for (int64_t h = 0; h < heads; ++h) quantize_kv_row(src + h * D, D, dst + h * (D + kKVScale));
}
// the row width of a cache of `type` for heads of D values
inline int64_t kv_row(at::ScalarType type, int64_t D) { return type == at::kChar ? D + kKVScale : D; }
inline bool kv_cache_type(at::ScalarType type) {
  return type == at::kFloat || type == at::kHalf || type == at::kBFloat16 || type == at::kChar;
}

// a little-endian float16 at p (GGUF's fields: any alignment)
inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

inline void check_cpu_f32(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, what, ": expected a float32 CPU tensor");
}

// One round of a 16 x 16 transpose of dwords: the off-diagonal blocks of size H of every 2H x 2H block swapped (row
// i, bit H clear, with row i + H), one vpermt2d a row. Unrolled: the rows stay in registers.
template <int H>
LLMSERVE_AVX512 inline void transpose_round(__m512i (&r)[16]) {
  constexpr auto lo = [](int c) { return c & H ? 16 + c - H : c; };   // row i: its own dwords, row i + H's beside them
  constexpr auto hi = [](int c) { return c & H ? 16 + c : c + H; };   // row i + H: row i's dwords, then its own
  const __m512i il = _mm512_setr_epi32(lo(0), lo(1), lo(2), lo(3), lo(4), lo(5), lo(6), lo(7), lo(8), lo(9), lo(10),
                                       lo(11), lo(12), lo(13), lo(14), lo(15));
  const __m512i ih = _mm512_setr_epi32(hi(0), hi(1), hi(2), hi(3), hi(4), hi(5), hi(6), hi(7), hi(8), hi(9), hi(10),
                                       hi(11), hi(12), hi(13), hi(14), hi(15));
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    if (i & H) continue;
    const __m512i a = r[i], b = r[i + H];
    r[i] = _mm512_permutex2var_epi32(a, il, b);
    r[i + H] = _mm512_permutex2var_epi32(a, ih, b);
  }
}

// r[i] <- dword i of every r[j]
LLMSERVE_AVX512 inline void transpose16_epi32(__m512i (&r)[16]) {
  transpose_round<8>(r);
  transpose_round<4>(r);
  transpose_round<2>(r);
  transpose_round<1>(r);
}

}  // namespace llmserve
