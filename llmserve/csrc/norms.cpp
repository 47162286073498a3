// Norms, rotary and activations: RMSNorm (and the residual add fused with the next one), neox rotary applied in
// place with the rows' K and V written into the paged cache, SiLU-and-mul.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace llmserve {

namespace {

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

}  // namespace

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
// [num_blocks, block, Hkv, D] float32, float16 or bfloat16, or [..., D + 4] int8: each head quantized, vec.h). cos/sin: [max_positions, D] tables (first half equal to the second).
void rotary_write_kv_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                      int64_t num_heads, int64_t num_kv_heads, int64_t D, at::Tensor& k_cache, at::Tensor& v_cache,
                      const at::Tensor& slot_mapping) {
  check_cpu_f32(qkv, "rotary");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && cos.is_contiguous() && sin.is_contiguous() &&
              qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "rotary: layout");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong && D % 16 == 0 &&
              positions.numel() == qkv.size(0) && slot_mapping.numel() == qkv.size(0), "rotary: int64 positions, slots");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(2) == num_kv_heads &&
              kv_cache_type(k_cache.scalar_type()) && k_cache.size(3) == kv_row(k_cache.scalar_type(), D) &&
              v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "rotary: cache layout");
  const int64_t T = qkv.size(0), ld = qkv.stride(0), half = D / 2, P = cos.size(0);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), kv = num_kv_heads * D;
  const int64_t slot_width = num_kv_heads * k_cache.size(3);   // an int8 cache's rows carry their scales
  float* p = qkv.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P && slots[t] >= 0 && slots[t] < num_slots, "rotary: position or slot out of range");
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const at::ScalarType type = k_cache.scalar_type();
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
      auto store = [&](auto* kc, auto* vc) {
        store_kv_heads(knew, num_kv_heads, D, kc + slots[t] * slot_width);
        store_kv_heads(knew + kv, num_kv_heads, D, vc + slots[t] * slot_width);
      };
      if (type == at::kHalf) store(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>());
      else if (type == at::kBFloat16) store(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
      else if (type == at::kChar) store(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
      else store(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
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

}  // namespace llmserve
