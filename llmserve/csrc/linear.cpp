// The linear layers' kernels, out [M, N] = x [M, K] @ W.T with float32 x (linear_dots.h holds the dots they share
// with the GGUF blocks):
//  * q4_linear / q8_linear: weight-only quantized matmul on the packed weights (int4: 32-value groups, value =
//    min + scale * q, q in 0..15, the low nibble of byte j holding element j and the high nibble element j + 16,
//    as GGUF's Q4_0/Q4_1 blocks; int8: groups of `group` values with one scale each, per channel when group ==
//    K). Few rows (decode): integer dot products in one pass over the weights, each unpacked block reused for up
//    to 4 rows (int4: x rounded to int8 per 32 values; int8: to int16). Many rows (prefill): the integer GEMMs
//    (gemm.cpp, vnni.cpp) or tiles of weights widened to float32 and multiplied with gemm().
//  * f32_linear: the float32 GEMV of few rows; head_argmax: greedy tokens of a float32 LM head screened by an int8
//    copy.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "gemm.h"
#include "isa.h"
#include "kernels.h"
#include "linear_dots.h"
#include "vec.h"

namespace llmserve {

namespace {

// ---------------------------------------------------------------------------------------------
// Many rows (prefill, big batches): weight tiles widened to float32, multiplied with gemm().

void q4_dequant_row(const uint8_t* q, const at::Half* s, const at::Half* mi, int64_t K, float* w) {
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < K / 32; ++g) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * g));
    const __m128i lo = _mm_and_si128(b, low);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
    const __m256 sg = _mm256_set1_ps(static_cast<float>(s[g])), mg = _mm256_set1_ps(static_cast<float>(mi[g]));
    float* o = w + 32 * g;
    _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), sg, mg));
    _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), sg, mg));
    _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), sg, mg));
    _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), sg, mg));
  }
}

void q8_dequant_row(const int8_t* q, const float* s, int64_t K, int64_t group, float* w) {
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k))));
    _mm256_storeu_ps(w + k, _mm256_mul_ps(v, _mm256_set1_ps(s[k / group])));
  }
}

}  // namespace

at::Tensor q4_linear(const at::Tensor& x_in, const at::Tensor& qw, const at::Tensor& scale,
                     const at::Tensor& minv, int64_t many_rows, bool q8_1) {
  check_cpu_f32(x_in, "q4_linear");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), N = qw.size(0), K = qw.size(1) * 2, G = K / 32;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && K % 32 == 0 && scale.size(1) == G && minv.size(1) == G,
              "q4_linear: shape mismatch");
  TORCH_CHECK(qw.is_contiguous() && scale.is_contiguous() && minv.is_contiguous() &&
              scale.scalar_type() == at::kHalf && minv.scalar_type() == at::kHalf,
              "q4_linear: contiguous weights, float16 scales and mins");
  const uint8_t* q = qw.data_ptr<uint8_t>();
  const at::Half *s = scale.data_ptr<at::Half>(), *mi = minv.data_ptr<at::Half>();
  if (M >= many_rows && vnni_kernels() && toggles.q4_vnni && N % 64 == 0) return q4_vnni_gemm(x, qw, scale, minv, q8_1);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M >= many_rows) {
    tiled_matmul(x, N, [&](int64_t n, float* w) { q4_dequant_row(q + n * (K / 2), s + n * G, mi + n * G, K, w); }, out);
    return out;
  }
  Rows<int8_t> r(x, q8_1);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
    for (int64_t m = 0; m < M; m += 4) {
      const int8_t* xm = r.q.data() + m * K;
      const float *dm = r.dx.data() + m * G, *sm = r.sum.data() + m * G;
      float* o = op + m * N;
      switch (std::min<int64_t>(4, M - m)) {
        case 1: q4_block<1>(xm, dm, sm, q, s, mi, K, b, e, o, N); break;
        case 2: q4_block<2>(xm, dm, sm, q, s, mi, K, b, e, o, N); break;
        case 3: q4_block<3>(xm, dm, sm, q, s, mi, K, b, e, o, N); break;
        default: q4_block<4>(xm, dm, sm, q, s, mi, K, b, e, o, N); break;
      }
    }
  });
  return out;
}

namespace {

// ---------------------------------------------------------------------------------------------
// AVX-512 (BW) variant of q8_block for int16 activations, chosen at run time (`use_avx512()`): a 32-value
// block of one row is one vpmaddwd over 512 bits (AVX2: two, and an add), and 32 vector registers hold
// the accumulators of 8 rows, so a batch reads the weights once per 8 rows instead of 4. Compiled for
// AVX-512 only inside these functions (target attribute): the rest of the file stays AVX2, and a CPU
// without AVX-512 never reaches them. Same integer dot products as q8_block; the float sums run over 16 lanes
// instead of 8 (results agree to float rounding). Its portable twin, q8_rows16_twin, gives the same bits on any CPU.

template <int MR>
LLMSERVE_AVX512 void q8_block16_avx512(const int16_t* xq, const float* dx, const int8_t* qw, const float* sc,
                                        int64_t K, int64_t group, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  const int64_t G = K / 32, per = group / 32;
  std::vector<float> sdv(MR * G), sw(G);
  float* sd = sdv.data();
  const bool per_channel = per == G && G > 1;
  auto scales = [&](const float* s) {   // sd[m * G + g] = s[g] * dx[m * G + g]
    for (int m = 0; m < MR; ++m)
      for (int64_t g = 0; g < G; ++g) sd[m * G + g] = s[g] * dx[m * G + g];
  };
  if (per_channel) {
    std::fill(sw.begin(), sw.end(), 1.0f);
    scales(sw.data());
  }
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* q = qw + n * K;
    const float* s = sc + n * (K / group);
    if (per == 1) {
      scales(s);
    } else if (!per_channel) {
      for (int64_t i = 0; i < K / group; ++i) std::fill(sw.begin() + i * per, sw.begin() + (i + 1) * per, s[i]);
      scales(sw.data());
    }
    __m512 acc[2][MR];
    for (int m = 0; m < MR; ++m) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
    // even blocks into acc[0], odd into acc[1], as two_chains (written out: a lambda loses the target)
#define LLMSERVE_Q8_STEP(g, a)                                                                              \
  {                                                                                                        \
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * (g)))); \
    for (int m = 0; m < MR; ++m) {                                                                         \
      const __m512i p = _mm512_madd_epi16(w, _mm512_loadu_si512(xq + m * K + 32 * (g)));                   \
      a[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(sd[m * G + (g)]), a[m]);                \
    }                                                                                                      \
  }
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) {
      LLMSERVE_Q8_STEP(g, acc[0])
      LLMSERVE_Q8_STEP(g + 1, acc[1])
    }
    if (g < G) LLMSERVE_Q8_STEP(g, acc[0])
#undef LLMSERVE_Q8_STEP
    const float row_scale = per_channel ? s[0] : 1.0f;
    for (int m = 0; m < MR; ++m) out[m * ldo + n] = row_scale * _mm512_reduce_add_ps(_mm512_add_ps(acc[0][m], acc[1][m]));
  }
}

LLMSERVE_AVX512 void q8_rows16_avx512(const int16_t* xq, const float* dx, const int8_t* q, const float* s, int64_t M,
                                      int64_t N, int64_t K, int64_t group, float* op) {
  const int64_t G = K / 32;
  at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
    for (int64_t m = 0; m < M; m += 8) {
      const int16_t* xm = xq + m * K;
      const float* dm = dx + m * G;
      float* o = op + m * N;
      switch (std::min<int64_t>(8, M - m)) {
        case 1: q8_block16_avx512<1>(xm, dm, q, s, K, group, b, e, o, N); break;
        case 2: q8_block16_avx512<2>(xm, dm, q, s, K, group, b, e, o, N); break;
        case 3: q8_block16_avx512<3>(xm, dm, q, s, K, group, b, e, o, N); break;
        case 4: q8_block16_avx512<4>(xm, dm, q, s, K, group, b, e, o, N); break;
        case 5: q8_block16_avx512<5>(xm, dm, q, s, K, group, b, e, o, N); break;
        case 6: q8_block16_avx512<6>(xm, dm, q, s, K, group, b, e, o, N); break;
        case 7: q8_block16_avx512<7>(xm, dm, q, s, K, group, b, e, o, N); break;
        default: q8_block16_avx512<8>(xm, dm, q, s, K, group, b, e, o, N); break;
      }
    }
  });
}

// The portable twin of q8_rows16_avx512 (toggles.avx512_twin, LLMSERVE_AVX512=twin: any CPU, the same bits): per row
// of x and weight row, 16 lanes in arrays, lane i of block g the vpmaddwd sum of values 2i, 2i + 1, the same fused
// multiply-adds into the same two chains, _mm512_reduce_add_ps's order (reduce_add16).
void q8_rows16_twin(const int16_t* xq, const float* dx, const int8_t* qw, const float* sc, int64_t M, int64_t N,
                    int64_t K, int64_t group, float* op) {
  const int64_t G = K / 32, per = group / 32;
  const bool per_channel = per == G && G > 1;
  at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const int8_t* q = qw + n * K;
      const float* s = sc + n * (K / group);
      for (int64_t m = 0; m < M; ++m) {
        const int16_t* x = xq + m * K;
        float acc[2][16] = {};
        for (int64_t g = 0; g < G; ++g) {
          const float sd = (per_channel ? 1.0f : s[g / per]) * dx[m * G + g];
          for (int i = 0; i < 16; ++i) {
            const int64_t k = 32 * g + 2 * i;
            const int32_t p = q[k] * x[k] + q[k + 1] * x[k + 1];
            acc[g % 2][i] = std::fma(static_cast<float>(p), sd, acc[g % 2][i]);
          }
        }
        float t[16];
        for (int i = 0; i < 16; ++i) t[i] = acc[0][i] + acc[1][i];
        op[m * N + n] = (per_channel ? s[0] : 1.0f) * reduce_add16(t);
      }
    }
  });
}

template <typename T>
void q8_rows(const at::Tensor& x, const int8_t* q, const float* s, int64_t N, int64_t group, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), G = K / 32;
  Rows<T> r(x);
  if constexpr (std::is_same_v<T, int16_t>) {
    if (M > 1 && avx512_kernels()) {   // one row: bound by memory, the AVX2 kernel is as fast
      if (avx512_real())
        q8_rows16_avx512(r.q.data(), r.dx.data(), q, s, M, N, K, group, out.data_ptr<float>());
      else
        q8_rows16_twin(r.q.data(), r.dx.data(), q, s, M, N, K, group, out.data_ptr<float>());
      return;
    }
  }
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
    for (int64_t m = 0; m < M; m += 4) {
      const T* xm = r.q.data() + m * K;
      const float* dm = r.dx.data() + m * G;
      float* o = op + m * N;
      switch (std::min<int64_t>(4, M - m)) {
        case 1: q8_block<1, T>(xm, dm, q, s, K, group, b, e, o, N); break;
        case 2: q8_block<2, T>(xm, dm, q, s, K, group, b, e, o, N); break;
        case 3: q8_block<3, T>(xm, dm, q, s, K, group, b, e, o, N); break;
        default: q8_block<4, T>(xm, dm, q, s, K, group, b, e, o, N); break;
      }
    }
  });
}

// float32 weights, few rows: each weight row read once for up to 4 rows of x, two FMA chains a row.
// (at::linear's one-row GEMV streams ~12 GB/s here, this ~30: a float32 decode step reads 538 MB.)
template <int MR>
void f32_block(const float* x, int64_t ldx, const float* w, int64_t K, int64_t n0, int64_t n1, float* out,
               int64_t ldo) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* r = w + n * K;
    __m256 acc[2][MR];
    for (int m = 0; m < MR; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
    auto step = [&](int64_t g, __m256* a) {   // 8 values
      const __m256 wv = _mm256_loadu_ps(r + 8 * g);
      for (int m = 0; m < MR; ++m) a[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ldx + 8 * g), a[m]);
    };
    two_chains(K / 8, step, acc);
    for (int m = 0; m < MR; ++m) out[m * ldo + n] = hsum(_mm256_add_ps(acc[0][m], acc[1][m]));
  }
}

// The AVX-512 variant (avx512_kernels(), K a multiple of 16): each weight row read once per 8 rows of x. Its portable
// twin, f32_dot_twin, gives the same bits on any CPU.
template <int MR>
LLMSERVE_AVX512 void f32_block_avx512(const float* x, int64_t ldx, const float* w, int64_t K, int64_t n0, int64_t n1,
                                      float* out, int64_t ldo) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* r = w + n * K;
    __m512 acc[2][MR];
    for (int m = 0; m < MR; ++m) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      const __m512 w0 = _mm512_loadu_ps(r + k), w1 = _mm512_loadu_ps(r + k + 16);
      for (int m = 0; m < MR; ++m) {
        acc[0][m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * ldx + k), acc[0][m]);
        acc[1][m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * ldx + k + 16), acc[1][m]);
      }
    }
    if (k < K) {   // K % 32 == 16
      const __m512 w0 = _mm512_loadu_ps(r + k);
      for (int m = 0; m < MR; ++m) acc[0][m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * ldx + k), acc[0][m]);
    }
    for (int m = 0; m < MR; ++m) out[m * ldo + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][m], acc[1][m]));
  }
}

LLMSERVE_AVX512 void f32_rows_avx512(const float* xp, const float* wp, int64_t M, int64_t N, int64_t K, float* op) {
  at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
    for (int64_t m = 0; m < M; m += 8) {
      const float* xm = xp + m * K;
      float* o = op + m * N;
      switch (std::min<int64_t>(8, M - m)) {
        case 1: f32_block_avx512<1>(xm, K, wp, K, b, e, o, N); break;
        case 2: f32_block_avx512<2>(xm, K, wp, K, b, e, o, N); break;
        case 3: f32_block_avx512<3>(xm, K, wp, K, b, e, o, N); break;
        case 4: f32_block_avx512<4>(xm, K, wp, K, b, e, o, N); break;
        case 5: f32_block_avx512<5>(xm, K, wp, K, b, e, o, N); break;
        case 6: f32_block_avx512<6>(xm, K, wp, K, b, e, o, N); break;
        case 7: f32_block_avx512<7>(xm, K, wp, K, b, e, o, N); break;
        default: f32_block_avx512<8>(xm, K, wp, K, b, e, o, N); break;
      }
    }
  });
}

// The portable twin of f32_block_avx512 for one row of x and one weight row r (toggles.avx512_twin,
// LLMSERVE_AVX512=twin): 16 lanes in arrays, the same fused multiply-adds into the same two chains,
// _mm512_reduce_add_ps's order (reduce_add16).
float f32_dot_twin(const float* x, const float* r, int64_t K) {
  float acc[2][16] = {};
  int64_t k = 0;
  for (; k + 32 <= K; k += 32)
    for (int i = 0; i < 16; ++i) {
      acc[0][i] = std::fma(r[k + i], x[k + i], acc[0][i]);
      acc[1][i] = std::fma(r[k + 16 + i], x[k + 16 + i], acc[1][i]);
    }
  if (k < K)   // K % 32 == 16
    for (int i = 0; i < 16; ++i) acc[0][i] = std::fma(r[k + i], x[k + i], acc[0][i]);
  float t[16];
  for (int i = 0; i < 16; ++i) t[i] = acc[0][i] + acc[1][i];
  return reduce_add16(t);
}

void f32_rows_twin(const float* xp, const float* wp, int64_t M, int64_t N, int64_t K, float* op) {
  at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n)
      for (int64_t m = 0; m < M; ++m) op[m * N + n] = f32_dot_twin(xp + m * K, wp + n * K, K);
  });
}

}  // namespace

// out [M, N] = x [M, K] @ w.T, w float32 [N, K]; rows >= many_rows (or K not a multiple of 8): gemm().
at::Tensor f32_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t many_rows) {
  check_cpu_f32(x_in, "f32_linear");
  check_cpu_f32(w, "f32_linear");
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1), "f32_linear: shape mismatch");
  const int64_t M = x_in.size(0), N = w.size(0), K = w.size(1);
  if (w.is_mkldnn() || M >= many_rows || K % 8 != 0 || !w.is_contiguous()) return gemm(x_in, w);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (K % 16 == 0 && avx512_kernels()) {   // every row count: a row's sum never depends on the batch around it
    if (avx512_real())
      f32_rows_avx512(xp, wp, M, N, K, op);
    else
      f32_rows_twin(xp, wp, M, N, K, op);
    return out;
  }
  at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
    for (int64_t m = 0; m < M; m += 4) {
      const float* xm = xp + m * K;
      float* o = op + m * N;
      switch (std::min<int64_t>(4, M - m)) {
        case 1: f32_block<1>(xm, K, wp, K, b, e, o, N); break;
        case 2: f32_block<2>(xm, K, wp, K, b, e, o, N); break;
        case 3: f32_block<3>(xm, K, wp, K, b, e, o, N); break;
        default: f32_block<4>(xm, K, wp, K, b, e, o, N); break;
      }
    }
  });
  return out;
}

// Greedy tokens of a float32 head (the LM head) without streaming all of it: an int8 copy (per-row
// scale s, largest rounding error err per row) screens the rows. With x~ the int16 rounding of x per
// 32 values (what q8_rows multiplies), every row's approximate value is within
//   b = err * |x|_1 + s * 127 * sum_j |x_j - x~_j|   (|x_j - x~_j| <= 0.51 * dx of its block)
// of the exact one (float rounding of both sides: under 0.1% of b; 1% is added). A row can hold the
// maximum only if approx + b reaches the best approx - b; those few rows (3 a step at the median for
// SmolLM2) are computed exactly, as f32_linear computes them, so the token is argmax(f32_linear(x, w))
// (first index on ties) at a quarter of the bytes. A row of x that is not finite answers -1.
at::Tensor head_argmax(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& qw, const at::Tensor& scale,
                       const at::Tensor& err) {
  check_cpu_f32(x_in, "head_argmax");
  check_cpu_f32(w, "head_argmax");
  check_cpu_f32(scale, "head_argmax");
  check_cpu_f32(err, "head_argmax");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && K % 32 == 0 && w.is_contiguous() && qw.is_contiguous() &&
              qw.scalar_type() == at::kChar && qw.size(0) == N && qw.size(1) == K && scale.numel() == N &&
              err.numel() == N && scale.is_contiguous() && err.is_contiguous(), "head_argmax: shape mismatch");
  at::Tensor approx = at::empty({M, N}, x.options());
  q8_rows<int16_t>(x, qw.data_ptr<int8_t>(), scale.data_ptr<float>(), N, K, approx);
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>(), *sp = scale.data_ptr<float>(),
              *ep = err.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xm = xp + m * K;
      const float* a = approx.data_ptr<float>() + m * N;
      double l1 = 0, dsum = 0;
      for (int64_t g = 0; g < K / 32; ++g) {
        float amax = 0;
        for (int64_t j = 32 * g; j < 32 * g + 32; ++j) {
          l1 += std::fabs(xm[j]);
          amax = std::max(amax, std::fabs(xm[j]));
        }
        dsum += amax / 32767.0;
      }
      if (!std::isfinite(l1)) {
        op[m] = -1;
        continue;
      }
      const float cs1 = static_cast<float>(1.01 * l1), cs2 = static_cast<float>(1.01 * 127 * 0.51 * 32 * dsum);
      const __m256 c1 = _mm256_set1_ps(cs1), c2 = _mm256_set1_ps(cs2);
      auto bound = [&](int64_t n) {   // 8 rows' b
        return _mm256_fmadd_ps(_mm256_loadu_ps(ep + n), c1, _mm256_mul_ps(_mm256_loadu_ps(sp + n), c2));
      };
      int64_t n = 0;
      __m256 lo8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      for (; n + 8 <= N; n += 8) lo8 = _mm256_max_ps(lo8, _mm256_sub_ps(_mm256_loadu_ps(a + n), bound(n)));
      float lower = hmax(lo8);
      for (; n < N; ++n) lower = std::max(lower, a[n] - (ep[n] * cs1 + sp[n] * cs2));
      const __m256 lower8 = _mm256_set1_ps(lower);
      int64_t best = -1;
      float best_v = 0;
      const bool wide = K % 16 == 0 && avx512_kernels(), real = avx512_real();   // as f32_linear chooses
      auto exact = [&](int64_t r) {
        float v;
        if (wide && real)
          f32_block_avx512<1>(xm, K, wp + r * K, K, 0, 1, &v, 0);
        else if (wide)
          v = f32_dot_twin(xm, wp + r * K, K);
        else
          f32_block<1>(xm, K, wp + r * K, K, 0, 1, &v, 0);
        if (best < 0 || v > best_v) best = r, best_v = v;
      };
      for (n = 0; n + 8 <= N; n += 8) {
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(_mm256_loadu_ps(a + n), bound(n)), lower8, _CMP_GE_OQ));
        while (mask) {
          const int i = __builtin_ctz(mask);
          mask &= mask - 1;
          exact(n + i);
        }
      }
      for (; n < N; ++n)
        if (a[n] + (ep[n] * cs1 + sp[n] * cs2) >= lower) exact(n);
      op[m] = best;
    }
  });
  return out;
}

at::Tensor q8_linear(const at::Tensor& x_in, const at::Tensor& qw, const at::Tensor& scale, int64_t many_rows,
                     int64_t act_code) {
  check_cpu_f32(x_in, "q8_linear");
  int64_t act_bits;  // (w8a8: x rotated first, its weights were: gemm.h's rotated_for)
  const at::Tensor x = rotated_for(x_in, act_code, act_bits).contiguous();
  const bool packed = qw.is_mkldnn();   // onednn::qlinear_prepack's [K, N]: the integer GEMM at every row count
  const int64_t M = x.size(0), N = qw.size(packed ? 1 : 0), K = qw.size(packed ? 0 : 1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && K % 32 == 0 && K % scale.size(1) == 0 &&
              (K / scale.size(1)) % 32 == 0, "q8_linear: shape mismatch (groups of a multiple of 32)");
  TORCH_CHECK((packed || qw.is_contiguous()) && scale.is_contiguous() && scale.scalar_type() == at::kFloat,
              "q8_linear: contiguous weights, float32 scales");
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "q8_linear: act_bits is 8 or 16");
  if (packed) {
    TORCH_CHECK(scale.size(1) == 1, "q8_linear: a packed weight has one scale per channel");
    return q8_int_gemm(x, qw, scale, act_bits);
  }
  const int64_t group = K / scale.size(1);
  const int8_t* q = qw.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  if (M >= many_rows && group == K && toggles.q8_int_gemm) return q8_int_gemm(x, qw, scale, act_bits);
  // Q8_0 x Q8_0 (blocks of 32, x to int8 per 32): the VNNI integer GEMM from toggles.q8_block_rows rows, whatever
  // many_rows says (its callers keep this mode on the dots at every row count otherwise: the same integers)
  if (group == 32 && act_bits == 8 && M >= toggles.q8_block_rows && vnni_kernels() && N % 64 == 0 && K % 64 == 0)
    return q8b_vnni_gemm(x, qw, scale);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M >= many_rows)
    tiled_matmul(x, N, [&](int64_t n, float* w) { q8_dequant_row(q + n * K, s + n * (K / group), K, group, w); }, out);
  else if (act_bits == 8)
    q8_rows<int8_t>(x, q, s, N, group, out);
  else
    q8_rows<int16_t>(x, q, s, N, group, out);
  return out;
}

}  // namespace llmserve
