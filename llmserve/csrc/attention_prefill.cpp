// Prefill attention over the paged KV cache, read in place: a chunk's causal attention, flash-style (AVX2 and
// AVX-512 variants).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace llmserve {

namespace {

// Prefill attention over the paged cache, in place: the n queries of one chunk (positions ctx - n .. ctx - 1)
// against keys 0 .. each query's own position, read from the request's blocks (the chunk's own K and V are
// already written there: a fresh prompt and a chunk after a cached prefix take the same path). Flash-style,
// no [n, ctx] score matrix. A task is (KV head, tile of kPrefillQ query positions): its G = H / Hkv query
// heads make M = kPrefillQ * G rows that share every key and value read. The rows lie in vector lanes
// (Q, the scores and the output are kept transposed: [D or keys][rows]), so every product is an outer
// product of a broadcast key (value) element with row vectors, and the online softmax (a running max and
// sum per row; the output rescaled when the max moves) needs no horizontal sums. Per tile of kPrefillK
// keys: S^T = K Q^T, P = exp(S - max), O^T = alpha O^T + V^T P^T, register-blocked (keys x row vectors,
// columns x row vectors). float32 keys are read straight from the blocks, float16 and bfloat16 ones widened per tile, int8
// ones widened and multiplied by their row's scale per tile.
// Key tiles past a task's last query are skipped; on the diagonal a row's later keys get probability 0.
// Sinks (gpt-oss): a query head's learned logit s joins its softmax's denominator with no value; the online softmax
// leaves O / l with l = sum exp(score - max), so the sink only adds exp(s - max) to l at the end.
// A sliding window (each query sees its last `window` positions): key tiles wholly before a task's first query's
// window are skipped; in the tiles that straddle a row's window start its earlier keys' scores are set to -inf
// before the softmax (out of the max) and their probabilities to 0 after it. Both outside the vector kernels: the
// AVX2 and AVX-512 variants are the same code with and without windows.

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

// The same with AVX-512 (avx512_real()): 16 rows a register, blocks of 8 keys (8 columns) x up to 3 row vectors.
// The rows lie in the lanes, so each row's float operations are PrefillAvx2's in the same order (exp16 and exp8: the
// same series and power of two for x <= 0; a masked score's exp is 0 in both): PrefillAvx2 is its portable twin, the
// same bits (LLMSERVE_AVX512=twin runs it).
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
// rows (i - i0) * G + g). q / out rows: qld / old apart, heads D apart. Caches [blocks, bs, Hkv, W]: W = D, or
// D + 4 for int8 (the scale after the values).
template <typename Kern, typename C>
void prefill_task(const float* qp, int64_t qld, float* op, int64_t old, const C* kc, const C* vc,
                  const int64_t* table, int64_t bs, int64_t Hkv, int64_t D, int64_t W, int64_t kvh, int64_t G, int64_t ctx,
                  int64_t n, int64_t i0, int64_t i1, float scale, const float* sink, int64_t window,
                  PrefillScratch& w) {
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
  // with a window: row m sees keys from lo(m) = its position - window + 1; the first query's is where reading starts
  auto lo = [&](int64_t m) { return (int64_t)w.pos[m] - window + 1; };
  const int64_t k_begin = window > 0 ? std::max<int64_t>(0, first + i0 - window + 1) : 0;
  for (int64_t k0 = k_begin; k0 <= last; k0 += kPrefillK) {
    const int64_t kn = std::min<int64_t>(kPrefillK, last + 1 - k0);
    for (int64_t j = 0; j < kPrefillK; ++j) {
      if (j >= kn) {   // past the last query: a row of zeros (finite products, probability 0)
        w.kr[j] = w.vr[j] = w.zero.data();
        continue;
      }
      const int64_t pos = k0 + j, off = ((table[pos / bs] * bs + pos % bs) * Hkv + kvh) * W;
      if constexpr (std::is_same_v<C, float>) {
        w.kr[j] = kc + off;
        w.vr[j] = vc + off;
      } else {   // widened once per tile
        float *kd = w.kw.data() + j * D, *vd = w.vw.data() + j * D;
        __m256 ks = _mm256_set1_ps(1.0f), vs = ks;
        if constexpr (std::is_same_v<C, int8_t>) {
          ks = _mm256_set1_ps(kv_scale(kc + off, D));
          vs = _mm256_set1_ps(kv_scale(vc + off, D));
        }
        for (int64_t d = 0; d < D; d += 8) {
          _mm256_storeu_ps(kd + d, _mm256_mul_ps(load8(kc + off + d), ks));
          _mm256_storeu_ps(vd + d, _mm256_mul_ps(load8(vc + off + d), vs));
        }
        w.kr[j] = kd;
        w.vr[j] = vd;
      }
    }
    Kern::qk(Qt, Mp, D, w.kr.data(), St);
    const bool edge = window > 0 && k0 < last - window + 1;   // some row's window starts after k0
    if (edge)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < std::min<int64_t>(kPrefillK, lo(m) - k0); ++j) St[j * Mp + m] = -INFINITY;
    Kern::softmax(St, Mp, w.pos.data(), k0, k0 + kPrefillK - 1 > first + i0, w.mx.data(), w.l.data(), w.alpha.data());
    if (edge)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < std::min<int64_t>(kPrefillK, lo(m) - k0); ++j) St[j * Mp + m] = 0.0f;
    Kern::pv(St, Mp, D, w.vr.data(), w.alpha.data(), Ot);
  }
  for (int64_t m = 0; m < M; ++m) {
    const int64_t i = i0 + m / G, g = m % G;
    const float inv = 1.0f / (sink == nullptr ? w.l[m] : w.l[m] + std::exp(sink[g] - w.mx[m]));
    float* dst = op + i * old + (kvh * G + g) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = Ot[d * Mp + m] * inv;
  }
}

}  // namespace

// out [n, H, D] = attention of q [n, H, D] (one prefill chunk: positions ctx - n .. ctx - 1, causal) over
// the first ctx positions of the request whose blocks block_table [>= ceil(ctx / bs)] names. Rows of q and
// out may be strided (heads contiguous). Tasks (query tile, KV head) are ordered first, last, second,
// second-to-last ... tile, so that at::parallel_for's contiguous split gives every thread as many keys.
void paged_prefill_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_table, int64_t context_len,
                              double scale, const std::optional<at::Tensor>& sinks, int64_t window) {
  check_cpu_f32(q, "paged_prefill_attention");
  check_cpu_f32(out, "paged_prefill_attention");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_table.is_contiguous() &&
              block_table.dim() == 1 && block_table.scalar_type() == at::kLong,
              "paged_prefill_attention: contiguous caches, an int64 block table");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
              kv_cache_type(k_cache.scalar_type()) && k_cache.dim() == 4,
              "paged_prefill_attention: float32, float16, bfloat16 or int8 caches of one shape");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "paged_prefill_attention: q and out [n, H, D]");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), ctx = context_len;
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), num_blocks = k_cache.size(0);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && out.stride(2) == 1 && out.stride(1) == D &&
              (D == 64 || D == 128) && H % Hkv == 0 && k_cache.size(3) == kv_row(k_cache.scalar_type(), D),
              "paged_prefill_attention: layout");
  TORCH_CHECK(n <= ctx && ctx < (1LL << 31) && (ctx + bs - 1) / bs <= block_table.numel(),
              "paged_prefill_attention: context length");
  if (n == 0) return;
  const int64_t* table = block_table.data_ptr<int64_t>();
  TORCH_CHECK(window >= 0, "paged_prefill_attention: window");
  // (with a window, the blocks before the first query's window are never read)
  for (int64_t i = window > 0 ? std::max<int64_t>(0, ctx - n - window + 1) / bs : 0; i < (ctx + bs - 1) / bs; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "paged_prefill_attention: block id");
  const int64_t G = H / Hkv, qld = q.stride(0), old = out.stride(0), tiles = (n + kPrefillQ - 1) / kPrefillQ;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = (float)scale;
  const at::ScalarType type = k_cache.scalar_type();
  const int64_t W = k_cache.size(3);
  const bool wide = avx512_real();
  const float* sk = nullptr;
  if (sinks.has_value()) {
    check_cpu_f32(*sinks, "paged_prefill_attention");
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == H && sinks->is_contiguous(), "paged_prefill_attention: sinks [H]");
    sk = sinks->data_ptr<float>();
  }
  at::parallel_for(0, tiles * Hkv, 1, [&](int64_t t0, int64_t t1) {
    PrefillScratch w((kPrefillQ * G + 15) / 16 * 16, D);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t u = t / Hkv, kvh = t % Hkv;
      const int64_t tile = u % 2 == 0 ? u / 2 : tiles - 1 - u / 2;
      const int64_t i0 = tile * kPrefillQ, i1 = std::min(n, i0 + kPrefillQ);
      auto run = [&](auto kern, const auto* kc, const auto* vc) {
        prefill_task<decltype(kern)>(qp, qld, op, old, kc, vc, table, bs, Hkv, D, W, kvh, G, ctx, n, i0, i1, sc,
                                     sk == nullptr ? nullptr : sk + kvh * G, window, w);
      };
      if (type == at::kHalf) {
        const at::Half *kc = k_cache.data_ptr<at::Half>(), *vc = v_cache.data_ptr<at::Half>();
        if (wide) run(PrefillAvx512{}, kc, vc);
        else run(PrefillAvx2{}, kc, vc);
      } else if (type == at::kBFloat16) {
        const at::BFloat16 *kc = k_cache.data_ptr<at::BFloat16>(), *vc = v_cache.data_ptr<at::BFloat16>();
        if (wide) run(PrefillAvx512{}, kc, vc);
        else run(PrefillAvx2{}, kc, vc);
      } else if (type == at::kChar) {
        const int8_t *kc = k_cache.data_ptr<int8_t>(), *vc = v_cache.data_ptr<int8_t>();
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

}  // namespace llmserve
