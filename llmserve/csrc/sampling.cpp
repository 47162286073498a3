// Sampling: one token per row of logits, drawn by inverting the row's CDF at a given uniform.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace llmserve {

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

}  // namespace llmserve
