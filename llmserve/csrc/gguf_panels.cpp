// The K-quant dots of many rows (Q2_K .. Q6_K; gguf_dots.cpp's dot_parts, from toggles.kq_panel_rows rows on and 3x
// that for the 16-value-group types: panels_take): the weights' rows packed per call into panels of 16, the values of
// 16 rows interleaved four at a time so that one vpdpbusd multiplies 4 values of 16 rows by the same 4 values of a
// row of x (as llama.cpp's repacked Q4_K x Q8_K GEMM, whose lanes hold output columns): a row of x pays the float
// epilogue once per 16 weight rows and super-block, where the row-by-row dots (kquant_dot) pay it for each, and a
// panel's unpacking serves every row of x.
//
// A panel's super-block s, block_bytes(G) bytes:
//   quants  64 steps x 64 bytes: step t holds values 4t .. 4t + 3 of each of the 16 rows (row i at bytes 4i ..),
//           unsigned (q as the file has it, 0 .. 2^bits - 1)
//   sc      G x 16 int32: group g's scale of each row (G = 8 groups of 32 for Q4_K / Q5_K, 16 of 16 otherwise)
//   mn      8 x 16 int32, each two int16: the min of 16-value group 2j (low half) and 2j + 1 (high half) of each
//           row, or kZero times its scale for the types with an offset (Q3_K, Q6_K: their d stands for dmin)
//   d, dm   16 float32 each
// The sums are the row-by-row dots' integers: per row of x and super-block, isum = sum_g sc[g] (q . x over g) and
// msum = sum of mn x the sums of 16 rounded values; the float part once per super-block: acc -= msum dm dx, then
// acc += isum d dx (the offset types: acc += (isum - msum) d dx). Results agree with the row-by-row dots to float rounding.
//
// Two twins compute it: the AVX-512 VNNI one (the transposes by vpermt2d, the sums by vpdpbusd / vpdpwssd) and a
// portable one (AVX2 floor, plain loops), bit for bit equal: the portable one runs only where toggles.vnni_twin asks
// (LLMSERVE_VNNI=twin: the tests, on any CPU; without VNNI the row-by-row AVX2 dots are faster).
#include "gguf_panels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "isa.h"
#include "vec.h"

namespace llmserve::gguf {

namespace {

template <typename T>
constexpr bool kPanelType = T::kValues == 256 && !T::kSigned;

template <typename T>
constexpr int kGroups = std::is_same_v<T, TQ4_K> || std::is_same_v<T, TQ5_K> ? 8 : 16;

constexpr int64_t kQuantBytes = 64 * 64;
constexpr int64_t block_bytes(int G) { return kQuantBytes + G * 64 + 8 * 64 + 2 * 64; }

// The scales, mins and d of row i's super-block b into a panel's super-block P (both twins).
template <typename T>
void pack_scales(const uint8_t* b, int i, uint8_t* P) {
  constexpr int G = kGroups<T>;
  const ScalesK h = T::header(b);
  alignas(16) int8_t sc[16], mn[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(sc), h.sc);
  _mm_store_si128(reinterpret_cast<__m128i*>(mn), h.mn);
  int32_t* s32 = reinterpret_cast<int32_t*>(P + kQuantBytes);
  for (int g = 0; g < G; ++g) s32[g * 16 + i] = sc[g * (16 / G)];
  int16_t* m16 = reinterpret_cast<int16_t*>(P + kQuantBytes + G * 64);
  for (int g = 0; g < 16; ++g) {
    const int v = T::kZero != 0 ? T::kZero * sc[g] : T::kMin ? mn[g] : 0;
    m16[(g / 2) * 32 + 2 * i + g % 2] = static_cast<int16_t>(v);
  }
  float* d = reinterpret_cast<float*>(P + kQuantBytes + G * 64 + 512);
  d[i] = h.d;
  d[16 + i] = h.dmin;
}

// Rows [n, n + 16) of w, super-blocks [0, S), into a panel (portable: each row's values through a buffer).
template <typename T>
void pack_portable(const Layout& w, int64_t n, int64_t S, uint8_t* panel) {
  constexpr int64_t SB = block_bytes(kGroups<T>);
  alignas(32) uint8_t v[256];
  for (int64_t s = 0; s < S; ++s) {
    uint8_t* P = panel + s * SB;
    for (int i = 0; i < 16; ++i) {
      const uint8_t* b = w.p + (n + i) * w.ld + s * T::kBytes;
      for (int j = 0; j < 8; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(v + 32 * j), T::quants(b, j));
      for (int t = 0; t < 64; ++t) std::memcpy(P + 64 * t + 4 * i, v + 4 * t, 4);
      pack_scales<T>(b, i, P);
    }
  }
}

// The row-by-row sums of a panel for R rows of x (from row m0): out[r * ldo + i] for its 16 weight rows.
template <typename T, int R>
void rows_portable(const Acts& a, int64_t m0, const uint8_t* panel, float* out, int64_t ldo) {
  constexpr int G = kGroups<T>, steps = 64 / G;
  constexpr int64_t SB = block_bytes(G);
  const int64_t S = a.K / 256;
  for (int r = 0; r < R; ++r) {
    const int8_t* x = a.q.data() + (m0 + r) * a.K;
    for (int i = 0; i < 16; ++i) {
      float acc = 0.0f;
      for (int64_t s = 0; s < S; ++s) {
        const uint8_t* P = panel + s * SB;
        const int32_t* sc = reinterpret_cast<const int32_t*>(P + kQuantBytes);
        const int16_t* mn = reinterpret_cast<const int16_t*>(P + kQuantBytes + G * 64);
        const float* d = reinterpret_cast<const float*>(P + kQuantBytes + G * 64 + 512);
        const int16_t* sums = a.sum16.data() + (m0 + r) * (a.K / 16) + 16 * s;
        int32_t isum = 0, msum = 0;
        for (int g = 0; g < G; ++g) {
          int32_t tg = 0;
          for (int t = g * steps; t < (g + 1) * steps; ++t)
            for (int k = 0; k < 4; ++k) tg += P[64 * t + 4 * i + k] * x[256 * s + 4 * t + k];
          isum += tg * sc[g * 16 + i];
        }
        for (int j = 0; j < 8; ++j) msum += mn[j * 32 + 2 * i] * sums[2 * j] + mn[j * 32 + 2 * i + 1] * sums[2 * j + 1];
        const float dx = a.dx[(m0 + r) * S + s];
        if constexpr (T::kZero != 0) {
          acc = std::fma(static_cast<float>(isum - msum), d[i] * dx, acc);
        } else {
          if constexpr (T::kMin) acc = std::fma(-static_cast<float>(msum), d[16 + i] * dx, acc);
          acc = std::fma(static_cast<float>(isum), d[i] * dx, acc);
        }
      }
      out[r * ldo + i] = acc;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI

// acc += the 4-byte dot products of u8 `w` and s8 `x` per lane (in place: GCC's code for the intrinsic copies
// each accumulator around the loop)
LLMSERVE_AVX512_VNNI inline __m512i dpbusd(__m512i acc, __m512i w, __m512i x) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
  return acc;
}

template <typename T>
LLMSERVE_AVX512_VNNI void pack_avx512(const Layout& w, int64_t n, int64_t S, uint8_t* panel) {
  constexpr int64_t SB = block_bytes(kGroups<T>);
  for (int64_t s = 0; s < S; ++s) {
    uint8_t* P = panel + s * SB;
    for (int c = 0; c < 4; ++c) {   // values 64c .. 64c + 63 of the 16 rows: steps 16c .. 16c + 15
      __m512i r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const uint8_t* b = w.p + (n + i) * w.ld + s * T::kBytes;
        r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(T::quants(b, 2 * c)), T::quants(b, 2 * c + 1), 1);
      }
      transpose16_epi32(r);
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t) _mm512_storeu_si512(P + 64 * (16 * c + t), r[t]);
    }
    // the scales and mins: each row's 16 (as int32) and 8 pairs (as int16 pairs), transposed to vectors over the rows
    constexpr int G = kGroups<T>;
    __m512i sc[16], mn[16];
    float* d = reinterpret_cast<float*>(P + kQuantBytes + G * 64 + 512);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      const ScalesK h = T::header(w.p + (n + i) * w.ld + s * T::kBytes);
      sc[i] = _mm512_cvtepi8_epi32(h.sc);
      const __m256i sc16 = _mm256_cvtepi8_epi16(h.sc);
      const __m256i m16 = T::kZero != 0 ? _mm256_mullo_epi16(sc16, _mm256_set1_epi16(T::kZero))
                          : T::kMin     ? _mm256_cvtepi8_epi16(h.mn)
                                        : _mm256_setzero_si256();
      mn[i] = _mm512_zextsi256_si512(m16);
      d[i] = h.d;
      d[16 + i] = h.dmin;
    }
    transpose16_epi32(sc);
    transpose16_epi32(mn);
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) _mm512_storeu_si512(P + kQuantBytes + 64 * g, sc[g * (16 / G)]);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) _mm512_storeu_si512(P + kQuantBytes + G * 64 + 64 * j, mn[j]);
  }
}

template <typename T, int R>
LLMSERVE_AVX512_VNNI void rows_avx512(const Acts& a, int64_t m0, const uint8_t* panel, float* out, int64_t ldo) {
  constexpr int G = kGroups<T>, steps = 64 / G;
  constexpr int64_t SB = block_bytes(G);
  const int64_t S = a.K / 256;
  const int8_t* x = a.q.data() + m0 * a.K;
  const int16_t* sums = a.sum16.data() + m0 * (a.K / 16);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    const uint8_t* P = panel + s * SB;
    const float* d = reinterpret_cast<const float*>(P + kQuantBytes + G * 64 + 512);
    // the mins' sums first: the offset types start isum at -msum, the others take msum dm dx off acc at once
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    if constexpr (T::kZero != 0 || T::kMin) {
      for (int j = 0; j < 8; ++j) {
        const __m512i mn = _mm512_loadu_si512(P + kQuantBytes + G * 64 + 64 * j);
        for (int r = 0; r < R; ++r) {
          int32_t s2;
          std::memcpy(&s2, sums + r * (a.K / 16) + 16 * s + 2 * j, 4);
          isum[r] = _mm512_dpwssd_epi32(isum[r], mn, _mm512_set1_epi32(s2));
        }
      }
      if constexpr (T::kZero != 0) {
        for (int r = 0; r < R; ++r) isum[r] = _mm512_sub_epi32(_mm512_setzero_si512(), isum[r]);
      } else {
        const __m512 dm = _mm512_loadu_ps(d + 16);
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dm, _mm512_set1_ps(a.dx[(m0 + r) * S + s])),
                                    acc[r]);
          isum[r] = _mm512_setzero_si512();
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      __m512i tg[R];
      for (int r = 0; r < R; ++r) tg[r] = _mm512_setzero_si512();
      for (int t = g * steps; t < (g + 1) * steps; ++t) {
        const __m512i wq = _mm512_loadu_si512(P + 64 * t);
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, x + r * a.K + 256 * s + 4 * t, 4);
          tg[r] = dpbusd(tg[r], wq, _mm512_set1_epi32(x4));
        }
      }
      const __m512i sc = _mm512_loadu_si512(P + kQuantBytes + 64 * g);
      for (int r = 0; r < R; ++r) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(tg[r], sc));
    }
    const __m512 dv = _mm512_loadu_ps(d);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dv, _mm512_set1_ps(a.dx[(m0 + r) * S + s])),
                               acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

constexpr int64_t kPanels = 2;   // panels packed at a time (a task's 32 rows): 4 rows of x stay in L1 across them

template <typename T>
int64_t run_panels(const Acts& a, int64_t M, const Layout& w, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  constexpr int64_t SB = block_bytes(kGroups<T>);
  const int64_t S = a.K / 256, panels = (n1 - n0) / 16;
  const bool wide = vnni_real();
  std::vector<uint8_t> buf(kPanels * S * SB);
  for (int64_t p0 = 0; p0 < panels; p0 += kPanels) {
    const int64_t np = std::min(kPanels, panels - p0);
    for (int64_t p = 0; p < np; ++p) {
      if (wide) pack_avx512<T>(w, n0 + 16 * (p0 + p), S, buf.data() + p * S * SB);
      else pack_portable<T>(w, n0 + 16 * (p0 + p), S, buf.data() + p * S * SB);
    }
    for (int64_t m = 0; m < M; m += 4) {
      for (int64_t p = 0; p < np; ++p) {
        const uint8_t* panel = buf.data() + p * S * SB;
        float* o = out + m * ldo + n0 + 16 * (p0 + p);
        auto run = [&](auto rows) {
          constexpr int R = decltype(rows)::value;
          if (wide) rows_avx512<T, R>(a, m, panel, o, ldo);
          else rows_portable<T, R>(a, m, panel, o, ldo);
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
  return n0 + 16 * panels;
}

}  // namespace

bool panels_take(int64_t qtype, int64_t M) {
  if (M < toggles.kq_panel_rows || !vnni_kernels()) return false;
  bool ok = false;
  with_dot_type(qtype, [&](auto t) {
    using T = decltype(t);
    // the 16-value-group types (Q2_K, Q3_K, Q6_K) pack twice the scales and unpack dearer: from 3x the rows
    // (one thread, 1B shapes: Q6_K 0.92x the dots at 8 and 16 rows, 1.42x at 64; Q4_K 0.92-0.97x at 8, 1.32-1.38x at 16)
    if constexpr (kPanelType<T>) ok = M >= (kGroups<T> == 8 ? 1 : 3) * toggles.kq_panel_rows;
  });
  return ok;
}

int64_t panel_dots(const Acts& a, int64_t M, const Layout& w, int64_t qtype, int64_t n0, int64_t n1, float* out,
                   int64_t ldo) {
  int64_t done = n0;
  with_dot_type(qtype, [&](auto t) {
    using T = decltype(t);
    if constexpr (kPanelType<T>) done = run_panels<T>(a, M, w, n0, n1, out, ldo);
  });
  return done;
}

}  // namespace llmserve::gguf
