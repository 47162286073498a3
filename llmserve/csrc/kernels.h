// Every kernel Python calls (bindings.cpp binds them; llmserve/model/kernels/ops.py and gguf_kernels.py call them), by the
// file that defines it. The tensors are CPU tensors; activations float32 unless said otherwise.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

namespace llmserve {

// linear.cpp: out [M, N] = x [M, K] @ W.T; rows below many_rows through the integer dots (few rows), from there
// the many-rows path (integer GEMM or float32 tiles).
// int4 W: q [N, K / 2] (two values a byte), float16 scale and min [N, K / 32]; `q8_1`: x's int8 blocks stored as
// llama.cpp's Q8_1 (float16 scale and sum: a GGUF's Q4_0 / Q4_1 blocks, linear_dots.h's quantize_rows).
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale, const at::Tensor& minv,
                     int64_t many_rows, bool q8_1 = false);
// int8 W: q [N, K] with float32 scales [N, K / group] (or packed by oneDNN: [K, N], one scale a channel);
// act_bits: x's width on the dots (16, or 8: faster, less exact) and in the integer GEMM (two int8 levels, or one);
// w8a8's Hadamard block above its low byte (gemm.h's rotated_for), as q8_vnni_gemm's.
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale, int64_t many_rows,
                     int64_t act_bits);
// float32 W [N, K]: the GEMV below many_rows, gemm() from there.
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w, int64_t many_rows);
// argmax(x @ w.T) per row for float32 w, screened by its int8 copy (qw, scale, err); -1 for a row not finite.
at::Tensor head_argmax(const at::Tensor& x, const at::Tensor& w, const at::Tensor& qw, const at::Tensor& scale,
                       const at::Tensor& err);

// gemm.cpp: x [M, K] @ w [N, K].T, float32: at::linear or oneDNN's matmul (toggles.gemm_onednn; always oneDNN for a
// packed w).
at::Tensor gemm(const at::Tensor& x, const at::Tensor& w);
// x [M, K] times the block-diagonal Walsh-Hadamard matrix of blocks of hb (16, 32, 64), normalized (w8a8's rotation)
at::Tensor hadamard_rows(const at::Tensor& x, int64_t hb);

// vnni.cpp (use_vnni() only): x @ W.T for int8 W per channel in the VNNI layout [N / 16, K / 4, 16, 4] with its
// channel sums; and for int4 W as q4_linear takes it (N % 64 == 0).
at::Tensor q8_vnni_gemm(const at::Tensor& x, const at::Tensor& wv, const at::Tensor& csum, const at::Tensor& scale,
                        int64_t act_bits);
at::Tensor q4_vnni_gemm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale, const at::Tensor& minv,
                        bool q8_1 = false);
// Q8_0-like int8 (float32 scales per 32 values) times many rows, x rounded to int8 per 32 (q8_linear's act_bits 8)
at::Tensor q8b_vnni_gemm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale);

// norms.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps);   // residual += x; x = norm
void rotary_write_kv_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                      int64_t num_heads, int64_t num_kv_heads, int64_t D, at::Tensor& k_cache, at::Tensor& v_cache,
                      const at::Tensor& slot_mapping);
at::Tensor silu_and_mul(const at::Tensor& gate_up);

// attention_decode.cpp, attention_prefill.cpp: attention read in place from the paged cache into `out`.
// sinks: float32 [H] (gpt-oss), a logit per query head in each softmax's denominator; window: > 0, each query sees only
// the last `window` positions (its own included).
void paged_decode_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, double scale,
                             const std::optional<at::Tensor>& sinks = std::nullopt, int64_t window = 0);
void paged_prefill_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_table, int64_t context_len,
                              double scale, const std::optional<at::Tensor>& sinks = std::nullopt,
                              int64_t window = 0);

// sampling.cpp: one token per row of logits [R, V], drawn from softmax(logits / temps) by inverting its CDF at u.
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temps, const at::Tensor& u);

// lora.cpp: out[adapter rows] += x[rows] @ A^T @ B^T for one projection of one layer (the module path's hook).
struct LoRAWeights;
void lora_linear_add_(const at::Tensor& x, at::Tensor& out, const std::vector<int64_t>& segments,
                      const std::vector<std::shared_ptr<LoRAWeights>>& adapters, int64_t num_layers, int64_t layer,
                      int64_t proj, int64_t H, int64_t Hkv, int64_t D);

// decode_stack.cpp: one decoder layer for decode rows (DecodeStack, decode_stack.h, runs every layer).
std::tuple<at::Tensor, at::Tensor> decode_layer(
    at::Tensor x, std::optional<at::Tensor> residual_in, const std::vector<at::Tensor>& w, const std::vector<int64_t>& kinds,
    const std::vector<int64_t>& act_bits, const std::vector<int64_t>& many_rows, double eps, const at::Tensor& positions,
    const at::Tensor& cos, const at::Tensor& sin, int64_t H, int64_t Hkv, int64_t D, at::Tensor& kv_cache,
    const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& context_lens, double scale);

}  // namespace llmserve

// gguf_ops.cpp: GGUF's blocks read in place, raw a uint8 tensor [N, row_bytes] of qtype (a GGMLQuantizationType).
namespace llmserve::gguf {

// float32 [N, K]: the values of raw, bit-exact with the gguf package.
at::Tensor dequantize(const at::Tensor& raw, int64_t qtype, int64_t K);

// x [M, K] @ dequantize(raw).T: integer dots below many_rows rows, dequantized tiles + gemm() from there.
at::Tensor linear(const at::Tensor& x, const at::Tensor& raw, int64_t qtype, int64_t K, int64_t many_rows);

// The same product in float32 throughout (weights widened, activations as they are).
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& raw, int64_t qtype, int64_t K, int64_t few_rows);

// x [M, K] @ the parts' weights side by side (a packed projection whose parts may be of different types, as q /
// k / v in Q4_K_M files): `codes` one per part (projection_kinds.h: a GGUF type with integer dots, its blocks one
// tensor; or a packed Q4 / Q8 part, its q4_linear / q8_linear tensors, the int4 ones taking their many-rows path
// from `many_rows` rows). Every row of x is computed as linear() / q4_linear / q8_linear compute it (the same bits).
at::Tensor linear_parts(const at::Tensor& x, const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& codes,
                        int64_t many_rows);

}  // namespace llmserve::gguf
