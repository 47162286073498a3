// LoRA's update inside the fused decode stack and for the module path's hook: per adapter, its rows' x @ A^T @ B^T
// added to the projection's output (the punica / S-LoRA grouping: one group per adapter).
#include "lora.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>

#include "kernels.h"

namespace llmserve {

namespace {

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

}  // namespace

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

}  // namespace llmserve
