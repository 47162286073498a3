// The fused decode stack: one decoder layer for a batch of decode rows in one call (decode_layer), and every layer
// of a model in one call (DecodeStack, bound for Python), with LoRA adapters on some rows (run_lora).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "lora.h"

namespace llmserve {

// One decoder layer for a batch of decode rows (each row one request's next token), in one call:
// the Python around ~12 kernel calls per layer costs as much as the kernels on a single stream.
// weights: [input_norm, post_norm, then per projection (qkv, o, gate_up, down) its tensors];
// kinds[i] for each projection: a ProjectionKind (projection_kinds.h), which says the tensors it takes.
// act_bits[i]: int8's activation width. many_rows[i]: the rows from which projection i leaves its
// few-rows kernel for the many-rows path (float32: at::linear, i.e. MKL/oneDNN's GEMM; the crossover is
// measured per weight shape, llmserve/model/kernels/cpu_ext.py). Returns (layer output, running residual sum);
// `residual` undefined means x is the embeddings (the first layer).
// `lora`: the step's adapter rows (nullptr: none), `layer` this layer's index among the adapters' weights.
std::tuple<at::Tensor, at::Tensor> decode_layer_lora(
    at::Tensor x, std::optional<at::Tensor> residual_in, const std::vector<at::Tensor>& w, const std::vector<int64_t>& kinds,
    const std::vector<int64_t>& act_bits, const std::vector<int64_t>& many_rows, double eps, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, int64_t H, int64_t Hkv, int64_t D, at::Tensor& kv_cache, const at::Tensor& slots,
    const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, const LoRAStep* lora, size_t layer);

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


}  // namespace llmserve
