// GGUF's integer dots (few rows, and many by default: llama.cpp's arithmetic): x rounded to int8 per 256 values for
// the K-quants and IQ4_XS (as llama.cpp's Q8_K) and per 32 for Q5_0 / Q5_1 / IQ4_NL / MXFP4 (as its Q8_0; Q4_0, Q4_1 and Q8_0 run
// linear.cpp's q4 / q8 dots on their repacked blocks, see gguf_blocks.h's with_dot_type), with the sums of every 16
// rounded values for the blocks' offsets and mins; each block unpacked once for up to 4 rows of x. The Q4_K / Q6_K
// dots also in AVX-512 VNNI (vnni_kernels(): the instructions, or their portable twin).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_panels.h"
#include "isa.h"
#include "vec.h"

namespace llmserve::gguf {

namespace {

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

// ---------------------------------------------------------------------------------------------
// Integer dots, few rows: out[m, n] for MR rows of x (from x row m0) and weight rows [n0, n1).

// K-quants. Per super-block and row, in int32: sum_g sc[g] * (sum of q * x over group g), the int16
// products of two 32-value vectors at a time summed pairwise (maddubs, hadd) and scaled (madd); less
// kZero * sum_g sc[g] * sum16[g]. Times d * dx; less dmin * dx * sum_g mn[g] * sum16[g]. IQ4_XS (signed values):
// per 32-value vector, |q| times x with q's sign (maddubs) and its scale (madd), no pairwise sum.
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
      if constexpr (T::kSigned) {   // IQ4_XS: signed values (|v| <= 127), one scale per 32 values
        alignas(16) int8_t sc[16];
        _mm_store_si128(reinterpret_cast<__m128i*>(sc), h.sc);
        for (int i = 0; i < 8; ++i) {
          const __m256i q = T::quants(b, i), aq = _mm256_sign_epi8(q, q), s16 = _mm256_set1_epi16(sc[2 * i]);
          for (int m = 0; m < MR; ++m) {   // |q| * (x with q's sign): pairs within int16 (2 * 127 * 127)
            const __m256i xm = load32(a.q.data() + (m0 + m) * a.K + 256 * s + 32 * i);
            const __m256i p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(xm, q));
            dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(p, s16));
          }
        }
      } else {
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

// The AVX-512 VNNI variant of kquant_dot for Q4_K and Q6_K (use_vnni(): chosen at run time; compiled for
// AVX-512 only inside these functions, the rest of the file stays AVX2). 64 values a vector: vpmaddubsw
// gives the int16 sums of value pairs, vpdpwssd multiplies them by their 16-value group's scale and adds
// them into int32 lanes (AVX2: maddubs, hadd, madd and an add per 64 values). The same integer sums as
// kquant_dot; the float sums of the super-blocks run over 16 lanes instead of 8 (results agree to float
// rounding), and a row's result never depends on the rows around it. Its portable twin, kquant_dot_twin, gives the
// same bits on any CPU (toggles.vnni_twin, as the other VNNI kernels' twins).

// values 64c .. 64c + 63 of a Q4_K super-block: qs[32c ..] low nibbles (sub-block 2c), then high (2c + 1)
LLMSERVE_AVX512_VNNI inline __m512i q4k_quants64(const uint8_t* b, int c) {
  const __m256i v = load32(b + 16 + 32 * c);
  return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1),
                          _mm512_set1_epi8(0x0F));
}

// values 64c .. 64c + 63 of a Q6_K super-block (TQ6_K's layout: half h = c / 2, its quarters 0, 1 for even
// c, 2, 3 for odd): the low nibbles or high ones of L[0 .. 63], bits 4 and 5 from H (first 32 values) and
// H >> 2 (next 32), shifted by 4 (even c) or not (odd c); 16-bit shifts, the masks keep each byte's own bits
LLMSERVE_AVX512_VNNI inline __m512i q6k_quants64(const uint8_t* b, int c) {
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
LLMSERVE_AVX512_VNNI void kquant_dot_avx512(const Acts& a, int64_t m0, const Layout& w, int64_t n0, int64_t n1, float* out,
                                       int64_t ldo) {
  const int64_t S = a.K / 256, kAhead = 4 * T::kBytes;
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
      if (MR == 1)   // one pass over the weights: their bytes come from memory, a few blocks ahead
        for (int64_t l = 0; l < T::kBytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(b + kAhead + l), _MM_HINT_T0);
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

// The portable twin of kquant_dot_avx512 (LLMSERVE_VNNI=twin): per row of x and weight row, the same 16 int32 lanes
// (lane i of chunk c: values 64c + 4i .. + 3, their pair sums saturated to int16 as vpmaddubsw, times group
// 4c + i / 4's scale), the offsets' and mins' sums in lanes 0 .. 7, the same fused multiply-adds in the same two
// chains and _mm512_reduce_add_ps's order (reduce_add16).
template <typename T>
void kquant_dot_twin(const Acts& a, int64_t m0, int64_t rows, const Layout& w, int64_t n0, int64_t n1, float* out,
                     int64_t ldo) {
  const int64_t S = a.K / 256;
  auto sat16 = [](int32_t v) { return std::clamp<int32_t>(v, -32768, 32767); };
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = m0; m < m0 + rows; ++m) {
      float acc[16] = {}, macc[16] = {};
      for (int64_t s = 0; s < S; ++s) {
        const uint8_t* b = w.p + n * w.ld + s * T::kBytes;
        const ScalesK h = T::header(b);
        alignas(32) uint8_t q[256];
        alignas(16) int8_t sc[16], mn[16];
        for (int j = 0; j < 8; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(q + 32 * j), T::quants(b, j));
        _mm_store_si128(reinterpret_cast<__m128i*>(sc), h.sc);
        _mm_store_si128(reinterpret_cast<__m128i*>(mn), h.mn);
        const int8_t* x = a.q.data() + m * a.K + 256 * s;
        const int16_t* sums = a.sum16.data() + 16 * (m * S + s);
        int32_t dot[16], mins[16] = {};
        for (int i = 0; i < 16; ++i) {
          dot[i] = 0;
          for (int c = 0; c < 4; ++c) {
            const int k = 64 * c + 4 * i;
            dot[i] += (sat16(q[k] * x[k] + q[k + 1] * x[k + 1]) + sat16(q[k + 2] * x[k + 2] + q[k + 3] * x[k + 3])) *
                      sc[4 * c + i / 4];
          }
        }
        for (int i = 0; i < 8; ++i) {
          if constexpr (T::kZero != 0)
            dot[i] -= T::kZero * sc[2 * i] * sums[2 * i] + T::kZero * sc[2 * i + 1] * sums[2 * i + 1];
          mins[i] = mn[2 * i] * sums[2 * i] + mn[2 * i + 1] * sums[2 * i + 1];
        }
        const float dx = a.dx[m * S + s];
        for (int i = 0; i < 16; ++i) {
          acc[i] = std::fma(static_cast<float>(dot[i]), h.d * dx, acc[i]);
          if constexpr (T::kMin) macc[i] = std::fma(-static_cast<float>(mins[i]), h.dmin * dx, macc[i]);
        }
      }
      float t[16];
      for (int i = 0; i < 16; ++i) t[i] = acc[i] + macc[i];
      out[(m - m0) * ldo + n] = reduce_add16(t);
    }
}

// Q5_0 / Q5_1 / IQ4_NL / MXFP4. Per block and row: sum q * x in int32, less kZero * sum x; times d * dx; plus m * dx * sum x.
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
      for (int m = 0; m < MR; ++m) {
        const int64_t blk = (m0 + m) * G + g;
        const __m256i xm = load32(a.q.data() + 32 * blk);
        // (IQ4_NL's and MXFP4's signed values: |q| times x with q's sign)
        const __m256i p = T::kSigned ? _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xm, q))
                                     : _mm256_maddubs_epi16(q, xm);
        __m256i dot = _mm256_madd_epi16(p, ones);
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
  const bool wide = kWide && vnni_kernels(), real = vnni_real();
  const int64_t tile = std::max<int64_t>(1, kTileBytes / w.row_bytes);
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(n1, t0 + tile);
    for (int64_t m = 0; m < M; m += 4) {
      float* o = op + m * ldo;
      auto run = [&](auto mr) {
        constexpr int MR = decltype(mr)::value;
        if constexpr (T::kValues == 256) {
          if constexpr (kWide) {
            if (wide && real) return kquant_dot_avx512<T, MR>(a, m, w, t0, t1, o, ldo);
            if (wide) return kquant_dot_twin<T>(a, m, MR, w, t0, t1, o, ldo);
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

}  // namespace

Acts::Acts(const at::Tensor& x, int64_t B) : K(x.size(1)), B(B), q(x.numel()), dx(x.numel() / B), sum16(x.numel() / 16) {
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, x.numel() / B, 4096 / B, [&](int64_t b, int64_t e) {
    for (int64_t blk = b; blk < e; ++blk)
      round_block(xp + blk * B, B, q.data() + blk * B, dx.data() + blk, sum16.data() + blk * B / 16);
  });
}

// out [M, ldo]: every part's columns = x @ dequantize(part).T through the integer dots (quantized types
// only). x is rounded once per block size; one parallel region over all the parts' rows.
void dot_parts(const at::Tensor& x, const std::vector<Part>& parts, int64_t ldo, float* op) {
  const int64_t M = x.size(0);
  std::optional<Acts> a256, a32;
  for (const Part& p : parts) {
    if (is_repacked(p.qtype) && repacked_block(p.qtype) == 256 && !a256) a256.emplace(x, 256);
    if (is_repacked(p.qtype) && repacked_block(p.qtype) == 32 && !a32) a32.emplace(x, 32);
    with_dot_type(p.qtype, [&](auto t) {
      if (decltype(t)::kValues == 256 && !a256) a256.emplace(x, 256);
      if (decltype(t)::kValues == 32 && !a32) a32.emplace(x, 32);
    });
  }
  // tasks of 32 weight rows from each part's first: which rows a panel takes never depends on the threads or on
  // the parts beside it
  constexpr int64_t kTask = 32;
  struct Task {
    const Part* p;
    int64_t n0, n1;
  };
  std::vector<Task> tasks;
  for (const Part& p : parts)
    for (int64_t n = 0; n < p.w.N; n += kTask) tasks.push_back({&p, n, std::min(p.w.N, n + kTask)});
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const Task& task = tasks[i];
      const Part& p = *task.p;
      if (is_repacked(p.qtype)) {   // repacked at load: one kernel at every row count (gguf_repacked.cpp)
        repacked_dots(p.qtype, repacked_block(p.qtype) == 256 ? *a256 : *a32, M, p.w, task.n0, task.n1, op + p.col, ldo);
        continue;
      }
      with_dot_type(p.qtype, [&](auto t) {
        using T = decltype(t);
        const Acts& a = T::kValues == 256 ? *a256 : *a32;
        // many rows of a K-quant: panels of 16 weight rows (gguf_panels.cpp), the last few row by row
        int64_t n = task.n0;
        if (panels_take(p.qtype, M)) n = panel_dots(a, M, p.w, p.qtype, n, task.n1, op + p.col, ldo);
        if (n < task.n1) dot_range<T>(a, M, p.w, n, task.n1, op + p.col, ldo);
      });
    }
  });
}


}  // namespace llmserve::gguf
