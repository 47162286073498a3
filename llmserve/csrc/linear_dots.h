// The integer dot products of few rows (decode) on weights in 32-value blocks: x rounded per block, a weight
// block times an x block summed in int32, then scaled by (weight scale * dx). linear.cpp's q4_linear and
// q8_linear run them; vnni.cpp rounds x as they do (Rows).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace llmserve {

// Integer dot products (few rows). Each 32-value block of x is rounded to integers with its own
// scale dx; a weight block times an x block is summed in int32, then scaled by (weight scale * dx).
//  * int4 weights: x rounded to int8 (dx = max|x| / 127) and vpmaddubsw, as llama.cpp's Q4_1 x Q8_1
//    dot product: single-stream decode is bound by memory traffic, and this is the cheapest dot;
//  * int8 weights: x rounded to int16 (dx = max|x| / 32767, relative error ~1e-5) and vpmaddwd: the
//    accuracy mode. (Rounding x to int8 there cost this model 1.3 points of greedy agreement with
//    float32, below the 95% the int8 mode promises; measured, see docs/engine.md.)

template <typename T> inline constexpr float kMaxQ = 127.0f;
template <> inline constexpr float kMaxQ<int16_t> = 32767.0f;

// x [M, K] -> xq [M, K] (int8 or int16), dx [M, K/32], xsum [M, K/32] (float sums, for int4's min).
// `q8_1` (int8 only; a GGUF's Q4_0 / Q4_1 blocks, gguf mode): stored as llama.cpp's Q8_1 blocks store them, dx
// rounded to float16 and the sum that of the rounded values, d * sum(q) rounded to float16, not the float sum of x.
// The min term of a Q4_1 block then takes llama.cpp's value: teacher-forced agreement with llama.cpp on the bundled
// Q4_1 file 95.8% -> 97%+ (BENCHMARKS.md). llmserve's own int4 mode keeps the float32 d and float sum, the closer
// to float32 of the two (it is judged against float32, not llama.cpp).
template <typename T>
void quantize_rows(const float* x, int64_t M, int64_t K, T* xq, float* dx, float* xsum, bool q8_1 = false) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < K / 32; ++g) {
      const float* v = x + m * K + 32 * g;
      const __m256 a0 = _mm256_loadu_ps(v), a1 = _mm256_loadu_ps(v + 8), a2 = _mm256_loadu_ps(v + 16), a3 = _mm256_loadu_ps(v + 24);
      const float sum = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
      const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a0), _mm256_andnot_ps(sign, a1)),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, a2), _mm256_andnot_ps(sign, a3)));
      const float amax = hmax(mx);
      const __m256 id = _mm256_set1_ps(amax > 0 ? kMaxQ<T> / amax : 0.0f);
      const __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(a0, id), rnd));
      const __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(a1, id), rnd));
      const __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(a2, id), rnd));
      const __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(a3, id), rnd));
      // packs work within 128-bit lanes; the permutes put the values back in order
      const __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
      if constexpr (sizeof(T) == 2) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K + 32 * g), _mm256_permute4x64_epi64(p01, 0xD8));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K + 32 * g + 16), _mm256_permute4x64_epi64(p23, 0xD8));
      } else {
        const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K + 32 * g), p);
      }
      if constexpr (sizeof(T) == 1) {
        if (q8_1) {
          const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
          const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
          const __m128i h2 = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
          const int isum = _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 0xB1)));
          const float d = amax / kMaxQ<T>;
          dx[m * (K / 32) + g] = _cvtsh_ss(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT));
          xsum[m * (K / 32) + g] = _cvtsh_ss(_cvtss_sh(d * static_cast<float>(isum), _MM_FROUND_TO_NEAREST_INT));
          continue;
        }
      }
      dx[m * (K / 32) + g] = amax / kMaxQ<T>;
      xsum[m * (K / 32) + g] = sum;
    }
}

// sd[m * G + g] = s[g] * dx[m * G + g]: the float factor of each block's integer dot product.
template <int MR, typename S>
inline void block_scales(const S* s, const float* dx, int64_t G, float* sd) {
  for (int m = 0; m < MR; ++m) {
    int64_t g = 0;
    if constexpr (std::is_same_v<S, at::Half>)
      for (; g + 8 <= G; g += 8)
        _mm256_storeu_ps(sd + m * G + g, _mm256_mul_ps(load_half8(s + g), _mm256_loadu_ps(dx + m * G + g)));
    else
      for (; g + 8 <= G; g += 8)
        _mm256_storeu_ps(sd + m * G + g, _mm256_mul_ps(_mm256_loadu_ps(s + g), _mm256_loadu_ps(dx + m * G + g)));
    for (; g < G; ++g) sd[m * G + g] = static_cast<float>(s[g]) * dx[m * G + g];
  }
}

// step(g, acc) for every block g, even blocks into acc[0] and odd ones into acc[1]: two accumulators
// per row halve the FMA latency chain (a runtime index into acc would keep them in memory).
template <typename Step, int MR>
inline void two_chains(int64_t G, Step& step, __m256 (&acc)[2][MR]) {
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) {
    step(g, acc[0]);
    step(g + 1, acc[1]);
  }
  if (g < G) step(g, acc[0]);
}

// int4 weights (scale and min as float16, Q4_1's block) x int8 activations, rows [n0, n1), MR rows
// of x.
template <int MR>
void q4_block(const int8_t* xq, const float* dx, const float* xsum, const uint8_t* qw, const at::Half* sc,
              const at::Half* mn, int64_t K, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  const int64_t G = K / 32;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  std::vector<float> sdv(MR * G);
  float* sd = sdv.data();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = qw + n * (K / 2);
    block_scales<MR>(sc + n * G, dx, G, sd);
    __m256 acc[2][MR];
    for (int m = 0; m < MR; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
    auto step = [&](int64_t g, __m256* a) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * g));
      const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), low);
      for (int m = 0; m < MR; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + 32 * g));
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
        a[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(sd + m * G + g), a[m]);
      }
    };
    two_chains(G, step, acc);
    // + sum_g min[g] * xsum[m, g], vectorized (a scalar chain here costs as much as the dots)
    const at::Half* mi = mn + n * G;
    for (int m = 0; m < MR; ++m) {
      const float* xs = xsum + m * G;
      __m256 a = _mm256_add_ps(acc[0][m], acc[1][m]);
      int64_t j = 0;
      for (; j + 8 <= G; j += 8) a = _mm256_fmadd_ps(load_half8(mi + j), _mm256_loadu_ps(xs + j), a);
      float r = hsum(a);
      for (; j < G; ++j) r += static_cast<float>(mi[j]) * xs[j];
      out[m * ldo + n] = r;
    }
  }
}

// int8 weights with one float32 scale per `group` values (a multiple of 32; K for per channel) x
// int16 activations (vpmaddwd), or int8 ones (vpmaddubsw on |w| and x with w's sign, as llama.cpp's
// Q8_0 x Q8_0: the cheaper dot, used by int4 mode's LM head).
template <int MR, typename T>
void q8_block(const T* xq, const float* dx, const int8_t* qw, const float* sc, int64_t K, int64_t group,
              int64_t n0, int64_t n1, float* out, int64_t ldo) {
  const int64_t G = K / 32, per = group / 32;
  std::vector<float> sdv(MR * G), sw(G);
  float* sd = sdv.data();
  // the blocks' factors: per-32 scales as they are; per channel: x's block scales once, the row's
  // scale at the end (per-row work is a fifth of a short row's time: the LM head's rows are 576 long)
  const bool per_channel = per == G && G > 1;
  if (per_channel) {
    std::fill(sw.begin(), sw.end(), 1.0f);
    block_scales<MR>(sw.data(), dx, G, sd);
  }
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* q = qw + n * K;
    const float* s = sc + n * (K / group);
    if (per == 1) {
      block_scales<MR>(s, dx, G, sd);
    } else if (!per_channel) {
      for (int64_t i = 0; i < K / group; ++i) std::fill(sw.begin() + i * per, sw.begin() + (i + 1) * per, s[i]);
      block_scales<MR>(sw.data(), dx, G, sd);
    }
    __m256 acc[2][MR];
    for (int m = 0; m < MR; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
    auto step = [&](int64_t g, __m256* a) {
      if constexpr (sizeof(T) == 2) {
        const __m256i wl = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32 * g)));
        const __m256i wh = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32 * g + 16)));
        for (int m = 0; m < MR; ++m) {
          const T* xm = xq + m * K + 32 * g;
          const __m256i p = _mm256_add_epi32(
              _mm256_madd_epi16(wl, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm))),
              _mm256_madd_epi16(wh, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + 16))));
          a[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(sd + m * G + g), a[m]);
        }
      } else {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * g));
        const __m256i aw = _mm256_sign_epi8(w, w), ones = _mm256_set1_epi16(1);
        for (int m = 0; m < MR; ++m) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + 32 * g));
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w)), ones);
          a[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(sd + m * G + g), a[m]);
        }
      }
    };
    two_chains(G, step, acc);
    const float row_scale = per_channel ? s[0] : 1.0f;
    for (int m = 0; m < MR; ++m) out[m * ldo + n] = row_scale * hsum(_mm256_add_ps(acc[0][m], acc[1][m]));
  }
}

template <typename T>
struct Rows {   // x rounded per 32-value block
  std::vector<T> q;
  std::vector<float> dx, sum;
  explicit Rows(const at::Tensor& x, bool q8_1 = false) : q(x.numel()), dx(x.numel() / 32), sum(x.numel() / 32) {
    quantize_rows<T>(x.data_ptr<float>(), x.size(0), x.size(1), q.data(), dx.data(), sum.data(), q8_1);
  }
};

}  // namespace llmserve
