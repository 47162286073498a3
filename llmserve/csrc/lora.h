// LoRA adapters inside the fused decode stack (llmserve/model/lora.py): one adapter's weights (LoRAWeights, bound
// for Python), a step's rows per adapter (LoRAStep), and the update of one projection (lora.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace llmserve {

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

// The step's rows per adapter from (adapter index, first row, rows) triples.
LoRAStep lora_step(const std::vector<int64_t>& segments, const std::vector<std::shared_ptr<LoRAWeights>>& adapters,
                   size_t num_layers, int64_t num_rows);

// out[rows of adapter j] += (x[rows] @ At_j) @ Bt_j for projection `proj` (0 qkv, 1 o, 2 gate_up, 3 down) of
// `layer`; H, Hkv, D: the qkv parts' widths.
void lora_add_(const LoRAStep& step, size_t layer, int proj, const at::Tensor& x_in, at::Tensor& out, int64_t H,
               int64_t Hkv, int64_t D);

}  // namespace llmserve
