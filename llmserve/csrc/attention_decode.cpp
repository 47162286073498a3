// Decode attention over the paged KV cache, read in place (one query per request).
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

// Decode attention over the paged cache, in place: out[b, h] = softmax(q[b, h] . K_b * scale) V_b,
// K_b / V_b the first context_lens[b] positions of request b, read from the blocks of its table.
// q, out: [B, H, D] (rows may be strided, heads contiguous); caches [num_blocks, block, Hkv, D].
// One task per (request, KV head): the positions' offsets into the cache are worked out once (block
// by block), the group's query heads (G = H / Hkv) score each key while it is in L1, then for each head
// the softmax and the weighted sum of values with the D/8 accumulators in registers.
// The key and value rows 16 positions ahead are prefetched while 8 keys are scored: the blocks lie anywhere, so
// the hardware's prefetchers lose the stream at every block; 30 layers x 64 rows x 320 positions of a float32
// cache (SmolLM2's 3 KV heads) 64 -> 47 ms a step, float16 59 -> 35 ms (from DRAM: ~1 GB a step).
// An int8 cache (C = int8_t) is read as its integers; each key's scale multiplies its scores, each value's its
// probability (the scale sits after the row's D values, vec.h).
// Sinks (gpt-oss): head g's learned logit sink[g] joins its softmax's max and denominator, with no value. A sliding
// window: the last `window` positions only (off[] lists just those; the blocks before them are never read).

template <typename C>
constexpr bool kScaled = std::is_same_v<C, int8_t>;

template <int D, typename C>
void attend_group(const float* q0, int64_t G, const C* kp, const C* vp, const int64_t* off, int64_t len,
                  float sc, float* scores, float* o0, const float* sink) {
  constexpr int R = D / 8;
  const __m256 scv = _mm256_set1_ps(sc);
  int64_t j0 = 0;
  constexpr int64_t kAhead = 16;   // positions: their key and value rows are fetched while these 8 are scored
  constexpr int64_t kLine = 64 / sizeof(C), kRow = D + (kScaled<C> ? kKVScale : 0);
  for (; j0 + 8 <= len; j0 += 8) {   // 8 keys at a time: their 8 dot products summed across lanes together
    const C* kr[8];
    for (int i = 0; i < 8; ++i) kr[i] = kp + off[j0 + i];
    for (int64_t i = j0 + kAhead; i < std::min(len, j0 + kAhead + 8); ++i)
      for (int64_t c = 0; c < kRow; c += kLine) {
        _mm_prefetch(reinterpret_cast<const char*>(kp + off[i] + c), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vp + off[i] + c), _MM_HINT_T1);
      }
    __m256 ksc = scv;   // the softmax scale, times each key's own for an int8 cache
    if constexpr (kScaled<C>)
      ksc = _mm256_mul_ps(scv, _mm256_setr_ps(kv_scale(kr[0], D), kv_scale(kr[1], D), kv_scale(kr[2], D),
                                              kv_scale(kr[3], D), kv_scale(kr[4], D), kv_scale(kr[5], D),
                                              kv_scale(kr[6], D), kv_scale(kr[7], D)));
    for (int64_t g = 0; g < G; ++g) {
      const float* qh = q0 + g * D;
      __m256 a[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_loadu_ps(qh + 8 * r);
        for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, load8(kr[i] + 8 * r), a[i]);
      }
      _mm256_storeu_ps(scores + g * len + j0, _mm256_mul_ps(hsum8(a), ksc));
    }
  }
  for (int64_t j = j0; j < len; ++j) {
    const C* k = kp + off[j];
    float ks = sc;
    if constexpr (kScaled<C>) ks *= kv_scale(k, D);
    for (int64_t g = 0; g < G; ++g) {
      const float* qh = q0 + g * D;
      __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(qh), load8(k));
      __m256 s1 = _mm256_mul_ps(_mm256_loadu_ps(qh + 8), load8(k + 8));
      for (int r = 2; r < R; r += 2) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * r), load8(k + 8 * r), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * r + 8), load8(k + 8 * r + 8), s1);
      }
      scores[g * len + j] = hsum(_mm256_add_ps(s0, s1)) * ks;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * len;
    float mx = -INFINITY;
    for (int64_t j = 0; j < len; ++j) mx = std::max(mx, sg[j]);
    if (sink != nullptr) mx = std::max(mx, sink[g]);
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
    if (sink != nullptr) sum += std::exp(sink[g] - mx);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (j = 0; j < len; ++j) {
      const C* v = vp + off[j];
      float pj = sg[j];
      if constexpr (kScaled<C>) pj *= kv_scale(v, D);
      const __m256 p = _mm256_set1_ps(pj);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(p, load8(v + 8 * r), acc[r]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(o0 + g * D + 8 * r, _mm256_mul_ps(acc[r], inv));
  }
}

}  // namespace

void paged_decode_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, double scale, const std::optional<at::Tensor>& sinks,
                             int64_t window) {
  check_cpu_f32(q, "paged_decode_attention");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous() &&
              context_lens.is_contiguous(), "paged_decode_attention: contiguous caches and tables");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: int64 tables");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
              kv_cache_type(k_cache.scalar_type()),
              "paged_decode_attention: float32, float16, bfloat16 or int8 caches of one shape");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), maxb = block_tables.size(1);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && out.stride(2) == 1 && out.stride(1) == D &&
              (D == 64 || D == 128) && H % Hkv == 0 && k_cache.size(3) == kv_row(k_cache.scalar_type(), D),
              "paged_decode_attention: layout");
  const int64_t G = H / Hkv, qld = q.stride(0), old = out.stride(0), num_blocks = k_cache.size(0);
  const int64_t W = k_cache.size(3);   // a row's elements: D, or D + the scale's 4 bytes for int8
  const float* qp = q.data_ptr<float>();
  const at::ScalarType type = k_cache.scalar_type();
  float* op = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const float* sk = nullptr;
  if (sinks.has_value()) {
    check_cpu_f32(*sinks, "paged_decode_attention");
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == H && sinks->is_contiguous(), "paged_decode_attention: sinks [H]");
    sk = sinks->data_ptr<float>();
  }
  TORCH_CHECK(window >= 0, "paged_decode_attention: window");
  auto first_of = [&](int64_t len) { return window > 0 ? std::max<int64_t>(0, len - window) : 0; };
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= maxb * bs, "paged_decode_attention: context length");
    for (int64_t i = first_of(lens[b]) / bs; i < (lens[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(tables[b * maxb + i] >= 0 && tables[b * maxb + i] < num_blocks, "paged_decode_attention: block id");
  }
  const float sc = (float)scale;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t b0, int64_t e0) {
    std::vector<float> scores;
    std::vector<int64_t> off;
    for (int64_t task = b0; task < e0; ++task) {
      const int64_t b = task / Hkv, kvh = task % Hkv, first = first_of(lens[b]), len = lens[b] - first;
      scores.resize(G * len);
      off.resize(len);
      const int64_t* table = tables + b * maxb;
      for (int64_t p = first; p < lens[b];) {   // the cache offset of each position, block by block
        const int64_t blk = p / bs, end = std::min(lens[b], (blk + 1) * bs);
        const int64_t base = (table[blk] * bs * Hkv + kvh) * W;
        for (; p < end; ++p) off[p - first] = base + (p % bs) * Hkv * W;
      }
      const float* q0 = qp + b * qld + kvh * G * D;
      float* o0 = op + b * old + kvh * G * D;
      const float* sink = sk == nullptr ? nullptr : sk + kvh * G;
      auto attend = [&](auto* kp, auto* vp) {
        if (D == 64) attend_group<64>(q0, G, kp, vp, off.data(), len, sc, scores.data(), o0, sink);
        else attend_group<128>(q0, G, kp, vp, off.data(), len, sc, scores.data(), o0, sink);
      };
      if (type == at::kHalf) attend(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>());
      else if (type == at::kBFloat16) attend(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
      else if (type == at::kChar) attend(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
      else attend(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
    }
  });
}

}  // namespace llmserve
