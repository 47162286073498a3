// One decoder layer for a batch of decode rows, every kernel called from C++ (decode_stack.h).
#include "decode_stack.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>

#include "gemm.h"
#include "kernels.h"
#include "projection_kinds.h"

namespace llmserve {

std::tuple<at::Tensor, at::Tensor> decode_layer_lora(
    at::Tensor x, std::optional<at::Tensor> residual_in, const std::vector<at::Tensor>& w, const std::vector<int64_t>& kinds,
    const std::vector<int64_t>& act_bits, const std::vector<int64_t>& many_rows, double eps, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, int64_t H, int64_t Hkv, int64_t D, at::Tensor& kv_cache, const at::Tensor& slots,
    const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, const LoRAStep* lora, size_t layer) {
  TORCH_CHECK(kinds.size() == 4 && act_bits.size() == 4 && many_rows.size() == 4, "decode_layer: four projections");
  size_t at_w = 2;
  auto base_linear = [&](const at::Tensor& in, int i) {
    const auto kind = static_cast<ProjectionKind>(kinds[i]);
    if (kind == kGGUF) {   // act_bits: the parts' count, then a byte per part (projection_kinds.h)
      std::vector<int64_t> codes;
      const size_t first = at_w;
      for (int64_t p = 0; p < (act_bits[i] & 0xFF); ++p) {
        codes.push_back(act_bits[i] >> (8 * (p + 1)) & 0xFF);
        at_w += part_tensors(codes.back());
      }
      return gguf::linear_parts(in, std::vector<at::Tensor>(w.begin() + first, w.begin() + at_w), codes, many_rows[i]);
    }
    if (kind == kInt4) {
      at_w += 3;
      return q4_linear(in, w[at_w - 3], w[at_w - 2], w[at_w - 1], many_rows[i], act_bits[i] == kQ8_1Rounding);
    }
    if (kind == kInt8) {
      at_w += 2;
      return q8_linear(in, w[at_w - 2], w[at_w - 1], many_rows[i], act_bits[i]);
    }
    if (kind == kInt8VNNI) {   // int8 in the VNNI layout: q8_vnni_gemm at every row count
      at_w += 3;
      return q8_vnni_gemm(in, w[at_w - 3], w[at_w - 2], w[at_w - 1], act_bits[i]);
    }
    if (kind == kBF16) {   // bfloat16 weight packed for oneDNN: rows rounded to bfloat16, the output widened
      at_w += 1;
      const at::Tensor& wb = w[at_w - 1];
      if (!wb.is_mkldnn())   // the portable twin (LLMSERVE_CPU_BF16=emulate): the plain weight, at::linear in bf16
        return at::linear(in.to(at::kBFloat16), wb).to(at::kFloat);
      return onednn_linear(in.to(at::kBFloat16).contiguous(), wb).to(at::kFloat);
    }
    if (kind == kF32Packed) {   // the GEMV on the plain weight below many_rows, oneDNN on the packed copy from there
      at_w += 2;
      return in.size(0) >= many_rows[i] ? gemm(in, w[at_w - 1]) : f32_linear(in, w[at_w - 2], many_rows[i]);
    }
    TORCH_CHECK(kind == kF32, "decode_layer: unknown projection kind ", kinds[i]);
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

}  // namespace llmserve
