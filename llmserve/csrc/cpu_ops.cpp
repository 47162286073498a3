// llmserve's CPU kernels (AVX2 + FMA, float32 activations), built on first use by llmserve/model/ops.py.
//
//  * q4_linear / q8_linear: weight-only quantized matmul on the packed weights (int4: 32-value
//    groups, value = min + scale * q, q in 0..15, the low nibble of byte j holding element j and the
//    high nibble element j + 16, as GGUF's Q4_0/Q4_1 blocks; int8: groups of `group` values with
//    one scale each, per channel when group == K). Few rows (decode): integer dot products in one
//    pass over the weights, each unpacked block reused for up to 4 rows (int4: x rounded to int8 per
//    32 values; int8: to int16). Many rows (prefill):
//    tiles of weights widened to float32 and multiplied with gemm() (MKL or oneDNN, measured).
//  * rms_norm / add_rms_norm_: RMSNorm, and the residual add fused with the next norm (in place).
//  * rotary_write_kv_: neox-style rotary embedding applied in place to the q and k heads of fused qkv
//    rows, and the rows' K and V written into the paged cache.
//  * silu_and_mul: SiLU(gate) * up of a fused gate_up row.
//  * paged_decode_attention_: one query per request against its blocks, read in place from the
//    paged cache (no gather copy), the heads sharing a KV head processed together.
//  * paged_prefill_attention_: a prefill chunk's causal attention over its cached prefix and itself, read
//    in place from the blocks, flash-style (key tiles, online softmax), AVX-512 or AVX2.
//  * gguf_*: GGUF blocks read in place (gguf_ops.cpp, compiled into this module), also a kind of projection
//    the fused decode stack reads.
#include "gguf_ops.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
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

void check_cpu_f32(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, what, ": expected a float32 CPU tensor");
}

// ---------------------------------------------------------------------------------------------
// Integer dot products (few rows). Each 32-value block of x is rounded to integers with its own
// scale dx; a weight block times an x block is summed in int32, then scaled by (weight scale * dx).
//  * int4 weights: x rounded to int8 (dx = max|x| / 127) and vpmaddubsw, as llama.cpp's Q4_1 x Q8_1
//    dot product: single-stream decode is bound by memory traffic, and this is the cheapest dot;
//  * int8 weights: x rounded to int16 (dx = max|x| / 32767, relative error ~1e-5) and vpmaddwd: the
//    accuracy mode. (Rounding x to int8 there cost this model 1.3 points of greedy agreement with
//    float32, below the 95% the int8 mode promises; measured, see docs/engine.md.)

template <typename T> constexpr float kMaxQ = 127.0f;
template <> constexpr float kMaxQ<int16_t> = 32767.0f;

// x [M, K] -> xq [M, K] (int8 or int16), dx [M, K/32], xsum [M, K/32] (float sums, for int4's min).
template <typename T>
void quantize_rows(const float* x, int64_t M, int64_t K, T* xq, float* dx, float* xsum) {
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
      dx[m * (K / 32) + g] = amax / kMaxQ<T>;
      xsum[m * (K / 32) + g] = sum;
    }
}

// 8 float16 values -> 8 floats
inline __m256 load_half8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 values of a KV cache (float32 or float16) as floats, and back
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return load_half8(p); }
inline void store_kv(const float* src, int64_t n, float* dst) { std::copy(src, src + n, dst); }
inline void store_kv(const float* src, int64_t n, at::Half* dst) {   // n % 8 == 0; round to nearest even
  for (int64_t i = 0; i < n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
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

// ---------------------------------------------------------------------------------------------
// The float32 GEMM every many-rows path ends in: at::linear (MKL's sgemm in torch's CPU build) or oneDNN's
// matmul (torch's own mkldnn::_linear_pointwise op, called through the dispatcher). Which one is measured at
// start-up (ops.gemm_engine): on AMD CPUs MKL keeps to its AVX2 code while oneDNN runs AVX-512 (2-2.4x here).
// oneDNN builds a primitive per shape (~1 ms, kept in its cache of 1024): rows are padded up to a bucket so a
// model meets a few dozen row counts per weight shape, not one per prefill chunk length.

bool gemm_onednn = false;   // set by ops.py (set_gemm_engine)

int64_t gemm_bucket(int64_t M) {   // exact to 64 rows; then steps of 16 to 128, of 32 to 512, of 64 beyond
  if (M <= 64) return M;
  const int64_t step = M <= 128 ? 16 : M <= 512 ? 32 : 64;
  return (M + step - 1) / step * step;
}

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         std::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<std::string_view>)>();
  const int64_t M = x.size(0), Mb = gemm_bucket(M);
  if (Mb == M) return op.call(x, w, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
  at::Tensor xp = at::empty({Mb, x.size(1)}, x.options());
  xp.narrow(0, 0, M).copy_(x);
  xp.narrow(0, M, Mb - M).zero_();
  return op.call(xp, w, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt).narrow(0, 0, M);
}

// x [M, K] @ w [N, K].T, float32
at::Tensor gemm(const at::Tensor& x, const at::Tensor& w) {
  if (w.is_mkldnn())   // packed by ops.pack_weight (oneDNN's blocked layout)
    return x.size(0) > 0 ? onednn_linear(x.contiguous(), w) : at::empty({0, w.size(0)}, x.options());
  if (gemm_onednn && x.dim() == 2 && x.size(0) > 0) return onednn_linear(x.contiguous(), w.contiguous());
  return at::linear(x, w);
}

bool set_gemm_engine(bool onednn) {
  gemm_onednn = onednn;
  return gemm_onednn;
}

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

// ---------------------------------------------------------------------------------------------
// The entry points: out [M, N] = x [M, K] @ W.T; rows < many_rows through the integer dots.

template <typename T>
struct Rows {   // x rounded per 32-value block
  std::vector<T> q;
  std::vector<float> dx, sum;
  Rows(const at::Tensor& x) : q(x.numel()), dx(x.numel() / 32), sum(x.numel() / 32) {
    quantize_rows<T>(x.data_ptr<float>(), x.size(0), x.size(1), q.data(), dx.data(), sum.data());
  }
};

bool uses_vnni();
at::Tensor q4_vnni_gemm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale, const at::Tensor& minv);
bool q4_vnni_on = true;   // KernelConfig.int4_vnni (ops.configure)
bool set_q4_vnni(bool on) {
  q4_vnni_on = on;
  return on;
}

at::Tensor q4_linear(const at::Tensor& x_in, const at::Tensor& qw, const at::Tensor& scale,
                     const at::Tensor& minv, int64_t many_rows) {
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
  if (M >= many_rows && uses_vnni() && q4_vnni_on && N % 64 == 0) return q4_vnni_gemm(x, qw, scale, minv);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M >= many_rows) {
    tiled_matmul(x, N, [&](int64_t n, float* w) { q4_dequant_row(q + n * (K / 2), s + n * G, mi + n * G, K, w); }, out);
    return out;
  }
  Rows<int8_t> r(x);
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

// ---------------------------------------------------------------------------------------------
// AVX-512 (BW) variant of q8_block for int16 activations, chosen at run time (`use_avx512()`): a 32-value
// block of one row is one vpmaddwd over 512 bits (AVX2: two, and an add), and 32 vector registers hold
// the accumulators of 8 rows, so a batch reads the weights once per 8 rows instead of 4. Compiled for
// AVX-512 only inside these functions (target attribute): the rest of the file stays AVX2, and a CPU
// without AVX-512 never reaches them. Same integer dot products as q8_block; the float sums of the
// blocks are added in another order (16 lanes instead of 8): results agree to float rounding.
#define LLMSERVE_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

bool cpu_has_avx512() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  }();
  return ok;
}

bool avx512_allowed = true;   // set once by ops.py when it loads the module (envs.LLMSERVE_AVX512)

bool use_avx512() { return avx512_allowed && cpu_has_avx512(); }

bool set_avx512(bool allowed) {
  avx512_allowed = allowed;
  llmserve_gguf::set_avx512(allowed);   // (its K-quant dots also need VNNI)
  return use_avx512();
}

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

template <typename T>
void q8_rows(const at::Tensor& x, const int8_t* q, const float* s, int64_t N, int64_t group, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), G = K / 32;
  Rows<T> r(x);
  if constexpr (std::is_same_v<T, int16_t>) {
    if (M > 1 && use_avx512()) {   // one row: bound by memory, the AVX2 kernel is as fast
      q8_rows16_avx512(r.q.data(), r.dx.data(), q, s, M, N, K, group, out.data_ptr<float>());
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

// The AVX-512 variant (use_avx512(), K a multiple of 16): each weight row read once per 8 rows of x.
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
  if (K % 16 == 0 && use_avx512()) {   // every row count: a row's sum never depends on the batch around it
    f32_rows_avx512(xp, wp, M, N, K, op);
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
      const bool wide = K % 16 == 0 && use_avx512();   // as f32_linear chooses
      auto exact = [&](int64_t r) {
        float v;
        if (wide)
          f32_block_avx512<1>(xm, K, wp + r * K, K, 0, 1, &v, 0);
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

// act_bits: the integer width x is rounded to on the few-rows path (16, or 8: faster, less exact).
// Many rows on int8 weights with one scale per output channel: an integer GEMM (torch's _int_mm, oneDNN's
// int8 matmul: VNNI where the CPU has it, 3-5x the float32 GEMM here). Each row of x is rounded to int8
// with its own scale (per token, so a row's result does not depend on the others); act_bits 16 adds a
// second int8 row for what the first rounding left (scale / 254): ~15 bits in all, relative error ~4e-5
// against ~9e-3 for one level, for twice the integer work. Rows padded to gemm_bucket as gemm() does.

bool q8_int_gemm_on = true;   // set by ops.py (set_q8_int_gemm; KernelConfig.int8_gemm)

bool set_q8_int_gemm(bool on) {
  q8_int_gemm_on = on;
  return on;
}

// A packed weight (onednn::qlinear_prepack, [K, N] in oneDNN's blocked layout: `ops.pack_int8_weight`) goes through
// onednn::qlinear_pointwise: activations as uint8 q + 128 with zero point 128 (the same integer products, exactly),
// no per-call re-layout of the weight (16 rows of a 1B model's MLP ~2x _int_mm's time on the plain weight; even
// with the dots at one row). Its float32 output holds the int32 sums (exact below 2^24).
at::Tensor qlinear_u8(const at::Tensor& xq, const at::Tensor& packed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("onednn::qlinear_pointwise", "")
                       .typed<at::Tensor(at::Tensor, double, int64_t, at::Tensor, at::Tensor, at::Tensor,
                                         std::optional<at::Tensor>, double, int64_t, std::optional<at::ScalarType>,
                                         std::string_view, c10::List<std::optional<at::Scalar>>, std::string_view)>();
  const int64_t N = packed.size(1);
  const at::Tensor ones = at::ones({N}, xq.options().dtype(at::kFloat)), zeros = at::zeros({N}, xq.options().dtype(at::kLong));
  return op.call(xq, 1.0, 128, packed, ones, zeros, std::nullopt, 1.0, 0, at::kFloat, "none",
                 c10::List<std::optional<at::Scalar>>(), "");
}

// Each row m of x [M, K] rounded to int8 with its own scale sx[m] = amax / 127, and with L == 2 what that left
// rounded again at sx[M + m] = sx[m] / 254: level l of row m at q + (l * Mb + m) * K. `u8`: stored as q + 128
// (uint8, for u8 x s8 products), else as int8.
void round_rows(const float* xp, int64_t M, int64_t K, int64_t L, int64_t Mb, bool u8, uint8_t* qp, float* sx) {
  // 8 rounded values (int32 lanes, within +-127) -> 8 bytes at `dst`, flipped to q + 128 (u8)
  const __m128i flip = _mm_set1_epi8(u8 ? static_cast<char>(0x80) : 0);
  const auto store8 = [&](const __m256 f, uint8_t* dst) {
    const __m256i v = _mm256_cvtps_epi32(f);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_xor_si128(_mm_packs_epi16(w, w), flip));
  };
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    const __m256 sign = _mm256_set1_ps(-0.0f), lim = _mm256_set1_ps(127.0f);
    for (int64_t m = b; m < e; ++m) {
      const float* r = xp + m * K;
      __m256 a8 = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k += 8) a8 = _mm256_max_ps(a8, _mm256_andnot_ps(sign, _mm256_loadu_ps(r + k)));
      const float amax = hmax(a8);
      const float s1 = amax > 0 ? amax / 127.0f : 1.0f, s2 = s1 / 254.0f;
      sx[m] = s1;
      if (L == 2) sx[M + m] = s2;
      const __m256 i1 = _mm256_set1_ps(1.0f / s1), i2 = _mm256_set1_ps(1.0f / s2), v1 = _mm256_set1_ps(s1);
      uint8_t* q1 = qp + m * K;
      uint8_t* q2 = qp + (Mb + m) * K;
      for (int64_t k = 0; k < K; k += 8) {
        const __m256 v = _mm256_loadu_ps(r + k);
        const __m256 f1 = _mm256_round_ps(_mm256_mul_ps(v, i1), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        store8(f1, q1 + k);
        if (L == 2) {
          __m256 f2 = _mm256_round_ps(_mm256_mul_ps(_mm256_fnmadd_ps(f1, v1, v), i2),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          store8(_mm256_min_ps(_mm256_max_ps(f2, _mm256_sub_ps(_mm256_setzero_ps(), lim)), lim), q2 + k);
        }
      }
    }
  });
}

at::Tensor q8_int_gemm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale, int64_t act_bits) {
  const bool packed = qw.is_mkldnn();
  const int64_t M = x.size(0), K = x.size(1), N = qw.size(packed ? 1 : 0), Mb = gemm_bucket(M);
  const int64_t L = act_bits > 8 ? 2 : 1;
  // int8 rows for _int_mm; for the packed weight the same values + 128 as uint8 (0 and 128: the padding rows')
  at::Tensor xq = at::empty({L * Mb, K}, x.options().dtype(packed ? at::kByte : at::kChar));
  const uint8_t zero = packed ? 128 : 0;
  for (int64_t l = 0; l < L; ++l) xq.narrow(0, l * Mb + M, Mb - M).fill_(static_cast<int64_t>(zero));
  std::vector<float> sx(L * M);
  round_rows(x.data_ptr<float>(), M, K, L, Mb, packed, static_cast<uint8_t*>(xq.data_ptr()), sx.data());
  at::Tensor out = at::empty({M, N}, x.options());
  const float* ws = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (packed) {   // the sums come as float32
    const at::Tensor acc = qlinear_u8(xq, qw);   // [L * Mb, N]
    const float* ap = acc.data_ptr<float>();
    at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
      for (int64_t m = b; m < e; ++m) {
        const float *a1 = ap + m * N, *a2 = ap + (Mb + m) * N;
        const __m256 s1 = _mm256_set1_ps(sx[m]), s2 = _mm256_set1_ps(L == 2 ? sx[M + m] : 0.0f);
        int64_t n = 0;
        for (; n + 8 <= N; n += 8) {
          __m256 y = _mm256_mul_ps(_mm256_loadu_ps(a1 + n), s1);
          if (L == 2) y = _mm256_fmadd_ps(_mm256_loadu_ps(a2 + n), s2, y);
          _mm256_storeu_ps(op + m * N + n, _mm256_mul_ps(y, _mm256_loadu_ps(ws + n)));
        }
        for (; n < N; ++n) op[m * N + n] = (a1[n] * sx[m] + (L == 2 ? a2[n] * sx[M + m] : 0.0f)) * ws[n];
      }
    });
    return out;
  }
  const at::Tensor acc = at::_int_mm(xq, qw.t());   // [L * Mb, N] int32
  const int32_t* ap = acc.data_ptr<int32_t>();
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const int32_t* a1 = ap + m * N;
      const int32_t* a2 = ap + (Mb + m) * N;
      const __m256 s1 = _mm256_set1_ps(sx[m]), s2 = _mm256_set1_ps(L == 2 ? sx[M + m] : 0.0f);
      int64_t n = 0;
      for (; n + 8 <= N; n += 8) {
        __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a1 + n))), s1);
        if (L == 2)
          y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a2 + n))), s2, y);
        _mm256_storeu_ps(op + m * N + n, _mm256_mul_ps(y, _mm256_loadu_ps(ws + n)));
      }
      for (; n < N; ++n) op[m * N + n] = (a1[n] * sx[m] + (L == 2 ? a2[n] * sx[M + m] : 0.0f)) * ws[n];
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// int8 weights with a scale per channel times any number of rows, on AVX-512 VNNI (vpdpbusd: 64 u8 x s8 products
// an instruction): llmserve's own integer GEMM, where oneDNN's (through _int_mm, or qlinear_pointwise on a packed
// weight) spends much of a decoding batch's time on per-call set-up and re-layout. The weights are laid out once
// for the instruction, [N / 16, K / 4, 16, 4] in place of the plain [N, K] (a 64-byte vector per 16 channels x 4
// inputs: `ops.vnni_pack`), with the sum of each channel's int8 values (the activations go in as q + 128: their
// products are the int8 ones + 128 x that sum, taken off exactly). The activations are rounded as q8_int_gemm
// rounds them (round_rows: the same integers, the same float epilogue: the same result, bit for bit). A task is
// a block of 64 channels (4 vectors) for every row: its weights (64 x K bytes) stay in L1/L2 while 4 rows at a
// time are multiplied with them, 16 accumulators in registers.

#define LLMSERVE_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

bool cpu_has_vnni() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
  }();
  return ok;
}

bool uses_vnni() { return use_avx512() && cpu_has_vnni(); }

// acc += the 4-byte dot products of u8 `x` and s8 `w` per lane, accumulated in place (GCC's code for the
// intrinsic copies each accumulator around the loop)
LLMSERVE_VNNI inline __m512i dpbusd(__m512i acc, __m512i x, __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}

template <int R, int T>
LLMSERVE_VNNI void vnni_block(const uint8_t* xq, int64_t K, const int8_t* wv, int64_t tile_bytes, int32_t* acc,
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
LLMSERVE_VNNI void vnni_rows(const uint8_t* xq, int64_t rows, int64_t K, const int8_t* wv, int64_t tile_bytes,
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

// y[m, n] = ((a1 - 128 c[n]) s1[m] + (a2 - 128 c[n]) s2[m]) w[n] for 16 channels (q8_int_gemm's epilogue)
LLMSERVE_VNNI void vnni_epilogue(const int32_t* acc, int64_t ld, int64_t M, int64_t L, const float* sx,
                                 const int32_t* csum, const float* ws, int64_t channels, float* out, int64_t N) {
  for (int64_t c = 0; c < channels; c += 16) {
    const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512(csum + c), 7);
    const __m512 w = _mm512_loadu_ps(ws + c);
    for (int64_t m = 0; m < M; ++m) {
      const __m512 a1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(acc + m * ld + c), off));
      __m512 y = _mm512_mul_ps(a1, _mm512_set1_ps(sx[m]));
      if (L == 2) {
        const __m512 a2 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(acc + (M + m) * ld + c), off));
        y = _mm512_fmadd_ps(a2, _mm512_set1_ps(sx[M + m]), y);
      }
      _mm512_storeu_ps(out + m * N + c, _mm512_mul_ps(y, w));
    }
  }
}

at::Tensor q8_vnni_gemm(const at::Tensor& x_in, const at::Tensor& wv, const at::Tensor& csum, const at::Tensor& scale,
                        int64_t act_bits) {
  check_cpu_f32(x_in, "q8_vnni_gemm");
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(uses_vnni(), "q8_vnni_gemm: needs AVX-512 VNNI");
  TORCH_CHECK(wv.dim() == 4 && wv.size(2) == 16 && wv.size(3) == 4 && wv.scalar_type() == at::kChar &&
              wv.is_contiguous(), "q8_vnni_gemm: weights [N / 16, K / 4, 16, 4] int8");
  const int64_t M = x.size(0), K = x.size(1), N = wv.size(0) * 16, L = act_bits > 8 ? 2 : 1;
  TORCH_CHECK(x.dim() == 2 && wv.size(1) * 4 == K && K % 8 == 0, "q8_vnni_gemm: shape mismatch");
  TORCH_CHECK(csum.numel() == N && csum.scalar_type() == at::kInt && scale.numel() == N &&
              scale.scalar_type() == at::kFloat && scale.is_contiguous() && csum.is_contiguous(),
              "q8_vnni_gemm: a sum (int32) and a scale (float32) per channel");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  std::vector<uint8_t> xq(L * M * K);
  std::vector<float> sx(L * M);
  round_rows(x.data_ptr<float>(), M, K, L, M, true, xq.data(), sx.data());
  const int8_t* w = wv.data_ptr<int8_t>();
  const int32_t* cs = csum.data_ptr<int32_t>();
  const float* ws = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t tile_bytes = K * 16, blocks = (N + 63) / 64;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int32_t> acc(L * M * 64);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t tiles = std::min<int64_t>(4, N / 16 - 4 * b);
      const int8_t* wb = w + 4 * b * tile_bytes;
      switch (tiles) {
        case 4: vnni_rows<4>(xq.data(), L * M, K, wb, tile_bytes, acc.data(), 64); break;
        case 3: vnni_rows<3>(xq.data(), L * M, K, wb, tile_bytes, acc.data(), 64); break;
        case 2: vnni_rows<2>(xq.data(), L * M, K, wb, tile_bytes, acc.data(), 64); break;
        default: vnni_rows<1>(xq.data(), L * M, K, wb, tile_bytes, acc.data(), 64); break;
      }
      vnni_epilogue(acc.data(), 64, M, L, sx.data(), cs + 64 * b, ws + 64 * b, 16 * tiles, op + 64 * b, N);
    }
  });
  return out;
}

// int4 weights (Q4_1's blocks: 32 values 0..15 with a float16 scale d and min m each, the plain [N, K / 2] layout
// q4_linear reads) times many rows on AVX-512 VNNI, the activations rounded per 32-value block to int8 as the
// dots round them (quantize_rows: x ~ dx q, with the block's float sum): a block's dot is
// d dx (sum of w q, integer) + m (sum of x), as llama.cpp's Q4_1 x Q8_1. The nibbles are unsigned, the rounded
// activations signed: vpdpbusd takes them as they are. A task is 64 channels and up to 256 rows: it widens its
// channels' nibbles once to bytes in the instruction's layout ([K / 4][64 channels][4], 64 x K bytes, in L2)
// and its scales and mins to float32, then runs 4 rows x 32 channels at a time: 8 int32 sums per block, turned
// into float32 sums after each block.
template <int R>
LLMSERVE_VNNI void q4v_rows(const int8_t* xq, const float* dx, const float* xs, int64_t K, const uint8_t* wu,
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
LLMSERVE_VNNI void q4v_widen(const uint8_t* qw, const at::Half* sc, const at::Half* mi, int64_t K, int64_t n0,
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

// y = x @ W.T for int4 W (q4_linear's arguments) on VNNI; N % 64 == 0, K % 32 == 0 (q4_linear checks)
at::Tensor q4_vnni_gemm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale, const at::Tensor& minv) {
  const int64_t M = x.size(0), N = qw.size(0), K = x.size(1), G = K / 32;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  Rows<int8_t> r(x);
  const uint8_t* q = qw.data_ptr<uint8_t>();
  const at::Half *s = scale.data_ptr<at::Half>(), *mi = minv.data_ptr<at::Half>();
  float* op = out.data_ptr<float>();
  constexpr int64_t kRows = 256;   // rows a task: its channels' widened weights serve them all
  const int64_t blocks = N / 64, chunks = (M + kRows - 1) / kRows;
  at::parallel_for(0, blocks * chunks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> wu(64 * K);
    std::vector<float> d(64 * G), mn(64 * G);
    int64_t widened = -1;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / chunks, m0 = t % chunks * kRows, m1 = std::min(M, m0 + kRows);
      if (b != widened) q4v_widen(q, s, mi, K, 64 * b, wu.data(), d.data(), mn.data());
      widened = b;
      for (int64_t half = 0; half < 2; ++half) {
        int64_t m = m0;
        const auto run = [&](auto rows) {
          constexpr int R = decltype(rows)::value;
          q4v_rows<R>(r.q.data() + m * K, r.dx.data() + m * G, r.sum.data() + m * G, K, wu.data(), d.data(),
                      mn.data(), half, op + m * N + 64 * b + 32 * half, N);
        };
        for (; m + 4 <= m1; m += 4) run(std::integral_constant<int, 4>{});
        switch (m1 - m) {
          case 1: run(std::integral_constant<int, 1>{}); break;
          case 2: run(std::integral_constant<int, 2>{}); break;
          case 3: run(std::integral_constant<int, 3>{}); break;
          default: break;
        }
      }
    }
  });
  return out;
}

at::Tensor q8_linear(const at::Tensor& x_in, const at::Tensor& qw, const at::Tensor& scale, int64_t many_rows,
                     int64_t act_bits) {
  check_cpu_f32(x_in, "q8_linear");
  const at::Tensor x = x_in.contiguous();
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
  if (M >= many_rows && group == K && q8_int_gemm_on) return q8_int_gemm(x, qw, scale, act_bits);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M >= many_rows)
    tiled_matmul(x, N, [&](int64_t n, float* w) { q8_dequant_row(q + n * K, s + n * (K / group), K, group, w); }, out);
  else if (act_bits == 8)
    q8_rows<int8_t>(x, q, s, N, group, out);
  else
    q8_rows<int16_t>(x, q, s, N, group, out);
  return out;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: y = w * x / sqrt(mean(x^2) + eps), rows of D values (D a multiple of 8).

inline void rms_row(const float* x, const float* w, float eps, int64_t D, float* y) {
  __m256 ss = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    ss = _mm256_fmadd_ps(v, v, ss);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(hsum(ss) / D + eps));
  for (int64_t i = 0; i < D; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), inv)));
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w, double eps) {
  check_cpu_f32(x_in, "rms_norm");
  const at::Tensor x = x_in.contiguous();
  const int64_t D = x.size(-1), T = x.numel() / D;
  TORCH_CHECK(D % 8 == 0 && w.numel() == D, "rms_norm: shape");
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) rms_row(xp + t * D, wp, (float)eps, D, yp + t * D);
  });
  return y;
}

// residual += x; x = rms_norm(residual) * w. Both [T, D] contiguous, updated in place.
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  check_cpu_f32(x, "add_rms_norm");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes(), "add_rms_norm: shape");
  const int64_t D = x.size(-1), T = x.numel() / D;
  TORCH_CHECK(D % 8 == 0 && w.numel() == D, "add_rms_norm: shape");
  float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float *xr = xp + t * D, *rr = rp + t * D;
      for (int64_t i = 0; i < D; i += 8)
        _mm256_storeu_ps(rr + i, _mm256_add_ps(_mm256_loadu_ps(rr + i), _mm256_loadu_ps(xr + i)));
      rms_row(rr, wp, (float)eps, D, xr);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Rotary (neox halves) in place on heads [0, H + Hkv) of each row of qkv [T, (H + 2 Hkv) D], then
// the row's K and V heads copied into the paged cache at slot_mapping[t] (caches
// [num_blocks, block, Hkv, D]). cos/sin: [max_positions, D] tables (first half equal to the second).
void rotary_write_kv_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                      int64_t num_heads, int64_t num_kv_heads, int64_t D, at::Tensor& k_cache, at::Tensor& v_cache,
                      const at::Tensor& slot_mapping) {
  check_cpu_f32(qkv, "rotary");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && cos.is_contiguous() && sin.is_contiguous() &&
              qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "rotary: layout");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong && D % 16 == 0 &&
              positions.numel() == qkv.size(0) && slot_mapping.numel() == qkv.size(0), "rotary: int64 positions, slots");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(2) == num_kv_heads &&
              k_cache.size(3) == D && v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
              (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf), "rotary: cache layout");
  const int64_t T = qkv.size(0), ld = qkv.stride(0), half = D / 2, P = cos.size(0);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), kv = num_kv_heads * D;
  float* p = qkv.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P && slots[t] >= 0 && slots[t] < num_slots, "rotary: position or slot out of range");
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const bool half_cache = k_cache.scalar_type() == at::kHalf;
  at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cp + pos[t] * D;
      const float* s = sp + pos[t] * D;
      float* row = p + t * ld;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        float* v = row + h * D;
        for (int64_t i = 0; i < half; i += 8) {
          const __m256 x1 = _mm256_loadu_ps(v + i), x2 = _mm256_loadu_ps(v + i + half);
          const __m256 o1 = _mm256_sub_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + i)), _mm256_mul_ps(x2, _mm256_loadu_ps(s + i)));
          const __m256 o2 = _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + i + half)), _mm256_mul_ps(x1, _mm256_loadu_ps(s + i + half)));
          _mm256_storeu_ps(v + i, o1);
          _mm256_storeu_ps(v + i + half, o2);
        }
      }
      const float* knew = row + num_heads * D;
      if (half_cache) {
        store_kv(knew, kv, k_cache.data_ptr<at::Half>() + slots[t] * kv);
        store_kv(knew + kv, kv, v_cache.data_ptr<at::Half>() + slots[t] * kv);
      } else {
        store_kv(knew, kv, k_cache.data_ptr<float>() + slots[t] * kv);
        store_kv(knew + kv, kv, v_cache.data_ptr<float>() + slots[t] * kv);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// [T, 2I] -> [T, I]: silu(gate) * up.
at::Tensor silu_and_mul(const at::Tensor& gu_in) {
  check_cpu_f32(gu_in, "silu_and_mul");
  const at::Tensor gu = gu_in.contiguous();
  const int64_t I = gu.size(-1) / 2, T = gu.numel() / (2 * I);
  TORCH_CHECK(I % 8 == 0, "silu_and_mul: size");
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, gu.options());
  const float* g = gu.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  at::parallel_for(0, T, 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t i = 0; i < I; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + t * 2 * I + i);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, x))));
        _mm256_storeu_ps(o + t * I + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(g + t * 2 * I + I + i)));
      }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Decode attention over the paged cache, in place: out[b, h] = softmax(q[b, h] . K_b * scale) V_b,
// K_b / V_b the first context_lens[b] positions of request b, read from the blocks of its table.
// q, out: [B, H, D] (rows may be strided, heads contiguous); caches [num_blocks, block, Hkv, D].
// One task per (request, KV head): the positions' offsets into the cache are worked out once (block
// by block), the group's query heads (G = H / Hkv) score each key while it is in L1, then for each head
// the softmax and the weighted sum of values with the D/8 accumulators in registers.
// The key and value rows 16 positions ahead are prefetched while 8 keys are scored: the blocks lie anywhere, so
// the hardware's prefetchers lose the stream at every block; 30 layers x 64 rows x 320 positions of a float32
// cache (SmolLM2's 3 KV heads) 64 -> 47 ms a step, float16 59 -> 35 ms (from DRAM: ~1 GB a step).

template <int D, typename C>
void attend_group(const float* q0, int64_t G, const C* kp, const C* vp, const int64_t* off, int64_t len,
                  float sc, float* scores, float* o0) {
  constexpr int R = D / 8;
  const __m256 scv = _mm256_set1_ps(sc);
  int64_t j0 = 0;
  constexpr int64_t kAhead = 16;   // positions: their key and value rows are fetched while these 8 are scored
  constexpr int64_t kLine = 64 / sizeof(C);
  for (; j0 + 8 <= len; j0 += 8) {   // 8 keys at a time: their 8 dot products summed across lanes together
    const C* kr[8];
    for (int i = 0; i < 8; ++i) kr[i] = kp + off[j0 + i];
    for (int64_t i = j0 + kAhead; i < std::min(len, j0 + kAhead + 8); ++i)
      for (int64_t c = 0; c < D; c += kLine) {
        _mm_prefetch(reinterpret_cast<const char*>(kp + off[i] + c), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vp + off[i] + c), _MM_HINT_T1);
      }
    for (int64_t g = 0; g < G; ++g) {
      const float* qh = q0 + g * D;
      __m256 a[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_loadu_ps(qh + 8 * r);
        for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, load8(kr[i] + 8 * r), a[i]);
      }
      _mm256_storeu_ps(scores + g * len + j0, _mm256_mul_ps(hsum8(a), scv));
    }
  }
  for (int64_t j = j0; j < len; ++j) {
    const C* k = kp + off[j];
    for (int64_t g = 0; g < G; ++g) {
      const float* qh = q0 + g * D;
      __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(qh), load8(k));
      __m256 s1 = _mm256_mul_ps(_mm256_loadu_ps(qh + 8), load8(k + 8));
      for (int r = 2; r < R; r += 2) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * r), load8(k + 8 * r), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * r + 8), load8(k + 8 * r + 8), s1);
      }
      scores[g * len + j] = hsum(_mm256_add_ps(s0, s1)) * sc;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * len;
    float mx = -INFINITY;
    for (int64_t j = 0; j < len; ++j) mx = std::max(mx, sg[j]);
    const __m256 mxv = _mm256_set1_ps(mx);
    __m256 sum8 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) {
      const __m256 ev = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), mxv));
      _mm256_storeu_ps(sg + j, ev);
      sum8 = _mm256_add_ps(sum8, ev);
    }
    float sum = hsum(sum8);
    for (; j < len; ++j) {
      sg[j] = std::exp(sg[j] - mx);
      sum += sg[j];
    }
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (j = 0; j < len; ++j) {
      const C* v = vp + off[j];
      const __m256 p = _mm256_set1_ps(sg[j]);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(p, load8(v + 8 * r), acc[r]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(o0 + g * D + 8 * r, _mm256_mul_ps(acc[r], inv));
  }
}

void paged_decode_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, double scale) {
  check_cpu_f32(q, "paged_decode_attention");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous() &&
              context_lens.is_contiguous(), "paged_decode_attention: contiguous caches and tables");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: int64 tables");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
              (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf),
              "paged_decode_attention: float32 or float16 caches of one shape");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), maxb = block_tables.size(1);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && out.stride(2) == 1 && out.stride(1) == D &&
              (D == 64 || D == 128) && H % Hkv == 0 && k_cache.size(3) == D, "paged_decode_attention: layout");
  const int64_t G = H / Hkv, qld = q.stride(0), old = out.stride(0), num_blocks = k_cache.size(0);
  const float* qp = q.data_ptr<float>();
  const bool half_cache = k_cache.scalar_type() == at::kHalf;
  float* op = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= maxb * bs, "paged_decode_attention: context length");
    for (int64_t i = 0; i < (lens[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(tables[b * maxb + i] >= 0 && tables[b * maxb + i] < num_blocks, "paged_decode_attention: block id");
  }
  const float sc = (float)scale;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t b0, int64_t e0) {
    std::vector<float> scores;
    std::vector<int64_t> off;
    for (int64_t task = b0; task < e0; ++task) {
      const int64_t b = task / Hkv, kvh = task % Hkv, len = lens[b];
      scores.resize(G * len);
      off.resize(len);
      const int64_t* table = tables + b * maxb;
      for (int64_t j0 = 0, blk = 0; j0 < len; j0 += bs, ++blk) {   // the cache offset of each position
        const int64_t base = (table[blk] * bs * Hkv + kvh) * D;
        for (int64_t i = 0; i < std::min(bs, len - j0); ++i) off[j0 + i] = base + i * Hkv * D;
      }
      const float* q0 = qp + b * qld + kvh * G * D;
      float* o0 = op + b * old + kvh * G * D;
      auto attend = [&](auto* kp, auto* vp) {
        if (D == 64) attend_group<64>(q0, G, kp, vp, off.data(), len, sc, scores.data(), o0);
        else attend_group<128>(q0, G, kp, vp, off.data(), len, sc, scores.data(), o0);
      };
      if (half_cache) attend(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>());
      else attend(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Prefill attention over the paged cache, in place: the n queries of one chunk (positions ctx - n .. ctx - 1)
// against keys 0 .. each query's own position, read from the request's blocks (the chunk's own K and V are
// already written there: a fresh prompt and a chunk after a cached prefix take the same path). Flash-style,
// no [n, ctx] score matrix. A task is (KV head, tile of kPrefillQ query positions): its G = H / Hkv query
// heads make M = kPrefillQ * G rows that share every key and value read. The rows lie in vector lanes
// (Q, the scores and the output are kept transposed: [D or keys][rows]), so every product is an outer
// product of a broadcast key (value) element with row vectors, and the online softmax (a running max and
// sum per row; the output rescaled when the max moves) needs no horizontal sums. Per tile of kPrefillK
// keys: S^T = K Q^T, P = exp(S - max), O^T = alpha O^T + V^T P^T, register-blocked (keys x row vectors,
// columns x row vectors). float32 keys are read straight from the blocks, float16 ones widened per tile.
// Key tiles past a task's last query are skipped; on the diagonal a row's later keys get probability 0.

constexpr int kPrefillK = 32;   // keys per tile
constexpr int kPrefillQ = 16;   // query positions per task

// The vector parts, AVX2 + FMA (8 rows a register). Qt, Ot: [D][Mp]; St (scores, then P): [32][Mp];
// kr[j], vr[j]: key j's K and V rows (D floats); Mp: rows, a multiple of 16.
struct PrefillAvx2 {
  template <int RV>   // 4 keys x RV row vectors
  static void qk_block(const float* Qt, int64_t Mp, int64_t D, const float* const* kr, float* St) {
    for (int j0 = 0; j0 < kPrefillK; j0 += 4) {
      __m256 acc[4][RV];
      for (int j = 0; j < 4; ++j)
        for (int r = 0; r < RV; ++r) acc[j][r] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        __m256 q[RV];
        for (int r = 0; r < RV; ++r) q[r] = _mm256_loadu_ps(Qt + d * Mp + 8 * r);
        for (int j = 0; j < 4; ++j) {
          const __m256 k = _mm256_broadcast_ss(kr[j0 + j] + d);
          for (int r = 0; r < RV; ++r) acc[j][r] = _mm256_fmadd_ps(k, q[r], acc[j][r]);
        }
      }
      for (int j = 0; j < 4; ++j)
        for (int r = 0; r < RV; ++r) _mm256_storeu_ps(St + (j0 + j) * Mp + 8 * r, acc[j][r]);
    }
  }

  static void qk(const float* Qt, int64_t Mp, int64_t D, const float* const* kr, float* St) {
    for (int64_t v = 0; v < Mp; v += 16) qk_block<2>(Qt + v, Mp, D, kr, St + v);
  }

  // Rows [v, v + 8) of the tile: masked (keys past a row's position: probability 0) when `diag`.
  static void softmax(float* St, int64_t Mp, const int32_t* pos, int64_t k0, bool diag, float* mx, float* l,
                      float* alpha) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t v = 0; v < Mp; v += 8) {
      const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pos + v));
      auto valid = [&](int j) {   // key k0 + j <= the row's position
        return _mm256_castsi256_ps(_mm256_cmpgt_epi32(p, _mm256_set1_epi32((int32_t)(k0 + j) - 1)));
      };
      __m256 vmax = ninf;
      for (int j = 0; j < kPrefillK; ++j) {
        const __m256 s = _mm256_loadu_ps(St + j * Mp + v);
        vmax = _mm256_max_ps(vmax, diag ? _mm256_blendv_ps(ninf, s, valid(j)) : s);
      }
      const __m256 m_old = _mm256_loadu_ps(mx + v), m_new = _mm256_max_ps(m_old, vmax);
      // alpha = exp(m_old - m_new), 0 where nothing was seen yet (and no NaN from -inf - -inf)
      const __m256 seen = _mm256_cmp_ps(m_old, ninf, _CMP_NEQ_OQ);
      const __m256 a = _mm256_and_ps(exp8(_mm256_sub_ps(m_old, m_new)), seen);
      __m256 sum = _mm256_setzero_ps();
      for (int j = 0; j < kPrefillK; ++j) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(St + j * Mp + v), m_new));
        if (diag) e = _mm256_and_ps(e, valid(j));
        _mm256_storeu_ps(St + j * Mp + v, e);
        sum = _mm256_add_ps(sum, e);
      }
      _mm256_storeu_ps(l + v, _mm256_fmadd_ps(_mm256_loadu_ps(l + v), a, sum));
      _mm256_storeu_ps(mx + v, m_new);
      _mm256_storeu_ps(alpha + v, a);
    }
  }

  template <int RV>   // 4 columns x RV row vectors
  static void pv_block(const float* Pt, int64_t Mp, int64_t D, const float* const* vr, const float* alpha, float* Ot) {
    for (int64_t c0 = 0; c0 < D; c0 += 4) {
      __m256 acc[4][RV];
      for (int c = 0; c < 4; ++c)
        for (int r = 0; r < RV; ++r)
          acc[c][r] = _mm256_mul_ps(_mm256_loadu_ps(alpha + 8 * r), _mm256_loadu_ps(Ot + (c0 + c) * Mp + 8 * r));
      for (int j = 0; j < kPrefillK; ++j) {
        __m256 p[RV];
        for (int r = 0; r < RV; ++r) p[r] = _mm256_loadu_ps(Pt + j * Mp + 8 * r);
        for (int c = 0; c < 4; ++c) {
          const __m256 x = _mm256_broadcast_ss(vr[j] + c0 + c);
          for (int r = 0; r < RV; ++r) acc[c][r] = _mm256_fmadd_ps(x, p[r], acc[c][r]);
        }
      }
      for (int c = 0; c < 4; ++c)
        for (int r = 0; r < RV; ++r) _mm256_storeu_ps(Ot + (c0 + c) * Mp + 8 * r, acc[c][r]);
    }
  }

  static void pv(const float* Pt, int64_t Mp, int64_t D, const float* const* vr, const float* alpha, float* Ot) {
    for (int64_t v = 0; v < Mp; v += 16) pv_block<2>(Pt + v, Mp, D, vr, alpha + v, Ot + v);
  }
};

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

// The same with AVX-512 (use_avx512()): 16 rows a register, blocks of 8 keys (8 columns) x up to 3 row vectors.
struct PrefillAvx512 {
  template <int RV>
  LLMSERVE_AVX512 static void qk_block(const float* Qt, int64_t Mp, int64_t D, const float* const* kr, float* St) {
    for (int j0 = 0; j0 < kPrefillK; j0 += 8) {
      __m512 acc[8][RV];
      for (int j = 0; j < 8; ++j)
        for (int r = 0; r < RV; ++r) acc[j][r] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        __m512 q[RV];
        for (int r = 0; r < RV; ++r) q[r] = _mm512_loadu_ps(Qt + d * Mp + 16 * r);
        for (int j = 0; j < 8; ++j) {
          const __m512 k = _mm512_set1_ps(kr[j0 + j][d]);
          for (int r = 0; r < RV; ++r) acc[j][r] = _mm512_fmadd_ps(k, q[r], acc[j][r]);
        }
      }
      for (int j = 0; j < 8; ++j)
        for (int r = 0; r < RV; ++r) _mm512_storeu_ps(St + (j0 + j) * Mp + 16 * r, acc[j][r]);
    }
  }

  LLMSERVE_AVX512 static void qk(const float* Qt, int64_t Mp, int64_t D, const float* const* kr, float* St) {
    int64_t v = 0;
    for (; v + 48 <= Mp; v += 48) qk_block<3>(Qt + v, Mp, D, kr, St + v);
    if (Mp - v == 32) qk_block<2>(Qt + v, Mp, D, kr, St + v);
    else if (Mp - v == 16) qk_block<1>(Qt + v, Mp, D, kr, St + v);
  }

  LLMSERVE_AVX512 static void softmax(float* St, int64_t Mp, const int32_t* pos, int64_t k0, bool diag, float* mx,
                                      float* l, float* alpha) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t v = 0; v < Mp; v += 16) {
      const __m512i p = _mm512_loadu_si512(pos + v);
      __mmask16 valid[kPrefillK];   // key k0 + j <= the row's position
      for (int j = 0; j < kPrefillK; ++j)
        valid[j] = diag ? _mm512_cmpge_epi32_mask(p, _mm512_set1_epi32((int32_t)(k0 + j))) : (__mmask16)0xFFFF;
      __m512 vmax = ninf;
      for (int j = 0; j < kPrefillK; ++j)
        vmax = _mm512_mask_max_ps(vmax, valid[j], vmax, _mm512_loadu_ps(St + j * Mp + v));
      const __m512 m_old = _mm512_loadu_ps(mx + v), m_new = _mm512_max_ps(m_old, vmax);
      const __mmask16 seen = _mm512_cmp_ps_mask(m_old, ninf, _CMP_NEQ_OQ);
      const __m512 a = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(m_old, m_new)));
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < kPrefillK; ++j) {
        const __m512 e = _mm512_maskz_mov_ps(valid[j], exp16(_mm512_sub_ps(_mm512_loadu_ps(St + j * Mp + v), m_new)));
        _mm512_storeu_ps(St + j * Mp + v, e);
        sum = _mm512_add_ps(sum, e);
      }
      _mm512_storeu_ps(l + v, _mm512_fmadd_ps(_mm512_loadu_ps(l + v), a, sum));
      _mm512_storeu_ps(mx + v, m_new);
      _mm512_storeu_ps(alpha + v, a);
    }
  }

  template <int RV>
  LLMSERVE_AVX512 static void pv_block(const float* Pt, int64_t Mp, int64_t D, const float* const* vr,
                                       const float* alpha, float* Ot) {
    for (int64_t c0 = 0; c0 < D; c0 += 8) {
      __m512 acc[8][RV];
      for (int c = 0; c < 8; ++c)
        for (int r = 0; r < RV; ++r)
          acc[c][r] = _mm512_mul_ps(_mm512_loadu_ps(alpha + 16 * r), _mm512_loadu_ps(Ot + (c0 + c) * Mp + 16 * r));
      for (int j = 0; j < kPrefillK; ++j) {
        __m512 p[RV];
        for (int r = 0; r < RV; ++r) p[r] = _mm512_loadu_ps(Pt + j * Mp + 16 * r);
        for (int c = 0; c < 8; ++c) {
          const __m512 x = _mm512_set1_ps(vr[j][c0 + c]);
          for (int r = 0; r < RV; ++r) acc[c][r] = _mm512_fmadd_ps(x, p[r], acc[c][r]);
        }
      }
      for (int c = 0; c < 8; ++c)
        for (int r = 0; r < RV; ++r) _mm512_storeu_ps(Ot + (c0 + c) * Mp + 16 * r, acc[c][r]);
    }
  }

  LLMSERVE_AVX512 static void pv(const float* Pt, int64_t Mp, int64_t D, const float* const* vr, const float* alpha,
                                 float* Ot) {
    int64_t v = 0;
    for (; v + 48 <= Mp; v += 48) pv_block<3>(Pt + v, Mp, D, vr, alpha + v, Ot + v);
    if (Mp - v == 32) pv_block<2>(Pt + v, Mp, D, vr, alpha + v, Ot + v);
    else if (Mp - v == 16) pv_block<1>(Pt + v, Mp, D, vr, alpha + v, Ot + v);
  }
};

struct PrefillScratch {   // one thread's: Mp rows (a multiple of 16) of head size D
  std::vector<float> qt, ot, st, mx, l, alpha, kw, vw, zero;
  std::vector<int32_t> pos;
  std::vector<const float*> kr, vr;
  PrefillScratch(int64_t Mp, int64_t D)
      : qt(D * Mp), ot(D * Mp), st(kPrefillK * Mp), mx(Mp), l(Mp), alpha(Mp), kw(kPrefillK * D), vw(kPrefillK * D),
        zero(D), pos(Mp), kr(kPrefillK), vr(kPrefillK) {}
};

// One task: KV head kvh, the chunk's queries [i0, i1) (query i at position ctx - n + i; its G heads are
// rows (i - i0) * G + g). q / out rows: qld / old apart, heads D apart. Caches [blocks, bs, Hkv, D].
template <typename Kern, typename C>
void prefill_task(const float* qp, int64_t qld, float* op, int64_t old, const C* kc, const C* vc,
                  const int64_t* table, int64_t bs, int64_t Hkv, int64_t D, int64_t kvh, int64_t G, int64_t ctx,
                  int64_t n, int64_t i0, int64_t i1, float scale, PrefillScratch& w) {
  const int64_t M = (i1 - i0) * G, Mp = (M + 15) / 16 * 16, first = ctx - n;
  float *Qt = w.qt.data(), *Ot = w.ot.data(), *St = w.st.data();
  for (int64_t m = 0; m < Mp; ++m) {   // Q^T scaled; padding rows: zeros, position -1 (they see no key)
    const int64_t i = i0 + m / G, g = m % G;
    const float* src = m < M ? qp + i * qld + (kvh * G + g) * D : w.zero.data();
    for (int64_t d = 0; d < D; ++d) Qt[d * Mp + m] = src[d] * scale;
    w.pos[m] = m < M ? (int32_t)(first + i) : -1;
  }
  std::fill(Ot, Ot + D * Mp, 0.0f);
  std::fill(w.mx.begin(), w.mx.begin() + Mp, -INFINITY);
  std::fill(w.l.begin(), w.l.begin() + Mp, 0.0f);
  const int64_t last = first + i1 - 1;   // the task's last query position: later keys are never read
  for (int64_t k0 = 0; k0 <= last; k0 += kPrefillK) {
    const int64_t kn = std::min<int64_t>(kPrefillK, last + 1 - k0);
    for (int64_t j = 0; j < kPrefillK; ++j) {
      if (j >= kn) {   // past the last query: a row of zeros (finite products, probability 0)
        w.kr[j] = w.vr[j] = w.zero.data();
        continue;
      }
      const int64_t pos = k0 + j, off = ((table[pos / bs] * bs + pos % bs) * Hkv + kvh) * D;
      if constexpr (std::is_same_v<C, float>) {
        w.kr[j] = kc + off;
        w.vr[j] = vc + off;
      } else {   // widened once per tile
        float *kd = w.kw.data() + j * D, *vd = w.vw.data() + j * D;
        for (int64_t d = 0; d < D; d += 8) {
          _mm256_storeu_ps(kd + d, load8(kc + off + d));
          _mm256_storeu_ps(vd + d, load8(vc + off + d));
        }
        w.kr[j] = kd;
        w.vr[j] = vd;
      }
    }
    Kern::qk(Qt, Mp, D, w.kr.data(), St);
    Kern::softmax(St, Mp, w.pos.data(), k0, k0 + kPrefillK - 1 > first + i0, w.mx.data(), w.l.data(), w.alpha.data());
    Kern::pv(St, Mp, D, w.vr.data(), w.alpha.data(), Ot);
  }
  for (int64_t m = 0; m < M; ++m) {
    const int64_t i = i0 + m / G, g = m % G;
    const float inv = 1.0f / w.l[m];
    float* dst = op + i * old + (kvh * G + g) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = Ot[d * Mp + m] * inv;
  }
}

// out [n, H, D] = attention of q [n, H, D] (one prefill chunk: positions ctx - n .. ctx - 1, causal) over
// the first ctx positions of the request whose blocks block_table [>= ceil(ctx / bs)] names. Rows of q and
// out may be strided (heads contiguous). Tasks (query tile, KV head) are ordered first, last, second,
// second-to-last ... tile, so that at::parallel_for's contiguous split gives every thread as many keys.
void paged_prefill_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_table, int64_t context_len,
                              double scale) {
  check_cpu_f32(q, "paged_prefill_attention");
  check_cpu_f32(out, "paged_prefill_attention");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_table.is_contiguous() &&
              block_table.dim() == 1 && block_table.scalar_type() == at::kLong,
              "paged_prefill_attention: contiguous caches, an int64 block table");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
              (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf) && k_cache.dim() == 4,
              "paged_prefill_attention: float32 or float16 caches of one shape");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "paged_prefill_attention: q and out [n, H, D]");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), ctx = context_len;
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), num_blocks = k_cache.size(0);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && out.stride(2) == 1 && out.stride(1) == D &&
              (D == 64 || D == 128) && H % Hkv == 0 && k_cache.size(3) == D, "paged_prefill_attention: layout");
  TORCH_CHECK(n <= ctx && ctx < (1LL << 31) && (ctx + bs - 1) / bs <= block_table.numel(),
              "paged_prefill_attention: context length");
  if (n == 0) return;
  const int64_t* table = block_table.data_ptr<int64_t>();
  for (int64_t i = 0; i < (ctx + bs - 1) / bs; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "paged_prefill_attention: block id");
  const int64_t G = H / Hkv, qld = q.stride(0), old = out.stride(0), tiles = (n + kPrefillQ - 1) / kPrefillQ;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = (float)scale;
  const bool half_cache = k_cache.scalar_type() == at::kHalf, wide = use_avx512();
  at::parallel_for(0, tiles * Hkv, 1, [&](int64_t t0, int64_t t1) {
    PrefillScratch w((kPrefillQ * G + 15) / 16 * 16, D);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t u = t / Hkv, kvh = t % Hkv;
      const int64_t tile = u % 2 == 0 ? u / 2 : tiles - 1 - u / 2;
      const int64_t i0 = tile * kPrefillQ, i1 = std::min(n, i0 + kPrefillQ);
      auto run = [&](auto kern, const auto* kc, const auto* vc) {
        prefill_task<decltype(kern)>(qp, qld, op, old, kc, vc, table, bs, Hkv, D, kvh, G, ctx, n, i0, i1, sc, w);
      };
      if (half_cache) {
        const at::Half *kc = k_cache.data_ptr<at::Half>(), *vc = v_cache.data_ptr<at::Half>();
        if (wide) run(PrefillAvx512{}, kc, vc);
        else run(PrefillAvx2{}, kc, vc);
      } else {
        const float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
        if (wide) run(PrefillAvx512{}, kc, vc);
        else run(PrefillAvx2{}, kc, vc);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// One decoder layer for a batch of decode rows (each row one request's next token), in one call:
// the Python around ~12 kernel calls per layer costs as much as the kernels on a single stream.
// weights: [input_norm, post_norm, then per projection (qkv, o, gate_up, down) its tensors];
// kinds[i] for each projection: 0 float32 (weight: plain, or packed in oneDNN's layout), 1 float32 with a
// packed copy (plain weight, packed weight), 2 bfloat16 packed for oneDNN (llmserve/model/bf16.py), 4 int4 (q, scale, min), 8 int8 (q, scale), 9 int8 in the VNNI layout
// (q, channel sums, scale).
// act_bits[i]: int8's activation width. many_rows[i]: the rows from which projection i leaves its
// few-rows kernel for the many-rows path (float32: at::linear, i.e. MKL/oneDNN's GEMM; the crossover is
// measured per weight shape, llmserve/model/ops.py). Returns (layer output, running residual sum);
// `residual` undefined means x is the embeddings (the first layer).
// ---------------------------------------------------------------------------------------------
// LoRA adapters inside the fused decode stack (llmserve/model/lora.py). One adapter's weights, built once
// per adapter load: per layer and projection (qkv, o, gate_up, down) At [K, P*r] (the P packed parts' A,
// transposed, side by side; zeros for a part the adapter lacks) and Bt [r, N] (column n: B of the part
// that column belongs to, scaling folded in), or empty tensors where the adapter has no update of it.
struct LoRAWeights {
  std::vector<at::Tensor> w;   // 2 per projection, 4 projections per layer
  explicit LoRAWeights(std::vector<at::Tensor> w) : w(std::move(w)) {
    TORCH_CHECK(this->w.size() % 8 == 0, "LoRAWeights: (At, Bt) for 4 projections per layer");
    for (const auto& t : this->w)
      TORCH_CHECK(!t.numel() || (t.dtype() == at::kFloat && t.device().is_cpu() && t.is_contiguous() && t.dim() == 2),
                  "LoRAWeights: float32 contiguous CPU matrices");
  }
};

// A step's adapter rows: adapter j's rows (grouped: one group per adapter, the punica / S-LoRA scheme).
struct LoRAStep {
  std::vector<std::shared_ptr<LoRAWeights>> adapters;
  std::vector<std::vector<int64_t>> rows;
};

// u[t, j0 .. j0 + 8 JV) = x_t @ At[:, those columns] for TB rows x_t: At's columns read once for all TB rows.
template <int TB, int JV>
inline void lora_shrink_block(const float* const* xr, int64_t K, const float* At, int64_t R, int64_t j0, float* u) {
  __m256 acc[TB][JV];
  for (int t = 0; t < TB; ++t)
    for (int v = 0; v < JV; ++v) acc[t][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 w[JV];
    for (int v = 0; v < JV; ++v) w[v] = _mm256_loadu_ps(At + k * R + j0 + 8 * v);
    for (int t = 0; t < TB; ++t) {
      const __m256 xb = _mm256_broadcast_ss(xr[t] + k);
      for (int v = 0; v < JV; ++v) acc[t][v] = _mm256_fmadd_ps(xb, w[v], acc[t][v]);
    }
  }
  for (int t = 0; t < TB; ++t)
    for (int v = 0; v < JV; ++v) _mm256_storeu_ps(u + t * R + j0 + 8 * v, acc[t][v]);
}

// out_t[n0 .. n0 + 8 NV) += u_t[0 .. r) @ Bt[:, those columns] for TB rows: Bt's columns read once for all rows.
template <int TB, int NV>
inline void lora_expand_block(const float* const* ur, int64_t r, const float* Bt, int64_t N, int64_t n0, float* const* o) {
  __m256 acc[TB][NV];
  for (int t = 0; t < TB; ++t)
    for (int v = 0; v < NV; ++v) acc[t][v] = _mm256_loadu_ps(o[t] + n0 + 8 * v);
  for (int64_t j = 0; j < r; ++j) {
    __m256 w[NV];
    for (int v = 0; v < NV; ++v) w[v] = _mm256_loadu_ps(Bt + j * N + n0 + 8 * v);
    for (int t = 0; t < TB; ++t) {
      const __m256 ub = _mm256_broadcast_ss(ur[t] + j);
      for (int v = 0; v < NV; ++v) acc[t][v] = _mm256_fmadd_ps(ub, w[v], acc[t][v]);
    }
  }
  for (int t = 0; t < TB; ++t)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(o[t] + n0 + 8 * v, acc[t][v]);
}

template <int TB>
void lora_rows_block(const float* const* xr, float* const* o, float* u, int64_t K, const float* At, const float* Bt,
                     int64_t R, int64_t r, int64_t N, const int64_t* bounds, int64_t P, int64_t c0, int64_t c1) {
  int64_t j = 0;
  for (; j + 16 <= R; j += 16) lora_shrink_block<TB, 2>(xr, K, At, R, j, u);
  for (; j < R; j += 8) lora_shrink_block<TB, 1>(xr, K, At, R, j, u);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t n0 = std::max(c0, bounds[p]), n1 = std::min(c1, bounds[p + 1]);
    const float* ur[TB];
    for (int t = 0; t < TB; ++t) ur[t] = u + t * R + p * r;
    int64_t n = n0;
    for (; n + 16 <= n1; n += 16) lora_expand_block<TB, 2>(ur, r, Bt, N, n, o);
    for (; n + 8 <= n1; n += 8) lora_expand_block<TB, 1>(ur, r, Bt, N, n, o);
    for (; n < n1; ++n)
      for (int t = 0; t < TB; ++t)
        for (int64_t i = 0; i < r; ++i) o[t][n] += ur[t][i] * Bt[i * N + n];
  }
}

// out[rows of adapter j] += (x[rows] @ At_j) @ Bt_j for projection `proj` of `layer`, the packed parts'
// columns each reading their own r-slice of x @ At (r a multiple of 8). Each adapter's weights are read once
// per 4 of its rows. One parallel region per projection (under a loaded CPU every region costs a thread
// wake-up): tasks of (adapter, column chunk), adapters' rows disjoint; a task computes its own x @ At.
void lora_add_(const LoRAStep& step, size_t layer, int proj, const at::Tensor& x_in, at::Tensor& out, int64_t H,
               int64_t Hkv, int64_t D) {
  TORCH_CHECK(out.is_contiguous() && out.dtype() == at::kFloat && x_in.dtype() == at::kFloat && x_in.dim() == 2 &&
                  out.size(0) == x_in.size(0), "LoRA: float32 rows in and out");
  const at::Tensor x = x_in.contiguous();
  const int64_t K = x.size(1), N = out.size(1), n_ad = step.adapters.size();
  int64_t bounds[4] = {0, N, N, N};   // the parts' column ranges
  int64_t P = 1;
  if (proj == 0) P = 3, bounds[1] = H * D, bounds[2] = (H + Hkv) * D;
  else if (proj == 2) P = 2, bounds[1] = N / 2;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // row tasks: (adapter, first and end index into its rows), 64 rows at most (prefill steps spread)
  std::vector<std::array<int64_t, 3>> row_tasks;
  for (int64_t a = 0; a < n_ad; ++a) {
    if (!step.adapters[a]->w.at(layer * 8 + proj * 2).numel()) continue;
    const int64_t T = step.rows[a].size();
    for (int64_t t = 0; t < T; t += 64) row_tasks.push_back({a, t, std::min(T, t + 64)});
  }
  const int64_t threads = at::get_num_threads(), n_rt = row_tasks.size();
  if (!n_rt) return;
  const int64_t n_chunks = std::max<int64_t>(1, std::min<int64_t>(N / 256, (threads + n_rt - 1) / n_rt));
  const int64_t chunk = ((N + n_chunks - 1) / n_chunks + 7) / 8 * 8;
  at::parallel_for(0, n_rt * n_chunks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> u;
    for (int64_t task = t0; task < t1; ++task) {
      const auto [a, first, end] = row_tasks[task / n_chunks];
      const int64_t c0 = (task % n_chunks) * chunk, c1 = std::min(N, c0 + chunk);
      const at::Tensor& At = step.adapters[a]->w.at(layer * 8 + proj * 2);
      const at::Tensor& Bt = step.adapters[a]->w.at(layer * 8 + proj * 2 + 1);
      const std::vector<int64_t>& rows = step.rows[a];
      if (c0 >= c1) continue;
      const int64_t R = At.size(1), r = Bt.size(0), T = end;
      TORCH_CHECK(At.size(0) == K && Bt.size(1) == N && R == r * P && r % 8 == 0,
                  "LoRA: weights do not fit the projection");
      u.resize(4 * R);
      for (int64_t t = first; t < T; t += 4) {
        const float* xr[4];
        float* o[4];
        const int64_t tb = std::min<int64_t>(4, T - t);
        for (int64_t i = 0; i < tb; ++i) xr[i] = xp + rows[t + i] * K, o[i] = op + rows[t + i] * N;
        const float* A = At.data_ptr<float>();
        const float* B = Bt.data_ptr<float>();
        if (tb == 4) lora_rows_block<4>(xr, o, u.data(), K, A, B, R, r, N, bounds, P, c0, c1);
        else if (tb == 3) lora_rows_block<3>(xr, o, u.data(), K, A, B, R, r, N, bounds, P, c0, c1);
        else if (tb == 2) lora_rows_block<2>(xr, o, u.data(), K, A, B, R, r, N, bounds, P, c0, c1);
        else lora_rows_block<1>(xr, o, u.data(), K, A, B, R, r, N, bounds, P, c0, c1);
      }
    }
  });
}

// The step's rows per adapter from (adapter index, first row, rows) triples.
LoRAStep lora_step(const std::vector<int64_t>& segments, const std::vector<std::shared_ptr<LoRAWeights>>& adapters,
                   size_t num_layers, int64_t num_rows) {
  TORCH_CHECK(segments.size() % 3 == 0, "LoRA: (adapter, first row, rows) triples");
  LoRAStep step{adapters, std::vector<std::vector<int64_t>>(adapters.size())};
  for (const auto& a : adapters) TORCH_CHECK(a && a->w.size() == num_layers * 8, "LoRA: adapter weights for every layer");
  for (size_t s = 0; s < segments.size(); s += 3) {
    const int64_t j = segments[s], first = segments[s + 1], n = segments[s + 2];
    TORCH_CHECK(j >= 0 && j < (int64_t)adapters.size() && first >= 0 && n >= 0 && first + n <= num_rows,
                "LoRA: segment out of range");
    for (int64_t r = first; r < first + n; ++r) step.rows[j].push_back(r);
  }
  return step;
}

// The module path's (a forward hook's) call: one projection of one layer, any number of rows.
void lora_linear_add_(const at::Tensor& x, at::Tensor& out, const std::vector<int64_t>& segments,
                      const std::vector<std::shared_ptr<LoRAWeights>>& adapters, int64_t num_layers, int64_t layer,
                      int64_t proj, int64_t H, int64_t Hkv, int64_t D) {
  TORCH_CHECK(layer >= 0 && layer < num_layers && proj >= 0 && proj < 4, "lora_linear_add_: layer or projection");
  const LoRAStep step = lora_step(segments, adapters, num_layers, x.size(0));
  lora_add_(step, layer, (int)proj, x, out, H, Hkv, D);
}

constexpr int64_t kGGUF = 16;   // a projection kind: GGUF blocks (quant.GGUFLinear.kernel_args)

std::tuple<at::Tensor, at::Tensor> decode_layer_lora(
    at::Tensor x, std::optional<at::Tensor> residual_in, const std::vector<at::Tensor>& w, const std::vector<int64_t>& kinds,
    const std::vector<int64_t>& act_bits, const std::vector<int64_t>& many_rows, double eps, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, int64_t H, int64_t Hkv, int64_t D, at::Tensor& kv_cache, const at::Tensor& slots,
    const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, const LoRAStep* lora, size_t layer) {
  TORCH_CHECK(kinds.size() == 4 && act_bits.size() == 4 && many_rows.size() == 4, "decode_layer: four projections");
  size_t at_w = 2;
  auto base_linear = [&](const at::Tensor& in, int i) {
    const int64_t kind = kinds[i];
    if (kind == kGGUF) {   // act_bits: the parts' count, then a byte per part's GGMLQuantizationType
      const int64_t parts = act_bits[i] & 0xFF;
      std::vector<int64_t> qtypes;
      for (int64_t p = 0; p < parts; ++p) qtypes.push_back(act_bits[i] >> (8 * (p + 1)) & 0xFF);
      at_w += parts;
      return llmserve_gguf::linear_parts(in, std::vector<at::Tensor>(w.begin() + at_w - parts, w.begin() + at_w), qtypes);
    }
    if (kind == 4) {
      at_w += 3;
      return q4_linear(in, w[at_w - 3], w[at_w - 2], w[at_w - 1], many_rows[i]);
    }
    if (kind == 8) {
      at_w += 2;
      return q8_linear(in, w[at_w - 2], w[at_w - 1], many_rows[i], act_bits[i]);
    }
    if (kind == 9) {   // int8 in the VNNI layout: q8_vnni_gemm at every row count
      at_w += 3;
      return q8_vnni_gemm(in, w[at_w - 3], w[at_w - 2], w[at_w - 1], act_bits[i]);
    }
    if (kind == 2) {   // bfloat16 weight packed for oneDNN: rows rounded to bfloat16, the output widened
      at_w += 1;
      return onednn_linear(in.to(at::kBFloat16).contiguous(), w[at_w - 1]).to(at::kFloat);
    }
    if (kind == 1) {   // the GEMV on the plain weight below many_rows, oneDNN on the packed copy from there
      at_w += 2;
      return in.size(0) >= many_rows[i] ? gemm(in, w[at_w - 1]) : f32_linear(in, w[at_w - 2], many_rows[i]);
    }
    at_w += 1;
    return f32_linear(in, w[at_w - 1], many_rows[i]);
  };
  auto linear = [&](const at::Tensor& in, int i) {   // the base projection, then the step's LoRA updates
    at::Tensor out = base_linear(in, i);
    if (lora != nullptr) lora_add_(*lora, layer, i, in, out, H, Hkv, D);
    return out;
  };
  at::Tensor h, residual;
  if (!residual_in.has_value()) {
    residual = x;
    h = rms_norm(x, w[0], eps);
  } else {
    residual = *residual_in;
    add_rms_norm_(x, residual, w[0], eps);
    h = x;
  }
  const int64_t T = h.size(0);
  at::Tensor qkv = linear(h, 0);
  at::Tensor k_cache = kv_cache.select(0, 0), v_cache = kv_cache.select(0, 1);
  rotary_write_kv_(qkv, positions, cos, sin, H, Hkv, D, k_cache, v_cache, slots);
  at::Tensor attn = at::empty({T, H, D}, h.options());
  paged_decode_attention_(attn, qkv.narrow(1, 0, H * D).view({T, H, D}), k_cache, v_cache, block_tables,
                          context_lens, scale);
  h = linear(attn.view({T, H * D}), 1);
  add_rms_norm_(h, residual, w[1], eps);
  h = linear(silu_and_mul(linear(h, 2)), 3);
  return {h, residual};
}

std::tuple<at::Tensor, at::Tensor> decode_layer(
    at::Tensor x, std::optional<at::Tensor> residual_in, const std::vector<at::Tensor>& w, const std::vector<int64_t>& kinds,
    const std::vector<int64_t>& act_bits, const std::vector<int64_t>& many_rows, double eps, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, int64_t H, int64_t Hkv, int64_t D, at::Tensor& kv_cache, const at::Tensor& slots,
    const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  return decode_layer_lora(x, residual_in, w, kinds, act_bits, many_rows, eps, positions, cos, sin, H, Hkv, D, kv_cache,
                           slots, block_tables, context_lens, scale, nullptr, 0);
}

// All decoder layers of a model for a step of decode rows, in one call: the weights are handed over
// once (converting each layer's dozen tensors from Python every step cost ~10 us a layer).
struct DecodeStack {
  struct Layer {
    std::vector<at::Tensor> w;
    std::vector<int64_t> kinds, act_bits, many_rows;
  };
  using Args = std::vector<std::tuple<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                                      std::vector<int64_t>>>;
  std::vector<Layer> layers;
  double eps, scale;
  at::Tensor cos, sin;
  int64_t H, Hkv, D;

  DecodeStack(const Args& args, double eps, at::Tensor cos, at::Tensor sin, int64_t H, int64_t Hkv, int64_t D,
              double scale)
      : eps(eps), scale(scale), cos(std::move(cos)), sin(std::move(sin)), H(H), Hkv(Hkv), D(D) {
    for (const auto& [w, kinds, bits, many] : args) layers.push_back({w, kinds, bits, many});
  }

  // x: the rows' embeddings; returns (last layer's output, residual sum), as decode_layer.
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor x, const std::vector<at::Tensor>& kv_caches,
                                         const at::Tensor& positions, const at::Tensor& slots,
                                         const at::Tensor& block_tables, const at::Tensor& context_lens) {
    return run_layers(x, kv_caches, positions, slots, block_tables, context_lens, nullptr);
  }

  // run, with LoRA adapters on some rows: `segments` (adapter j, first row, rows) triples, j indexing
  // `adapters` (each adapter's LoRAWeights); rows in no segment are the base model's.
  std::tuple<at::Tensor, at::Tensor> run_lora(at::Tensor x, const std::vector<at::Tensor>& kv_caches,
                                              const at::Tensor& positions, const at::Tensor& slots,
                                              const at::Tensor& block_tables, const at::Tensor& context_lens,
                                              const std::vector<int64_t>& segments,
                                              const std::vector<std::shared_ptr<LoRAWeights>>& adapters) {
    const LoRAStep step = lora_step(segments, adapters, layers.size(), x.size(0));
    return run_layers(x, kv_caches, positions, slots, block_tables, context_lens, &step);
  }

  std::tuple<at::Tensor, at::Tensor> run_layers(at::Tensor x, const std::vector<at::Tensor>& kv_caches,
                                                const at::Tensor& positions, const at::Tensor& slots,
                                                const at::Tensor& block_tables, const at::Tensor& context_lens,
                                                const LoRAStep* lora) {
    TORCH_CHECK(kv_caches.size() == layers.size(), "DecodeStack: one KV cache per layer");
    std::optional<at::Tensor> residual;
    for (size_t i = 0; i < layers.size(); ++i) {
      at::Tensor kv = kv_caches[i];
      const Layer& l = layers[i];
      auto [h, r] = decode_layer_lora(x, residual, l.w, l.kinds, l.act_bits, l.many_rows, eps, positions, cos, sin, H,
                                      Hkv, D, kv, slots, block_tables, context_lens, scale, lora, i);
      x = h;
      residual = r;
    }
    return {x, *residual};
  }
};


// ---------------------------------------------------------------------------------------------
// Sampling: per row of logits [R, V], the token drawn from softmax(logits / temps[r]) by one uniform
// u[r] in [0, 1): the first token whose cumulative probability exceeds u[r] times the row's total.
// Entries at -inf (filtered by top-k / top-p / min-p, or banned) weigh exactly 0 and are never drawn.
// Rows are independent (a seeded row draws the same token whatever else is in the batch); rows are
// spread over the threads, each keeping its row's exponentials in a scratch buffer for the scan.

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temps, const at::Tensor& u) {
  check_cpu_f32(logits, "sample_rows");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "sample_rows: contiguous [rows, vocab] logits");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(temps.scalar_type() == at::kFloat && u.scalar_type() == at::kDouble && temps.numel() == R &&
              u.numel() == R && temps.is_contiguous() && u.is_contiguous(), "sample_rows: temps float32, u float64");
  at::Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  const float* xp = logits.data_ptr<float>();
  const float* tp = temps.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) {
    std::vector<float> p(V);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t r = b; r < e; ++r) {
      const float* x = xp + r * V;
      __m256 m8 = ninf;
      int64_t j = 0;
      for (; j + 8 <= V; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(x + j));
      float mx = hmax(m8);
      for (; j < V; ++j) mx = std::max(mx, x[j]);
      if (mx == -INFINITY) {   // nothing allowed at all: the caller's filters leave at least one token
        op[r] = 0;
        continue;
      }
      const float it = 1.0f / tp[r];
      const __m256 mxv = _mm256_set1_ps(mx), itv = _mm256_set1_ps(it);
      __m256 s8 = _mm256_setzero_ps();
      for (j = 0; j + 8 <= V; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        const __m256 ev = _mm256_andnot_ps(_mm256_cmp_ps(v, ninf, _CMP_EQ_OQ),
                                           exp8(_mm256_mul_ps(_mm256_sub_ps(v, mxv), itv)));
        _mm256_storeu_ps(p.data() + j, ev);
        s8 = _mm256_add_ps(s8, ev);
      }
      double total = hsum(s8);
      for (; j < V; ++j) {
        p[j] = x[j] == -INFINITY ? 0.0f : std::exp((x[j] - mx) * it);
        total += p[j];
      }
      const double target = up[r] * total;
      double acc = 0.0;
      int64_t pick = -1, last = 0;
      for (j = 0; j < V; ++j) {
        if (p[j] == 0.0f) continue;
        last = j;
        acc += p[j];
        if (acc > target) {
          pick = j;
          break;
        }
      }
      op[r] = pick >= 0 ? pick : last;   // rounding left the scan short of the target: the last token weighed
    }
  });
  return out;
}

}  // namespace

// The kernels that run long let go of the GIL: the server's event loop (llmserve/engine/async_engine.py runs the
// engine on its own thread) streams tokens meanwhile instead of waiting for the step to end.
const auto kNoGIL = py::call_guard<py::gil_scoped_release>();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear", &q4_linear, "x @ W.T, W int4 (32-value groups, scale and min)", kNoGIL);
  m.def("q8_linear", &q8_linear, "x @ W.T, W int8 (groups with a scale each)", kNoGIL);
  m.def("q8_vnni_gemm", &q8_vnni_gemm, "x @ W.T, W int8 per channel in the VNNI layout, activations as q8_int_gemm's", kNoGIL);
  m.def("set_q4_vnni", &set_q4_vnni, "whether q4_linear's many rows take the VNNI integer GEMM (else float32 tiles)");
  m.def("uses_vnni", &uses_vnni, "whether q8_vnni_gemm runs here (AVX-512 VNNI, allowed)");
  m.def("uses_avx512", &use_avx512, "whether the AVX-512 kernels run (the CPU has them, and they are allowed)");
  m.def("set_avx512", &set_avx512, "allow the AVX-512 kernels or not; returns uses_avx512()");
  m.def("set_q8_int_gemm", &set_q8_int_gemm, "many rows on per-channel int8 weights: integer GEMM (true) or float32 tiles");
  m.def("f32_linear", &f32_linear, "x @ W.T, W float32, few rows", kNoGIL);
  m.def("gemm", &gemm, "x @ W.T, W float32: at::linear or oneDNN's matmul (set_gemm_engine)", kNoGIL);
  m.def("set_gemm_engine", &set_gemm_engine, "true: gemm() runs oneDNN's matmul, false: at::linear");
  m.def("head_argmax", &head_argmax, "argmax(x @ W.T) per row, W float32 screened by its int8 copy", kNoGIL);
  m.def("rms_norm", &rms_norm, "RMSNorm");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = RMSNorm(residual), in place");
  m.def("rotary_write_kv_", &rotary_write_kv_, "neox rotary of the q and k heads of qkv rows in place; K, V into the cache");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("gguf_dequantize", &llmserve_gguf::dequantize, "GGUF blocks uint8 [N, row_bytes] -> float32 [N, K]");
  m.def("gguf_linear", &llmserve_gguf::linear, "x [M, K] @ dequantize(raw).T, read from the GGUF blocks", kNoGIL);
  m.def("gguf_linear_f32", &llmserve_gguf::linear_f32, "x [M, K] @ dequantize(raw).T in float32 (weights widened)", kNoGIL);
  m.def("gguf_linear_parts", &llmserve_gguf::linear_parts, "x @ [parts' weights].T side by side, integer dots", kNoGIL);
  m.def("gguf_uses_avx512", &llmserve_gguf::uses_avx512, "whether the AVX-512 VNNI K-quant dots run");
  m.def("decode_layer", &decode_layer, "one decoder layer for decode rows, all in C++", kNoGIL);
  m.def("paged_prefill_attention_", &paged_prefill_attention_, "a prefill chunk's causal attention over the paged KV cache", kNoGIL);
  m.def("paged_decode_attention_", &paged_decode_attention_, "decode attention over the paged KV cache", kNoGIL);
  m.def("sample_rows", &sample_rows, "one token per row of logits, drawn by inverting its CDF at u");
  m.def("lora_linear_add_", &lora_linear_add_, "out[adapter rows] += x[rows] @ A^T @ B^T (one projection)");
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<const DecodeStack::Args&, double, at::Tensor, at::Tensor, int64_t, int64_t, int64_t, double>())
      .def("run", &DecodeStack::run, "every layer's decode_layer in turn", kNoGIL)
      .def("run_lora", &DecodeStack::run_lora, "run, with LoRA adapters' updates on their rows", kNoGIL);
  pybind11::class_<LoRAWeights, std::shared_ptr<LoRAWeights>>(m, "LoRAWeights")
      .def(pybind11::init<std::vector<at::Tensor>>());
}
