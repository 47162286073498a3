// The integer GEMMs of many rows on AVX-512 VNNI (vpdpbusd), llmserve's own: int8 weights with a scale per channel
// (q8_vnni_gemm, in their VNNI layout) and int4 in Q4_1's blocks (q4_vnni_gemm, q4_linear's many rows). Only
// reached where vnni_kernels() holds (the callers check): the kernels here are compiled for LLMSERVE_AVX512_VNNI,
// each with a portable twin in plain loops (toggles.vnni_twin, LLMSERVE_VNNI=twin: any CPU, the same bits).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "gemm.h"
#include "isa.h"
#include "kernels.h"
#include "linear_dots.h"
#include "vec.h"

namespace llmserve {

namespace {

// int8 weights with a scale per channel times any number of rows, on AVX-512 VNNI (vpdpbusd: 64 u8 x s8 products
// an instruction): llmserve's own integer GEMM, where oneDNN's (through _int_mm, or qlinear_pointwise on a packed
// weight) spends much of a decoding batch's time on per-call set-up and re-layout. The weights are laid out once
// for the instruction, [N / 16, K / 4, 16, 4] in place of the plain [N, K] (a 64-byte vector per 16 channels x 4
// inputs: `ops.vnni_pack`), with the sum of each channel's int8 values (the activations go in as q + 128: their
// products are the int8 ones + 128 x that sum, taken off exactly). The activations are rounded as q8_int_gemm
// rounds them (round_rows: the same integers, the same float epilogue: the same result, bit for bit). A task is
// a block of 64 channels (4 vectors) for every row: its weights (64 x K bytes) stay in L1/L2 while 4 rows at a
// time are multiplied with them, 16 accumulators in registers.


// f(m, std::integral_constant<int, R>{}) over rows [m0, m1): blocks of R = 4, then the 1 to 3 left
template <typename F>
void in_blocks_of_four(int64_t m0, int64_t m1, F&& f) {
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) f(m, std::integral_constant<int, 4>{});
  switch (m1 - m) {
    case 1: f(m, std::integral_constant<int, 1>{}); break;
    case 2: f(m, std::integral_constant<int, 2>{}); break;
    case 3: f(m, std::integral_constant<int, 3>{}); break;
    default: break;
  }
}

// acc += the 4-byte dot products of u8 `x` and s8 `w` per lane, accumulated in place (GCC's code for the
// intrinsic copies each accumulator around the loop)
LLMSERVE_AVX512_VNNI inline __m512i dpbusd(__m512i acc, __m512i x, __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}

template <int R, int T>
LLMSERVE_AVX512_VNNI void vnni_block(const uint8_t* xq, int64_t K, const int8_t* wv, int64_t tile_bytes, int32_t* acc,
                              int64_t ld) {
  __m512i a[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) a[r][t] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 4) {
    __m512i w[T];
    for (int t = 0; t < T; ++t) w[t] = _mm512_loadu_si512(wv + t * tile_bytes + k * 16);
    for (int r = 0; r < R; ++r) {
      int32_t x4;
      std::memcpy(&x4, xq + r * K + k, 4);
      const __m512i x = _mm512_set1_epi32(x4);
      for (int t = 0; t < T; ++t) a[r][t] = dpbusd(a[r][t], x, w[t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_si512(acc + r * ld + 16 * t, a[r][t]);
}

template <int T>
LLMSERVE_AVX512_VNNI void vnni_rows(const uint8_t* xq, int64_t rows, int64_t K, const int8_t* wv, int64_t tile_bytes,
                             int32_t* acc, int64_t ld) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) vnni_block<4, T>(xq + r * K, K, wv, tile_bytes, acc + r * ld, ld);
  switch (rows - r) {
    case 1: vnni_block<1, T>(xq + r * K, K, wv, tile_bytes, acc + r * ld, ld); break;
    case 2: vnni_block<2, T>(xq + r * K, K, wv, tile_bytes, acc + r * ld, ld); break;
    case 3: vnni_block<3, T>(xq + r * K, K, wv, tile_bytes, acc + r * ld, ld); break;
    default: break;
  }
}

// y[m, n] = ((a1 - 128 c[n]) s1[m] + (a2 - 128 c[n]) s2[m]) w[n] for 16 channels (q8_int_gemm's epilogue): row m's
// sums of level 1 at acc + m * ld, of level 2 (L == 2) at acc + (l2 + m) * ld; its scales s1[m], s2[m]
LLMSERVE_AVX512_VNNI void vnni_epilogue(const int32_t* acc, int64_t ld, int64_t M, int64_t L, int64_t l2, const float* s1,
                                 const float* s2, const int32_t* csum, const float* ws, int64_t channels, float* out,
                                 int64_t N) {
  for (int64_t c = 0; c < channels; c += 16) {
    const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512(csum + c), 7);
    const __m512 w = _mm512_loadu_ps(ws + c);
    for (int64_t m = 0; m < M; ++m) {
      const __m512 a1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(acc + m * ld + c), off));
      __m512 y = _mm512_mul_ps(a1, _mm512_set1_ps(s1[m]));
      if (L == 2) {
        const __m512 a2 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(acc + (l2 + m) * ld + c), off));
        y = _mm512_fmadd_ps(a2, _mm512_set1_ps(s2[m]), y);
      }
      _mm512_storeu_ps(out + m * N + c, _mm512_mul_ps(y, w));
    }
  }
}


// The portable twins of vnni_rows and vnni_epilogue (toggles.vnni_twin): the same integers, the same float
// operations in the same order, in plain loops.
void vnni_rows_twin(const uint8_t* xq, int64_t rows, int64_t K, const int8_t* wv, int64_t tile_bytes, int64_t tiles,
                    int32_t* acc, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < 16 * tiles; ++c) {
      const int8_t* w = wv + (c / 16) * tile_bytes + (c % 16) * 4;
      int32_t a = 0;
      for (int64_t k = 0; k < K; ++k) a += xq[r * K + k] * w[(k / 4) * 64 + k % 4];
      acc[r * ld + c] = a;
    }
}

void vnni_epilogue_twin(const int32_t* acc, int64_t ld, int64_t M, int64_t L, int64_t l2, const float* s1,
                        const float* s2, const int32_t* csum, const float* ws, int64_t channels, float* out, int64_t N) {
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t m = 0; m < M; ++m) {
      float y = static_cast<float>(acc[m * ld + c] - (csum[c] << 7)) * s1[m];
      if (L == 2) y = std::fma(static_cast<float>(acc[(l2 + m) * ld + c] - (csum[c] << 7)), s2[m], y);
      out[m * N + c] = y * ws[c];
    }
}

// vnni_epilogue on the instructions (`real`), or its twin
void epilogue(bool real, const int32_t* acc, int64_t ld, int64_t M, int64_t L, int64_t l2, const float* s1,
              const float* s2, const int32_t* csum, const float* ws, int64_t channels, float* out, int64_t N) {
  (real ? vnni_epilogue : vnni_epilogue_twin)(acc, ld, M, L, l2, s1, s2, csum, ws, channels, out, N);
}

// The sums on AMX tiles (amx.h), then vnni_epilogue: rows in chunks whose activations (both levels) stay in L2,
// within a chunk every pair of 16-channel blocks of this thread's share (their weights read from memory once a
// chunk), 32 rows at a time. xq holds level l of row m at (l * Mb + m) * K, Mb a multiple of 32, the rows from M
// to Mb anything (their sums are never read).
void amx_gemm(const uint8_t* xq, int64_t M, int64_t Mb, int64_t L, int64_t K, const int8_t* w, int64_t N,
              const float* sx, const int32_t* cs, const float* ws, float* op, bool real) {
  const int64_t pairs = (N / 16 + 1) / 2, chunk = std::clamp<int64_t>((int64_t{1} << 20) / (L * K) / 32 * 32, 32, Mb);
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    const AmxTiles tiles;
    std::vector<int32_t> acc(L * chunk * 32);
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
      const int64_t padded = std::min(chunk, Mb - m0), rows = std::min(chunk, M - m0);
      const float* s2 = L == 2 ? sx + M + m0 : nullptr;
      for (int64_t p = p0; p < p1; ++p) {
        const int blocks = static_cast<int>(std::min<int64_t>(2, N / 16 - 2 * p));
        for (int64_t l = 0; l < L; ++l)
          for (int64_t r = 0; r < padded; r += 32)
            amx_sums_32(tiles, xq + (l * Mb + m0 + r) * K, K, w + 2 * p * K * 16, blocks, acc.data() + (l * chunk + r) * 32);
        epilogue(real, acc.data(), 32, rows, L, chunk, sx + m0, s2, cs + 32 * p, ws + 32 * p, 16 * blocks,
                 op + m0 * N + 32 * p, N);
      }
    }
  });
}

}  // namespace

at::Tensor q8_vnni_gemm(const at::Tensor& x_in, const at::Tensor& wv, const at::Tensor& csum, const at::Tensor& scale,
                        int64_t act_code) {
  check_cpu_f32(x_in, "q8_vnni_gemm");
  const at::Tensor x = x_in.contiguous();
  // w8a8: each row rotated as its weights were (act_code's Hadamard block, gemm.h's rotated_for) while it is rounded
  const int64_t act_bits = act_code & 0xFF, hb = act_code >> 8;
  TORCH_CHECK(vnni_kernels(), "q8_vnni_gemm: needs AVX-512 VNNI (or LLMSERVE_VNNI=twin)");
  TORCH_CHECK(wv.dim() == 4 && wv.size(2) == 16 && wv.size(3) == 4 && wv.scalar_type() == at::kChar &&
              wv.is_contiguous(), "q8_vnni_gemm: weights [N / 16, K / 4, 16, 4] int8");
  const int64_t M = x.size(0), K = x.size(1), N = wv.size(0) * 16, L = act_bits > 8 ? 2 : 1;
  TORCH_CHECK(x.dim() == 2 && wv.size(1) * 4 == K && K % 8 == 0, "q8_vnni_gemm: shape mismatch");
  TORCH_CHECK(csum.numel() == N && csum.scalar_type() == at::kInt && scale.numel() == N &&
              scale.scalar_type() == at::kFloat && scale.is_contiguous() && csum.is_contiguous(),
              "q8_vnni_gemm: a sum (int32) and a scale (float32) per channel");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const bool amx = M >= kAmxRows && K % 64 == 0 && amx_path();
  const int64_t Mb = amx ? (M + 31) / 32 * 32 : M;  // the AMX path's rows: whole tiles of 32
  // the rounded activations in a buffer kept by the calling thread (a fresh vector of 0.5-16 MB a call is an mmap, its
  // page faults and an munmap: 4% of a 3B int8 decode's time), read through a pointer taken here (inside the parallel
  // loops below the name would be each worker's own, empty, buffer). The AMX path's padding rows hold whatever was
  // there: their sums are never read.
  thread_local std::vector<uint8_t> buffer;
  if (buffer.size() < static_cast<size_t>(L * Mb * K)) buffer.resize(L * Mb * K);
  uint8_t* const xq = buffer.data();
  std::vector<float> sx(L * M);
  round_rows(x.data_ptr<float>(), M, K, L, Mb, true, xq, sx.data(), hb);
  const int8_t* w = wv.data_ptr<int8_t>();
  const int32_t* cs = csum.data_ptr<int32_t>();
  const float* ws = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t tile_bytes = K * 16, blocks = (N + 63) / 64;
  const bool real = vnni_real();
  if (amx) {
    amx_gemm(xq, M, Mb, L, K, w, N, sx.data(), cs, ws, op, real);
    return out;
  }
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int32_t> acc(L * M * 64);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t tiles = std::min<int64_t>(4, N / 16 - 4 * b);
      const int8_t* wb = w + 4 * b * tile_bytes;
      if (!real) {
        vnni_rows_twin(xq, L * M, K, wb, tile_bytes, tiles, acc.data(), 64);
      } else {
        switch (tiles) {
          case 4: vnni_rows<4>(xq, L * M, K, wb, tile_bytes, acc.data(), 64); break;
          case 3: vnni_rows<3>(xq, L * M, K, wb, tile_bytes, acc.data(), 64); break;
          case 2: vnni_rows<2>(xq, L * M, K, wb, tile_bytes, acc.data(), 64); break;
          default: vnni_rows<1>(xq, L * M, K, wb, tile_bytes, acc.data(), 64); break;
        }
      }
      epilogue(real, acc.data(), 64, M, L, M, sx.data(), sx.data() + M, cs + 64 * b, ws + 64 * b, 16 * tiles, op + 64 * b, N);
    }
  });
  return out;
}

namespace {

// int4 weights (Q4_1's blocks: 32 values 0..15 with a float16 scale d and min m each, the plain [N, K / 2] layout
// q4_linear reads) times many rows on AVX-512 VNNI, the activations rounded per 32-value block to int8 as the
// dots round them (quantize_rows: x ~ dx q, with the block's float sum): a block's dot is
// d dx (sum of w q, integer) + m (sum of x), as llama.cpp's Q4_1 x Q8_1. The nibbles are unsigned, the rounded
// activations signed: vpdpbusd takes them as they are. A task is 64 channels and up to 256 rows: it widens its
// channels' nibbles once to bytes in the instruction's layout ([K / 4][64 channels][4], 64 x K bytes, in L2)
// and its scales and mins to float32, then runs 4 rows x 32 channels at a time: 8 int32 sums per block, turned
// into float32 sums after each block.
template <int R>
LLMSERVE_AVX512_VNNI void q4v_rows(const int8_t* xq, const float* dx, const float* xs, int64_t K, const uint8_t* wu,
                            const float* d, const float* mn, int64_t half, float* out, int64_t ldo) {
  const int64_t G = K / 32;
  __m512 f[R][2];
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_si512();
    for (int64_t s = 0; s < 8; ++s) {
      const uint8_t* wk = wu + (8 * g + s) * 256 + half * 128;
      const __m512i w0 = _mm512_loadu_si512(wk), w1 = _mm512_loadu_si512(wk + 64);
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, xq + r * K + 32 * g + 4 * s, 4);
        const __m512i x = _mm512_set1_epi32(x4);
        a[r][0] = dpbusd(a[r][0], w0, x);
        a[r][1] = dpbusd(a[r][1], w1, x);
      }
    }
    const float* dg = d + g * 64 + half * 32;
    const float* mg = mn + g * 64 + half * 32;
    const __m512 d0 = _mm512_loadu_ps(dg), d1 = _mm512_loadu_ps(dg + 16);
    const __m512 m0 = _mm512_loadu_ps(mg), m1 = _mm512_loadu_ps(mg + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 sx = _mm512_set1_ps(dx[r * G + g]), su = _mm512_set1_ps(xs[r * G + g]);
      f[r][0] = _mm512_fmadd_ps(m0, su, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][0]), _mm512_mul_ps(d0, sx), f[r][0]));
      f[r][1] = _mm512_fmadd_ps(m1, su, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][1]), _mm512_mul_ps(d1, sx), f[r][1]));
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * ldo, f[r][0]);
    _mm512_storeu_ps(out + r * ldo + 16, f[r][1]);
  }
}

// 64 channels [n0, n0 + 64) of int4 weights -> wu [K / 4][64][4] bytes (value k of channel c at
// (k / 4) * 256 + c * 4 + k % 4), d and mn [K / 32][64] float32. A block's values 0..15 are its bytes' low
// nibbles, 16..31 the high ones: dword s of a channel's 16 bytes holds values 4s..4s+3 (low) and 16+4s..
// (high). Per 16 channels and block, a 16 x 4 dword transpose (one vpermd per 4 channels, then 128-bit
// lane shuffles) gives dword s of every channel in one vector; masked and shifted, the 8 vectors of the block.
LLMSERVE_AVX512_VNNI void q4v_widen(const uint8_t* qw, const at::Half* sc, const at::Half* mi, int64_t K, int64_t n0,
                             uint8_t* wu, float* d, float* mn) {
  const int64_t G = K / 32, row = K / 2;
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t cb = 0; cb < 4; ++cb) {
    const uint8_t* q = qw + (n0 + 16 * cb) * row;
    for (int64_t g = 0; g < G; ++g) {
      __m512i t[4];
      for (int j = 0; j < 4; ++j) {   // channels 4j..4j+3, a 128-bit lane each, then dword s of each in lane s
        const uint8_t* p = q + 4 * j * row + 16 * g;
        __m512i z = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + row)), 1);
        z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * row)), 2);
        z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 3 * row)), 3);
        t[j] = _mm512_permutexvar_epi32(idx, z);
      }
      const __m512i u0 = _mm512_shuffle_i32x4(t[0], t[1], 0x44), u1 = _mm512_shuffle_i32x4(t[0], t[1], 0xEE);
      const __m512i u2 = _mm512_shuffle_i32x4(t[2], t[3], 0x44), u3 = _mm512_shuffle_i32x4(t[2], t[3], 0xEE);
      const __m512i D[4] = {_mm512_shuffle_i32x4(u0, u2, 0x88), _mm512_shuffle_i32x4(u0, u2, 0xDD),
                            _mm512_shuffle_i32x4(u1, u3, 0x88), _mm512_shuffle_i32x4(u1, u3, 0xDD)};
      uint8_t* dst = wu + 8 * g * 256 + 64 * cb;
      for (int s4 = 0; s4 < 4; ++s4) {
        _mm512_storeu_si512(dst + s4 * 256, _mm512_and_si512(D[s4], low));
        _mm512_storeu_si512(dst + (s4 + 4) * 256, _mm512_and_si512(_mm512_srli_epi16(D[s4], 4), low));
      }
    }
  }
  for (int64_t c = 0; c < 64; ++c)
    for (int64_t g = 0; g < G; ++g) {
      d[g * 64 + c] = static_cast<float>(sc[(n0 + c) * G + g]);
      mn[g * 64 + c] = static_cast<float>(mi[(n0 + c) * G + g]);
    }
}


// The portable twins of q4v_widen and q4v_rows (toggles.vnni_twin): the same layout, the same integers, the same
// float operations in the same order.
void q4v_widen_twin(const uint8_t* qw, const at::Half* sc, const at::Half* mi, int64_t K, int64_t n0, uint8_t* wu,
                    float* d, float* mn) {
  const int64_t G = K / 32, row = K / 2;
  for (int64_t c = 0; c < 64; ++c)
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* q = qw + (n0 + c) * row + 16 * g;
      for (int64_t j = 0; j < 32; ++j) {
        const int64_t k = 32 * g + j;
        wu[(k / 4) * 256 + c * 4 + k % 4] = j < 16 ? q[j] & 0x0F : q[j - 16] >> 4;
      }
      d[g * 64 + c] = static_cast<float>(sc[(n0 + c) * G + g]);
      mn[g * 64 + c] = static_cast<float>(mi[(n0 + c) * G + g]);
    }
}

void q4v_rows_twin(int64_t R, const int8_t* xq, const float* dx, const float* xs, int64_t K, const uint8_t* wu,
                   const float* d, const float* mn, int64_t half, float* out, int64_t ldo) {
  const int64_t G = K / 32;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 32 * half; c < 32 * half + 32; ++c) {
      float f = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t a = 0;
        for (int64_t k = 32 * g; k < 32 * g + 32; ++k) a += wu[(k / 4) * 256 + c * 4 + k % 4] * xq[r * K + k];
        f = std::fma(mn[g * 64 + c], xs[r * G + g], std::fma(static_cast<float>(a), d[g * 64 + c] * dx[r * G + g], f));
      }
      out[r * ldo + c - 32 * half] = f;
    }
}

}  // namespace

// y = x @ W.T for int4 W (q4_linear's arguments) on VNNI; N % 64 == 0, K % 32 == 0 (q4_linear checks)
at::Tensor q4_vnni_gemm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale, const at::Tensor& minv,
                        bool q8_1) {
  const int64_t M = x.size(0), N = qw.size(0), K = x.size(1), G = K / 32;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  Rows<int8_t> r(x, q8_1);
  const uint8_t* q = qw.data_ptr<uint8_t>();
  const at::Half *s = scale.data_ptr<at::Half>(), *mi = minv.data_ptr<at::Half>();
  float* op = out.data_ptr<float>();
  constexpr int64_t kRows = 256;   // rows a task: its channels' widened weights serve them all
  const int64_t blocks = N / 64, chunks = (M + kRows - 1) / kRows;
  const bool real = vnni_real();
  at::parallel_for(0, blocks * chunks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> wu(64 * K);
    std::vector<float> d(64 * G), mn(64 * G);
    int64_t widened = -1;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / chunks, m0 = t % chunks * kRows, m1 = std::min(M, m0 + kRows);
      if (b != widened) {
        if (real) q4v_widen(q, s, mi, K, 64 * b, wu.data(), d.data(), mn.data());
        else q4v_widen_twin(q, s, mi, K, 64 * b, wu.data(), d.data(), mn.data());
      }
      widened = b;
      for (int64_t half = 0; half < 2; ++half) {
        if (!real) {
          q4v_rows_twin(m1 - m0, r.q.data() + m0 * K, r.dx.data() + m0 * G, r.sum.data() + m0 * G, K, wu.data(),
                        d.data(), mn.data(), half, op + m0 * N + 64 * b + 32 * half, N);
          continue;
        }
        in_blocks_of_four(m0, m1, [&](int64_t m, auto rows) {
          q4v_rows<decltype(rows)::value>(r.q.data() + m * K, r.dx.data() + m * G, r.sum.data() + m * G, K, wu.data(),
                                          d.data(), mn.data(), half, op + m * N + 64 * b + 32 * half, N);
        });
      }
    }
  });
  return out;
}

namespace {

// Q8_0's blocks (int8 weights, a float32 scale per 32 values: q8_linear's group 32, llama.cpp's Q8_0 x Q8_0 with
// x rounded to int8 per 32) times many rows on AVX-512 VNNI, as q4_vnni_gemm: a task widens 64 channels once into
// the instruction's layout ([K / 4][64][4] bytes, the values + 128 as unsigned bytes: vpdpbusd multiplies unsigned by
// signed) and runs 4 rows x 32 channels at a time. A block's dot is sum (w + 128) x - 128 (sum of x's rounded
// values): the dots' integer, exactly; times d dx into a float32 sum after each block.
template <int R>
LLMSERVE_AVX512_VNNI void q8v_rows(const int8_t* xq, const float* dx, const int32_t* xs, int64_t K, const uint8_t* wu,
                                   const float* d, int64_t half, float* out, int64_t ldo) {
  const int64_t G = K / 32;
  __m512 f[R][2];
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_si512();
    for (int64_t s = 0; s < 8; ++s) {
      const uint8_t* wk = wu + (8 * g + s) * 256 + half * 128;
      const __m512i w0 = _mm512_loadu_si512(wk), w1 = _mm512_loadu_si512(wk + 64);
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, xq + r * K + 32 * g + 4 * s, 4);
        const __m512i x = _mm512_set1_epi32(x4);
        a[r][0] = dpbusd(a[r][0], w0, x);
        a[r][1] = dpbusd(a[r][1], w1, x);
      }
    }
    const float* dg = d + g * 64 + half * 32;
    const __m512 d0 = _mm512_loadu_ps(dg), d1 = _mm512_loadu_ps(dg + 16);
    for (int r = 0; r < R; ++r) {
      const __m512i off = _mm512_set1_epi32(128 * xs[r * G + g]);
      const __m512 sx = _mm512_set1_ps(dx[r * G + g]);
      f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[r][0], off)), _mm512_mul_ps(d0, sx), f[r][0]);
      f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[r][1], off)), _mm512_mul_ps(d1, sx), f[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * ldo, f[r][0]);
    _mm512_storeu_ps(out + r * ldo + 16, f[r][1]);
  }
}

// 64 channels [n0, n0 + 64) of int8 [N, K] with scales [N, K / 32] -> wu (value k of channel c + 128 at
// (k / 4) * 256 + c * 4 + k % 4) and d [K / 32][64]: per 16 channels and 64 values, a 16 x 16 dword transpose.
LLMSERVE_AVX512_VNNI void q8v_widen(const int8_t* qw, const float* sc, int64_t K, int64_t n0, uint8_t* wu, float* d) {
  const int64_t G = K / 32;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t cb = 0; cb < 4; ++cb)
    for (int64_t h = 0; h < K / 64; ++h) {
      __m512i r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(qw + (n0 + 16 * cb + i) * K + 64 * h);
      transpose16_epi32(r);
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t) _mm512_storeu_si512(wu + (16 * h + t) * 256 + 64 * cb, _mm512_xor_si512(r[t], flip));
    }
  for (int64_t c = 0; c < 64; ++c)
    for (int64_t g = 0; g < G; ++g) d[g * 64 + c] = sc[(n0 + c) * G + g];
}

// The portable twins of q8v_widen and q8v_rows (toggles.vnni_twin).
void q8v_widen_twin(const int8_t* qw, const float* sc, int64_t K, int64_t n0, uint8_t* wu, float* d) {
  const int64_t G = K / 32;
  for (int64_t c = 0; c < 64; ++c) {
    for (int64_t k = 0; k < K; ++k)
      wu[(k / 4) * 256 + c * 4 + k % 4] = static_cast<uint8_t>(qw[(n0 + c) * K + k] + 128);
    for (int64_t g = 0; g < G; ++g) d[g * 64 + c] = sc[(n0 + c) * G + g];
  }
}

void q8v_rows_twin(int64_t R, const int8_t* xq, const float* dx, const int32_t* xs, int64_t K, const uint8_t* wu,
                   const float* d, int64_t half, float* out, int64_t ldo) {
  const int64_t G = K / 32;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 32 * half; c < 32 * half + 32; ++c) {
      float f = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t a = 0;
        for (int64_t k = 32 * g; k < 32 * g + 32; ++k) a += wu[(k / 4) * 256 + c * 4 + k % 4] * xq[r * K + k];
        f = std::fma(static_cast<float>(a - 128 * xs[r * G + g]), d[g * 64 + c] * dx[r * G + g], f);
      }
      out[r * ldo + c - 32 * half] = f;
    }
}

}  // namespace

// y = x @ W.T for Q8_0-like W (int8 [N, K], float32 scales [N, K / 32]); N % 64 == 0, K % 64 == 0 (q8_linear checks)
at::Tensor q8b_vnni_gemm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale) {
  const int64_t M = x.size(0), N = qw.size(0), K = x.size(1), G = K / 32;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  Rows<int8_t> r(x);
  std::vector<int32_t> xs(M * G);   // the integer sum of each block of rounded x
  for (int64_t i = 0; i < M * G; ++i) {
    int32_t t = 0;
    for (int64_t k = 0; k < 32; ++k) t += r.q[32 * i + k];
    xs[i] = t;
  }
  const int8_t* q = qw.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  constexpr int64_t kRows = 256;
  const int64_t blocks = N / 64, chunks = (M + kRows - 1) / kRows;
  const bool real = vnni_real();
  at::parallel_for(0, blocks * chunks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> wu(64 * K);
    std::vector<float> d(64 * G);
    int64_t widened = -1;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / chunks, m0 = t % chunks * kRows, m1 = std::min(M, m0 + kRows);
      if (b != widened) {
        if (real) q8v_widen(q, s, K, 64 * b, wu.data(), d.data());
        else q8v_widen_twin(q, s, K, 64 * b, wu.data(), d.data());
      }
      widened = b;
      for (int64_t half = 0; half < 2; ++half) {
        if (!real) {
          q8v_rows_twin(m1 - m0, r.q.data() + m0 * K, r.dx.data() + m0 * G, xs.data() + m0 * G, K, wu.data(), d.data(),
                        half, op + m0 * N + 64 * b + 32 * half, N);
          continue;
        }
        in_blocks_of_four(m0, m1, [&](int64_t m, auto rows) {
          q8v_rows<decltype(rows)::value>(r.q.data() + m * K, r.dx.data() + m * G, xs.data() + m * G, K, wu.data(),
                                          d.data(), half, op + m * N + 64 * b + 32 * half, N);
        });
      }
    }
  });
  return out;
}

}  // namespace llmserve
