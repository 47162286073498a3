// Q4_K repacked once at load into panels of 16 weight rows (llama.cpp's CPU_REPACK buffers do the same for their
// GEMV / GEMM): where the VNNI kernels run, a Q4_K projection with rows in multiples of 16 is stored this way
// (llmserve/model/kernels/gguf_kernels.py's repack), and one kernel reads it at every row count: a row of x pays the
// float epilogue once per 16 weight rows and super-block, the nibbles are unpacked once per 16 rows and up to 4 rows
// of x, and nothing is packed per call (gguf_panels.cpp packs the file's blocks on every call, into bytes).
//
// A panel's super-block s, kQ4K16Bytes = 2368 bytes (16 rows x 148: the file's 144 a row, plus the scales unpacked):
//   qs    32 vectors of 64 bytes: vector 4g + j (group g of 32 values, j = 0 .. 3) holds at bytes 4i .. 4i + 3 the
//         values 32g + 4j .. + 3 of row i in their low nibbles and 32g + 16 + 4j .. + 3 in their high ones
//   sc    8 x 16 bytes: group g's 6-bit scale of row i at 16g + i
//   mn    4 x 32 bytes: the mins of groups 2j and 2j + 1 of row i at 32j + 2i, + 1 (int16 pairs once widened)
//   d     16 float16, then dmin: 16 float16
// Per row of x and super-block: isum = sum_g sc[g] (q . x over g), msum = sum_g mn[g] (sum of x's rounded values over
// g); acc -= msum dmin dx, then acc += isum d dx: the integers and float operations of the panels (gguf_panels.cpp),
// so both give the same bits, and a row's result never depends on the rows beside it (nor on how many there are).
//
// MXFP4 (gpt-oss's experts) the same way, a panel's block of 32 values in kMX16Bytes = 272 bytes (16 rows x the file's 17):
//   qs    4 vectors of 64 bytes: vector j holds at bytes 4i .. 4i + 3 row i's qs[4j .. 4j + 3] (the file's nibbles:
//         values 4j .. + 3 low, 16 + 4j .. + 3 high)
//   e     16 bytes: row i's E8M0 exponent
// Per row of x and block: isum = sum value x (E2M1 doubled, -12 .. 12: vpdpbusd takes them biased by 12, unsigned,
// and 12 times x's sum is taken off), then acc += isum (d dx), d = e8m0_half(e): the row-by-row dots' integers
// (gguf_dots.cpp's block32_dot), the float epilogue once per 16 rows, and the weights unpacked once for 4 rows of x.
//
// Two twins compute each, bit for bit equal: AVX-512 VNNI (vpdpbusd, vpdpwssd) and a portable one in plain loops,
// which runs where the instructions are missing or toggles.vnni_twin asks (LLMSERVE_VNNI=twin: the tests, any CPU).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "gguf_panels.h"
#include "isa.h"
#include "vec.h"

namespace llmserve::gguf {

namespace {

// The two repacked types: a panel's super-block of kBytes = 16 rows x the file's bytes (Q6_K) or x 148 (Q4_K)
struct R4 {   // Q4_K: nibbles, then scales, mins, d, dmin
  static constexpr int64_t kBytes = kQ4K16Bytes, kSc = 2048, kMn = kSc + 128, kD = kMn + 128, kDmin = kD + 32;
};
struct R6 {   // Q6_K: nibbles, high bit pairs, 16 signed scales a row, d
  static constexpr int64_t kBytes = kQ6K16Bytes, kHigh = 2048, kSc = kHigh + 1024, kD = kSc + 256;
};
static_assert(R4::kDmin + 32 == R4::kBytes && R6::kD + 32 == R6::kBytes, "the panels' super-block layouts");
// bytes ahead a pass that reads its panel from memory prefetches
template <typename T>
constexpr int64_t kPrefetch = 2 * T::kBytes;

// the nibbles of values 32g + 4j .. + 3 (low) and 32g + 16 + 4j .. + 3 (high) of row i at byte 64 (4g + j) + 4i + k;
// Q6_K's top bit pairs at 2048 + 64 (2g + e) + 4i + k: bits 2 (2t + h), + 1 of value 32g + 16h + 4 (2e + t) + k
template <typename T>
void pack_block(const Layout& w, int64_t n, int64_t s, uint8_t* P) {
  using F = std::conditional_t<std::is_same_v<T, R4>, TQ4_K, TQ6_K>;
  alignas(32) uint8_t v[256];
  alignas(16) int8_t sc[16], mn[16];
  for (int i = 0; i < 16; ++i) {
    const uint8_t* b = w.p + (n + i) * w.ld + s * F::kBytes;
    for (int g = 0; g < 8; ++g) _mm256_store_si256(reinterpret_cast<__m256i*>(v + 32 * g), F::quants(b, g));
    for (int g = 0; g < 8; ++g)
      for (int j = 0; j < 4; ++j)
        for (int k = 0; k < 4; ++k) {
          const uint8_t lo = v[32 * g + 4 * j + k], hi = v[32 * g + 16 + 4 * j + k];
          P[64 * (4 * g + j) + 4 * i + k] = static_cast<uint8_t>((lo & 15) | (hi & 15) << 4);
          if constexpr (std::is_same_v<T, R6>) {
            uint8_t& top = P[T::kHigh + 64 * (2 * g + j / 2) + 4 * i + k];
            if (j % 2 == 0) top = 0;
            top = static_cast<uint8_t>(top | (lo >> 4) << (4 * (j % 2)) | (hi >> 4) << (4 * (j % 2) + 2));
          }
        }
    const ScalesK h = F::header(b);
    _mm_store_si128(reinterpret_cast<__m128i*>(sc), h.sc);
    _mm_store_si128(reinterpret_cast<__m128i*>(mn), h.mn);
    if constexpr (std::is_same_v<T, R4>) {
      for (int g = 0; g < 8; ++g) {
        P[T::kSc + 16 * g + i] = static_cast<uint8_t>(sc[2 * g]);   // (header() gives them per 16 values)
        P[T::kMn + 32 * (g / 2) + 2 * i + g % 2] = static_cast<uint8_t>(mn[2 * g]);
      }
      std::memcpy(P + T::kD + 2 * i, b, 2);
      std::memcpy(P + T::kDmin + 2 * i, b + 2, 2);
    } else {
      for (int g = 0; g < 16; ++g) P[T::kSc + 16 * g + i] = static_cast<uint8_t>(sc[g]);
      std::memcpy(P + T::kD + 2 * i, b + 208, 2);
    }
  }
}

// value 32g + 16h + 4j + k of row i (0 .. 15 for Q4_K, 0 .. 63 for Q6_K)
template <typename T>
inline int quant(const uint8_t* P, int i, int g, int h, int j, int k) {
  const int nib = P[64 * (4 * g + j) + 4 * i + k] >> (4 * h) & 15;
  if constexpr (std::is_same_v<T, R4>) return nib;
  else return nib | (P[T::kHigh + 64 * (2 * g + j / 2) + 4 * i + k] >> (2 * (2 * (j % 2) + h)) & 3) << 4;
}

// x's sums over groups 2j and 2j + 1 of super-block s (row r of the activations) as an int16 pair
inline int32_t sum_pair(const int16_t* sums, int j) {
  const int32_t a = sums[4 * j] + sums[4 * j + 1], b = sums[4 * j + 2] + sums[4 * j + 3];
  return static_cast<int32_t>(static_cast<uint16_t>(a) | static_cast<uint32_t>(static_cast<uint16_t>(b)) << 16);
}

// out[r * ldo + i] for R rows of x (from row m0) and the panel's 16 weight rows i (portable twin), over super-blocks
// [s0, s1), from the sums in out (s0 > 0) or from 0
template <typename T, int R>
void rows_portable(const Acts& a, int64_t m0, const uint8_t* panel, int64_t s0, int64_t s1, float* out, int64_t ldo) {
  const int64_t S = a.K / 256;
  for (int r = 0; r < R; ++r) {
    const int8_t* x = a.q.data() + (m0 + r) * a.K;
    for (int i = 0; i < 16; ++i) {
      float acc = s0 ? out[r * ldo + i] : 0.0f;
      for (int64_t s = s0; s < s1; ++s) {
        const uint8_t* P = panel + s * T::kBytes;
        const int16_t* sums = a.sum16.data() + (m0 + r) * (a.K / 16) + 16 * s;
        const int8_t* xs = x + 256 * s;
        int32_t isum = 0, msum = 0;
        for (int g = 0; g < 8; ++g) {
          int32_t tg[2] = {0, 0};   // the 16 values of the low nibbles, of the high ones
          for (int h = 0; h < 2; ++h)
            for (int j = 0; j < 4; ++j)
              for (int k = 0; k < 4; ++k) tg[h] += quant<T>(P, i, g, h, j, k) * xs[32 * g + 16 * h + 4 * j + k];
          if constexpr (std::is_same_v<T, R4>) {
            isum += (tg[0] + tg[1]) * P[T::kSc + 16 * g + i];
            msum += P[T::kMn + 32 * (g / 2) + 2 * i + g % 2] * (sums[2 * g] + sums[2 * g + 1]);
          } else {   // (q - 32) per 16 values, times its signed scale
            for (int h = 0; h < 2; ++h)
              isum += (tg[h] - 32 * sums[2 * g + h]) * static_cast<int8_t>(P[T::kSc + 16 * (2 * g + h) + i]);
          }
        }
        const float dx = a.dx[(m0 + r) * S + s];
        if constexpr (std::is_same_v<T, R4>) acc = std::fma(-static_cast<float>(msum), f16(P + T::kDmin + 2 * i) * dx, acc);
        acc = std::fma(static_cast<float>(isum), f16(P + T::kD + 2 * i) * dx, acc);
      }
      out[r * ldo + i] = acc;
    }
  }
}

// acc += the 4-byte dot products of u8 `w` and s8 `x` per lane (in place: GCC's code for the intrinsic copies each
// accumulator around the loop)
LLMSERVE_AVX512_VNNI inline __m512i dpbusd(__m512i acc, __m512i w, __m512i x) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
  return acc;
}

// Q6_K's top bit pair of step (j, h) moved to bits 4, 5 of each byte (16-bit shifts; the mask drops what crosses)
template <int Shift>
LLMSERVE_AVX512_VNNI inline __m512i top_pair(__m512i t) {
  const __m512i v = Shift > 0 ? _mm512_slli_epi16(t, Shift) : Shift < 0 ? _mm512_srli_epi16(t, -Shift) : t;
  return _mm512_and_si512(v, _mm512_set1_epi8(0x30));
}

// the two vpdpbusd operands of step (g, j) of a panel's super-block P: the values multiplying x's 32g + 4j .. + 3 (wl)
// and 32g + 16 + 4j .. + 3 (wh) in 16 rows, unsigned bytes
template <typename T>
LLMSERVE_AVX512_VNNI inline void operands(const uint8_t* P, int g, int j, __m512i& wl, __m512i& wh) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i v = _mm512_loadu_si512(P + 64 * (4 * g + j));
  wl = _mm512_and_si512(v, low4);
  wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  if constexpr (!std::is_same_v<T, R4>) {
    const __m512i t = _mm512_loadu_si512(P + T::kHigh + 64 * (2 * g + j / 2));
    wl = _mm512_or_si512(wl, j % 2 ? top_pair<0>(t) : top_pair<4>(t));
    wh = _mm512_or_si512(wh, j % 2 ? top_pair<-2>(t) : top_pair<2>(t));
  }
}

// super-blocks [s0, s1) of a panel unpacked into ops (64 vectors each: step (g, j)'s wl at 8g + 2j, wh after it), for
// the passes of many rows of x (rows_avx512 with Cached)
template <typename T>
LLMSERVE_AVX512_VNNI void unpack_operands(const uint8_t* panel, int64_t s0, int64_t s1, __m512i* ops) {
  for (int64_t s = s0; s < s1; ++s)
    for (int g = 0; g < 8; ++g)
      for (int j = 0; j < 4; ++j) {
        __m512i* o = ops + (s - s0) * 64 + 8 * g + 2 * j;
        operands<T>(panel + s * T::kBytes, g, j, o[0], o[1]);
      }
}

// Cached: the operands read from ops (unpack_operands' of [s0, s1)), not unpacked again for every 4 rows of x: the
// same integers and float operations
template <typename T, int R, bool Cached = false>
LLMSERVE_AVX512_VNNI void rows_avx512(const Acts& a, int64_t m0, const uint8_t* panel, int64_t s0, int64_t s1,
                                      float* out, int64_t ldo, const __m512i* ops = nullptr) {
  constexpr bool k4 = std::is_same_v<T, R4>;
  const bool stream = s0 == 0 && s1 == a.K / 256;   // one pass over the panel (few rows): its bytes come from memory
  const int64_t S = a.K / 256;
  const int8_t* x = a.q.data() + m0 * a.K;
  const int16_t* sums = a.sum16.data() + m0 * (a.K / 16);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = s0 ? _mm512_loadu_ps(out + r * ldo) : _mm512_setzero_ps();
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* P = panel + s * T::kBytes;
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    if constexpr (k4) {   // the mins' sums, taken off acc at once
      for (int j = 0; j < 4; ++j) {
        const __m512i mn = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(P + T::kMn + 32 * j)));
        for (int r = 0; r < R; ++r)
          isum[r] = _mm512_dpwssd_epi32(isum[r], mn, _mm512_set1_epi32(sum_pair(sums + r * (a.K / 16) + 16 * s, j)));
      }
      const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(P + T::kDmin)));
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(isum[r]),
                                  _mm512_mul_ps(dm, _mm512_set1_ps(a.dx[(m0 + r) * S + s])), acc[r]);
        isum[r] = _mm512_setzero_si512();
      }
    }
    for (int g = 0; g < 8; ++g) {
      if (stream)   // an eighth of the super-block kPrefetch ahead, a group at a time (a burst would stall)
        for (int64_t l = g * T::kBytes / 8 / 64 * 64; l < (g + 1) * T::kBytes / 8; l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(P + kPrefetch<T> + l), _MM_HINT_T0);
      __m512i lo[R], hi[R];   // two chains a row: the low nibbles' values and the high ones'
      for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m512i wl, wh;
        if constexpr (Cached) {
          wl = ops[(s - s0) * 64 + 8 * g + 2 * j];
          wh = ops[(s - s0) * 64 + 8 * g + 2 * j + 1];
        } else {
          operands<T>(P, g, j, wl, wh);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xs = x + r * a.K + 256 * s + 32 * g + 4 * j;
          int32_t xl, xh;
          std::memcpy(&xl, xs, 4);
          std::memcpy(&xh, xs + 16, 4);
          lo[r] = dpbusd(lo[r], wl, _mm512_set1_epi32(xl));
          hi[r] = dpbusd(hi[r], wh, _mm512_set1_epi32(xh));
        }
      }
      if constexpr (k4) {
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(P + T::kSc + 16 * g)));
        for (int r = 0; r < R; ++r)
          isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(_mm512_add_epi32(lo[r], hi[r]), sc));
      } else {
        const __m512i scl = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(P + T::kSc + 32 * g)));
        const __m512i sch =
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(P + T::kSc + 32 * g + 16)));
        for (int r = 0; r < R; ++r) {
          const int16_t* sr = sums + r * (a.K / 16) + 16 * s + 2 * g;
          const __m512i l = _mm512_sub_epi32(lo[r], _mm512_set1_epi32(32 * sr[0]));
          const __m512i h = _mm512_sub_epi32(hi[r], _mm512_set1_epi32(32 * sr[1]));
          isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(l, scl), _mm512_mullo_epi32(h, sch)));
        }
      }
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(P + T::kD)));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dv, _mm512_set1_ps(a.dx[(m0 + r) * S + s])),
                               acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

// run(integral_constant R) for R = min(4, left) rows of x
template <typename F>
void up_to_4_rows(int64_t left, F&& run) {
  switch (std::min<int64_t>(4, left)) {
    case 1: run(std::integral_constant<int, 1>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 3: run(std::integral_constant<int, 3>{}); break;
    default: run(std::integral_constant<int, 4>{}); break;
  }
}

// super-blocks a pass over many rows of x takes at a time (a Q4_K panel's 19 KB and 4 rows of x in L1); the sums
// carry over in out, so the float operations are the same as in one pass
constexpr int64_t kSpan = 8;
// from kCachedRows rows of x each panel's span is unpacked once into a buffer (kCachedSpan super-blocks: 16 KB in L1)
// for all of them, in place of once for every 4: one thread, 1B shapes, 64-256 rows, Q4_K 1.14-1.17x, Q6_K 1.28-1.33x
// (benchmarks/kernels/kquant_panels.py); below 16 rows Q4_K's unpacking (a mask and a shift) costs less than the
// buffer's stores, Q6_K's (its top bit pairs) more, from 8
template <typename T>
constexpr int64_t kCachedRows = std::is_same_v<T, R6> ? 8 : 16;
constexpr int64_t kCachedSpan = 4;

template <typename T>
void dots(const Acts& a, int64_t M, const Layout& w, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  const int64_t S = a.K / 256, span = M > 4 ? kSpan : S;
  const bool wide = vnni_real();
  if (wide && M >= kCachedRows<T>) {   // each panel's span unpacked once for all the rows of x
    alignas(64) uint8_t buf[kCachedSpan * 64 * 64];
    const auto ops = reinterpret_cast<__m512i*>(buf);
    for (int64_t s0 = 0; s0 < S; s0 += kCachedSpan) {
      const int64_t s1 = std::min(S, s0 + kCachedSpan);
      for (int64_t n = n0; n < n1; n += 16) {
        const uint8_t* panel = w.p + (n / 16) * S * T::kBytes;
        unpack_operands<T>(panel, s0, s1, ops);
        for (int64_t m = 0; m < M; m += 4)
          up_to_4_rows(M - m, [&](auto rows) {
            rows_avx512<T, decltype(rows)::value, true>(a, m, panel, s0, s1, out + m * ldo + n, ldo, ops);
          });
      }
    }
    return;
  }
  for (int64_t s0 = 0; s0 < S; s0 += span) {
    const int64_t s1 = std::min(S, s0 + span);
    for (int64_t m = 0; m < M; m += 4) {   // a task's panels stay in L2 for every 4 rows of x
      for (int64_t n = n0; n < n1; n += 16) {
        const uint8_t* panel = w.p + (n / 16) * S * T::kBytes;
        float* o = out + m * ldo + n;
        auto run = [&](auto rows) {
          constexpr int R = decltype(rows)::value;
          if (wide) rows_avx512<T, R>(a, m, panel, s0, s1, o, ldo);
          else rows_portable<T, R>(a, m, panel, s0, s1, o, ldo);
        };
        up_to_4_rows(M - m, run);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// MXFP4 in panels (MXFP4_16)

constexpr int64_t kMXE = 256;   // the exponents' offset in a panel's block
constexpr int kMXBias = 12;
alignas(16) constexpr int8_t kMXValues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
alignas(16) constexpr uint8_t kMXBiased[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// rows [n, n + 16) of w, block g, into a panel's block P
void pack_mx(const Layout& w, int64_t n, int64_t g, uint8_t* P) {
  for (int i = 0; i < 16; ++i) {
    const uint8_t* b = w.p + (n + i) * w.ld + g * TMXFP4::kBytes;
    for (int j = 0; j < 4; ++j) std::memcpy(P + 64 * j + 4 * i, b + 1 + 4 * j, 4);
    P[kMXE + i] = b[0];
  }
}

// out[r * ldo + i] for R rows of x (from row m0) and the panel's 16 rows i (portable twin), over blocks [g0, g1), from
// the sums in out (g0 > 0) or from 0
template <int R>
void mx_rows_portable(const Acts& a, int64_t m0, const uint8_t* panel, int64_t g0, int64_t g1, float* out, int64_t ldo) {
  const int64_t G = a.K / 32;
  for (int r = 0; r < R; ++r) {
    const int8_t* x = a.q.data() + (m0 + r) * a.K;
    for (int i = 0; i < 16; ++i) {
      float acc = g0 ? out[r * ldo + i] : 0.0f;
      for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* P = panel + g * kMX16Bytes;
        int32_t isum = 0;
        for (int j = 0; j < 4; ++j)
          for (int k = 0; k < 4; ++k) {
            const uint8_t byte = P[64 * j + 4 * i + k];
            isum += kMXValues[byte & 15] * x[32 * g + 4 * j + k] + kMXValues[byte >> 4] * x[32 * g + 16 + 4 * j + k];
          }
        acc = std::fma(static_cast<float>(isum), e8m0_half(P[kMXE + i]) * a.dx[(m0 + r) * G + g], acc);
      }
      out[r * ldo + i] = acc;
    }
  }
}

// the 8 vpdpbusd operands of a panel's block P: the values (biased) multiplying x's 4j .. + 3 at 2j, 16 + 4j .. at 2j + 1
LLMSERVE_AVX512_VNNI inline void mx_operands(const uint8_t* P, __m512i* w) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kMXBiased)));
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(P + 64 * j);
    w[2 * j] = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, low4));
    w[2 * j + 1] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
  }
}

// blocks [g0, g1) of a panel unpacked into ops (8 vectors a block), for mx_rows_avx512 with Cached
LLMSERVE_AVX512_VNNI void mx_unpack_operands(const uint8_t* panel, int64_t g0, int64_t g1, __m512i* ops) {
  for (int64_t g = g0; g < g1; ++g) mx_operands(panel + g * kMX16Bytes, ops + (g - g0) * 8);
}

// Cached: the operands of blocks [g0, g1) read from ops (8 vectors a block), not unpacked again for every 4 rows of x
template <int R, bool Cached = false>
LLMSERVE_AVX512_VNNI void mx_rows_avx512(const Acts& a, int64_t m0, const uint8_t* panel, int64_t g0, int64_t g1,
                                         float* out, int64_t ldo, const __m512i* ops = nullptr) {
  const int64_t G = a.K / 32;
  const bool stream = g0 == 0 && g1 == G;   // one pass over the panel (few rows): its bytes come from memory
  const int8_t* x = a.q.data() + m0 * a.K;
  const int16_t* sums = a.sum16.data() + m0 * (a.K / 16);
  const __m512i one = _mm512_set1_epi32(1), two = _mm512_set1_epi32(2), tiny = _mm512_set1_epi32(0x00200000);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = g0 ? _mm512_loadu_ps(out + r * ldo) : _mm512_setzero_ps();
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* P = panel + g * kMX16Bytes;
    if (stream)   // 4 blocks ahead (consecutive blocks' lines 16 bytes apart at most: every line is fetched)
      for (int64_t l = 0; l < kMX16Bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(P + 4 * kMX16Bytes + l), _MM_HINT_T0);
    __m512i wv[8];
    if constexpr (Cached) {
      for (int v = 0; v < 8; ++v) wv[v] = ops[(g - g0) * 8 + v];
    } else {
      mx_operands(P, wv);
    }
    // e8m0_half of the 16 exponents: (e - 1) << 23, the subnormals 2^-128, 2^-127 for e < 2
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(P + kMXE)));
    const __m512 d = _mm512_castsi512_ps(_mm512_mask_blend_epi32(
        _mm512_cmplt_epu32_mask(e, two), _mm512_slli_epi32(_mm512_sub_epi32(e, one), 23), _mm512_sllv_epi32(tiny, e)));
    for (int r = 0; r < R; ++r) {
      const int8_t* xs = x + r * a.K + 32 * g;
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        int32_t xl, xh;
        std::memcpy(&xl, xs + 4 * j, 4);
        std::memcpy(&xh, xs + 16 + 4 * j, 4);
        lo = dpbusd(lo, wv[2 * j], _mm512_set1_epi32(xl));
        hi = dpbusd(hi, wv[2 * j + 1], _mm512_set1_epi32(xh));
      }
      const int16_t* sr = sums + r * (a.K / 16) + 2 * g;
      const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(lo, hi), _mm512_set1_epi32(kMXBias * (sr[0] + sr[1])));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(a.dx[(m0 + r) * G + g])),
                               acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

// blocks a pass over many rows of x takes at a time (8.7 KB of a panel and 4 rows of x in L1); from kMXCachedRows rows
// their operands are unpacked once into a buffer (16 KB) for all of them: 1.2x at 64-256 rows on gpt-oss-20b's shapes
constexpr int64_t kMXSpan = 32, kMXCachedRows = 16;

void mx_dots(const Acts& a, int64_t M, const Layout& w, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  const int64_t G = a.K / 32, span = M > 4 ? kMXSpan : G;
  const bool wide = vnni_real();
  if (wide && M >= kMXCachedRows) {   // each panel's span unpacked once for all the rows of x (16 KB)
    alignas(64) uint8_t buf[kMXSpan * 8 * 64];
    const auto ops = reinterpret_cast<__m512i*>(buf);
    for (int64_t g0 = 0; g0 < G; g0 += kMXSpan) {
      const int64_t g1 = std::min(G, g0 + kMXSpan);
      for (int64_t n = n0; n < n1; n += 16) {
        const uint8_t* panel = w.p + (n / 16) * G * kMX16Bytes;
        mx_unpack_operands(panel, g0, g1, ops);
        for (int64_t m = 0; m < M; m += 4)
          up_to_4_rows(M - m, [&](auto rows) {
            mx_rows_avx512<decltype(rows)::value, true>(a, m, panel, g0, g1, out + m * ldo + n, ldo, ops);
          });
      }
    }
    return;
  }
  for (int64_t g0 = 0; g0 < G; g0 += span) {
    const int64_t g1 = std::min(G, g0 + span);
    for (int64_t m = 0; m < M; m += 4) {
      for (int64_t n = n0; n < n1; n += 16) {
        const uint8_t* panel = w.p + (n / 16) * G * kMX16Bytes;
        float* o = out + m * ldo + n;
        auto run = [&](auto rows) {
          constexpr int R = decltype(rows)::value;
          if (wide) mx_rows_avx512<R>(a, m, panel, g0, g1, o, ldo);
          else mx_rows_portable<R>(a, m, panel, g0, g1, o, ldo);
        };
        up_to_4_rows(M - m, run);
      }
    }
  }
}

template <typename F>
void with_repacked(int64_t qtype, F&& f) {
  TORCH_CHECK(qtype == Q4_K16 || qtype == Q6_K16, "not a repacked K-quant: ", qtype);
  if (qtype == Q4_K16) f(R4{});
  else f(R6{});
}

}  // namespace

void repacked_unpack(int64_t qtype, const uint8_t* P, int i, uint8_t* q, float* d, float* dmin, int8_t* sc, uint8_t* mn) {
  with_repacked(qtype, [&](auto t) {
    using T = decltype(t);
    for (int g = 0; g < 8; ++g)
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 4; ++j)
          for (int k = 0; k < 4; ++k) q[32 * g + 16 * h + 4 * j + k] = static_cast<uint8_t>(quant<T>(P, i, g, h, j, k));
    *d = f16(P + T::kD + 2 * i);
    if constexpr (std::is_same_v<T, R4>) {
      *dmin = f16(P + T::kDmin + 2 * i);
      for (int g = 0; g < 8; ++g) {
        sc[2 * g] = sc[2 * g + 1] = static_cast<int8_t>(P[T::kSc + 16 * g + i]);
        mn[2 * g] = mn[2 * g + 1] = P[T::kMn + 32 * (g / 2) + 2 * i + g % 2];
      }
    } else {
      *dmin = 0.0f;
      for (int g = 0; g < 16; ++g) sc[g] = static_cast<int8_t>(P[T::kSc + 16 * g + i]), mn[g] = 0;
    }
  });
}

void mx16_block(const uint8_t* P, int i, uint8_t* block) {
  block[0] = P[kMXE + i];
  for (int j = 0; j < 4; ++j) std::memcpy(block + 1 + 4 * j, P + 64 * j + 4 * i, 4);
}

at::Tensor repack_panels(const at::Tensor& raw, int64_t qtype, int64_t K) {
  TORCH_CHECK(qtype == Q4_K || qtype == Q6_K || qtype == MXFP4, "repack_panels: only Q4_K, Q6_K and MXFP4 are repacked, not ",
              qtype);
  const Layout w = check_layout(raw, qtype, K, "repack_panels");
  TORCH_CHECK(w.N % 16 == 0, "repack_panels: ", w.N, " rows is not a multiple of 16");
  if (qtype == MXFP4) {
    const int64_t G = K / 32;
    at::Tensor out = at::empty({w.N, w.row_bytes}, raw.options());
    uint8_t* o = out.data_ptr<uint8_t>();
    at::parallel_for(0, w.N / 16, 1, [&](int64_t b, int64_t e) {
      for (int64_t p = b; p < e; ++p)
        for (int64_t g = 0; g < G; ++g) pack_mx(w, 16 * p, g, o + (p * G + g) * kMX16Bytes);
    });
    return out;
  }
  const int64_t S = K / 256;
  const int64_t bytes = qtype == Q4_K ? kQ4K16Bytes : kQ6K16Bytes;
  at::Tensor out = at::empty({w.N, S * bytes / 16}, raw.options());
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, w.N / 16, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t s = 0; s < S; ++s) {
        if (qtype == Q4_K) pack_block<R4>(w, 16 * p, s, o + (p * S + s) * bytes);
        else pack_block<R6>(w, 16 * p, s, o + (p * S + s) * bytes);
      }
  });
  return out;
}

void repacked_dots(int64_t qtype, const Acts& a, int64_t M, const Layout& w, int64_t n0, int64_t n1, float* out,
                   int64_t ldo) {
  if (qtype == MXFP4_16) return mx_dots(a, M, w, n0, n1, out, ldo);
  with_repacked(qtype, [&](auto t) { dots<decltype(t)>(a, M, w, n0, n1, out, ldo); });
}

}  // namespace llmserve::gguf
