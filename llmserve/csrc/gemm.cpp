// The GEMMs through torch's libraries: the float32 one every many-rows path ends in (at::linear or oneDNN's
// matmul, gemm()), and the integer one for many rows of per-channel int8 weights (_int_mm or oneDNN's int8
// matmul, q8_int_gemm()).
#include "gemm.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <optional>
#include <string_view>
#include <vector>

#include "vec.h"

namespace llmserve {

// The float32 GEMM: at::linear (MKL's sgemm in torch's CPU build) or oneDNN's matmul (torch's own
// mkldnn::_linear_pointwise op, called through the dispatcher). Which one is measured at start-up
// (ops.gemm_engine; toggles.gemm_onednn): on AMD CPUs MKL keeps to its AVX2 code while oneDNN runs AVX-512
// (2-2.4x here). oneDNN builds a primitive per shape (~1 ms, kept in its cache of 1024): rows are padded up to a
// bucket so a model meets a few dozen row counts per weight shape, not one per prefill chunk length.

int64_t gemm_bucket(int64_t M) {
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
  if (toggles.gemm_onednn && x.dim() == 2 && x.size(0) > 0) return onednn_linear(x.contiguous(), w.contiguous());
  return at::linear(x, w);
}

// A packed weight (onednn::qlinear_prepack, [K, N] in oneDNN's blocked layout: `ops.pack_int8_weight`) goes through
// onednn::qlinear_pointwise: activations as uint8 q + 128 with zero point 128 (the same integer products, exactly),
// no per-call re-layout of the weight (16 rows of a 1B model's MLP ~2x _int_mm's time on the plain weight; even
// with the dots at one row). Its float32 output holds the int32 sums (exact below 2^24).
static at::Tensor qlinear_u8(const at::Tensor& xq, const at::Tensor& packed) {
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

// The fast Walsh-Hadamard transform of one row of K values (K % hb == 0) from `in` to `out`, blocks of hb, AVX2: the
// butterflies of distance 1, 2 and 4 inside a vector of 8 (a permute, then sums in one half and differences in
// the other), those of 8 and up between vectors; the 1 / sqrt(hb) at the end (exact for 16 and 64).
static void hadamard_row(const float* in, float* out, int64_t K, int64_t hb) {
  const __m256 nv = _mm256_set1_ps(1.0f / std::sqrt(static_cast<float>(hb)));
  const int64_t n = hb / 8;
  __m256 v[8];
  for (int64_t k0 = 0; k0 < K; k0 += hb) {
    for (int64_t i = 0; i < n; ++i) {
      __m256 a = _mm256_loadu_ps(in + k0 + 8 * i), p;
      p = _mm256_permute_ps(a, 0xB1);  // distance 1
      a = _mm256_blend_ps(_mm256_add_ps(a, p), _mm256_sub_ps(p, a), 0xAA);
      p = _mm256_permute_ps(a, 0x4E);  // distance 2
      a = _mm256_blend_ps(_mm256_add_ps(a, p), _mm256_sub_ps(p, a), 0xCC);
      p = _mm256_permute2f128_ps(a, a, 1);  // distance 4
      v[i] = _mm256_blend_ps(_mm256_add_ps(a, p), _mm256_sub_ps(p, a), 0xF0);
    }
    for (int64_t h = 1; h < n; h *= 2)
      for (int64_t i = 0; i < n; i += 2 * h)
        for (int64_t j = i; j < i + h; ++j) {
          const __m256 a = v[j], c = v[j + h];
          v[j] = _mm256_add_ps(a, c);
          v[j + h] = _mm256_sub_ps(a, c);
        }
    for (int64_t i = 0; i < n; ++i) _mm256_storeu_ps(out + k0 + 8 * i, _mm256_mul_ps(v[i], nv));
  }
}

static void check_hadamard(int64_t K, int64_t hb) {
  TORCH_CHECK((hb == 16 || hb == 32 || hb == 64) && K % hb == 0, "hadamard_rows: blocks of 16, 32 or 64");
}

at::Tensor hadamard_rows(const at::Tensor& x_in, int64_t hb) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "hadamard_rows: float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  check_hadamard(K, hb);
  at::Tensor out = at::empty({M, K}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) hadamard_row(xp + m * K, op + m * K, K, hb);
  });
  return out;
}

void round_rows(const float* xp, int64_t M, int64_t K, int64_t L, int64_t Mb, bool u8, uint8_t* qp, float* sx,
                int64_t hb) {
  if (hb) check_hadamard(K, hb);
  // 8 rounded values (int32 lanes, within +-127) -> 8 bytes at `dst`, flipped to q + 128 (u8)
  const __m128i flip = _mm_set1_epi8(u8 ? static_cast<char>(0x80) : 0);
  const auto store8 = [&](const __m256 f, uint8_t* dst) {
    const __m256i v = _mm256_cvtps_epi32(f);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_xor_si128(_mm_packs_epi16(w, w), flip));
  };
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    const __m256 sign = _mm256_set1_ps(-0.0f), lim = _mm256_set1_ps(127.0f);
    std::vector<float> rotated(hb ? K : 0);  // (hb: the row rotated here, never written out whole)
    for (int64_t m = b; m < e; ++m) {
      const float* r = xp + m * K;
      if (hb) {
        hadamard_row(r, rotated.data(), K, hb);
        r = rotated.data();
      }
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

at::Tensor rotated_for(const at::Tensor& x, int64_t act_bits, int64_t& bits) {
  bits = act_bits & 0xFF;
  const int64_t hb = act_bits >> 8;
  return hb ? hadamard_rows(x, hb) : x;
}

// act_bits: the integer width x is rounded to on the few-rows path (16, or 8: faster, less exact).
// Many rows on int8 weights with one scale per output channel: an integer GEMM (torch's _int_mm, oneDNN's
// int8 matmul: VNNI where the CPU has it, 3-5x the float32 GEMM here). Each row of x is rounded to int8
// with its own scale (per token, so a row's result does not depend on the others); act_bits 16 adds a
// second int8 row for what the first rounding left (scale / 254): ~15 bits in all, relative error ~4e-5
// against ~9e-3 for one level, for twice the integer work. Rows padded to gemm_bucket as gemm() does.
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

}  // namespace llmserve
