// Every Python binding of the extension module (llmserve/model/kernels/cpu_ext.py builds it from csrc/*.cpp; ops.py and
// gguf_kernels.py are the seams that call it). The only file that includes pybind11, with torch's casters for tensors (torch/extension.h,
// the whole torch C++ API, takes three times as long to compile: not needed).
#include <torch/csrc/utils/pybind.h>

#include "amx.h"
#include "decode_stack.h"
#include "gguf_panels.h"
#include "isa.h"
#include "kernels.h"
#include "lora.h"
#include "projection_kinds.h"

using namespace llmserve;

// The kernels that run long let go of the GIL: the server's event loop (llmserve/engine/async_engine.py runs the
// engine on its own thread) streams tokens meanwhile instead of waiting for the step to end.
const auto kNoGIL = py::call_guard<py::gil_scoped_release>();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the process-wide switches (isa.h's Toggles)
  m.def("set_avx512", [](bool allowed) { toggles.avx512 = allowed; return use_avx512(); },
        "allow the AVX-512 kernels or not; returns whether the instructions run (the CPU has them)");
  m.def("set_gemm_engine", [](bool onednn) { toggles.gemm_onednn = onednn; return onednn; },
        "true: gemm() runs oneDNN's matmul, false: at::linear");
  m.def("set_q8_int_gemm", [](bool on) { toggles.q8_int_gemm = on; return on; },
        "many rows on per-channel int8 weights: integer GEMM (true) or float32 tiles");
  m.def("set_q4_vnni", [](bool on) { toggles.q4_vnni = on; return on; },
        "whether q4_linear's many rows take the VNNI integer GEMM (else float32 tiles)");
  m.def("set_kquant_panels", [](int64_t rows) { toggles.kq_panel_rows = rows; },
        "K-quant dots of at least `rows` rows over panels of 16 weight rows (where the VNNI kernels run)");
  m.def("set_q8_block_rows", [](int64_t rows) { toggles.q8_block_rows = rows; },
        "Q8_0 x Q8_0 (q8_linear, group 32, 8-bit x) from `rows` rows: the VNNI integer GEMM (where the VNNI kernels run)");
  m.def("set_vnni_twin", [](bool on) { toggles.vnni_twin = on; return vnni_kernels(); },
        "the VNNI kernels' portable twins in place of the instructions (any CPU); returns uses_vnni()");
  m.def("set_avx512_twin", [](bool on) { toggles.avx512_twin = on; return avx512_kernels(); },
        "the AVX-512 kernels' portable twins in place of the instructions (any CPU); returns uses_avx512()");
  m.def("set_amx", [](bool on, bool twin) { toggles.amx = on; toggles.amx_twin = twin; return amx_path(); },
        "q8_vnni_gemm's many rows on AMX tiles (where the CPU has them) or not; twin: the tiles' portable twin, any CPU;"
        " returns whether that path runs");
  m.def("uses_amx", &amx_path, "whether q8_vnni_gemm's many rows take the AMX path (the tiles, or their twin)");
  m.def("amx_real", &use_amx, "whether that path runs on the AMX tiles (not their twin)");
  m.def("uses_avx512", &avx512_kernels, "whether the AVX-512 kernels run here (AVX-512, allowed; or their twins)");
  m.def("avx512_real", &avx512_real, "whether the AVX-512 kernels run on the instructions (not their twins)");
  m.def("uses_vnni", &vnni_kernels, "whether the VNNI kernels run here (AVX-512 VNNI, allowed; or their twins)");
  m.def("vnni_real", &vnni_real, "whether the VNNI kernels run on the instructions (not their twins)");
  // linear.cpp, gemm.cpp, vnni.cpp
  m.def("q4_linear", &q4_linear, "x @ W.T, W int4 (32-value groups, scale and min); q8_1: x rounded as llama.cpp's Q8_1",
        py::arg("x"), py::arg("qw"), py::arg("scale"), py::arg("minv"), py::arg("many_rows"), py::arg("q8_1") = false,
        kNoGIL);
  m.def("q8_linear", &q8_linear, "x @ W.T, W int8 (groups with a scale each)", kNoGIL);
  m.def("q8_vnni_gemm", &q8_vnni_gemm, "x @ W.T, W int8 per channel in the VNNI layout, activations as q8_int_gemm's", kNoGIL);
  m.def("hadamard_rows", &hadamard_rows, "x [M, K] times the block-diagonal Walsh-Hadamard matrix of blocks of hb, normalized",
        kNoGIL);
  m.def("f32_linear", &f32_linear, "x @ W.T, W float32, few rows", kNoGIL);
  m.def("gemm", &gemm, "x @ W.T, W float32: at::linear or oneDNN's matmul (set_gemm_engine)", kNoGIL);
  m.def("head_argmax", &head_argmax, "argmax(x @ W.T) per row, W float32 screened by its int8 copy", kNoGIL);
  // norms.cpp
  m.def("rms_norm", &rms_norm, "RMSNorm");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = RMSNorm(residual), in place");
  m.def("rotary_write_kv_", &rotary_write_kv_, "neox rotary of the q and k heads of qkv rows in place; K, V into the cache");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  // gguf_ops.cpp
  m.def("gguf_dequantize", &gguf::dequantize, "GGUF blocks uint8 [N, row_bytes] -> float32 [N, K]");
  m.def("gguf_linear", &gguf::linear, "x [M, K] @ dequantize(raw).T, read from the GGUF blocks", kNoGIL);
  m.def("gguf_linear_f32", &gguf::linear_f32, "x [M, K] @ dequantize(raw).T in float32 (weights widened)", kNoGIL);
  m.def("gguf_linear_parts", &gguf::linear_parts, "x @ [parts' weights].T side by side (codes: projection_kinds.h)",
        kNoGIL);
  m.attr("packed_part") = kPackedPart;
  m.def("gguf_repack_panels", &gguf::repack_panels, "a Q4_K / Q6_K tensor's blocks in panels of 16 rows (gguf_repacked.cpp)");
  m.def("gguf_uses_avx512", &use_vnni, "whether the AVX-512 VNNI K-quant dots may run on the instructions");
  // attention_decode.cpp, attention_prefill.cpp, sampling.cpp
  m.def("paged_prefill_attention_", &paged_prefill_attention_, "a prefill chunk's causal attention over the paged KV cache",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
        py::arg("context_len"), py::arg("scale"), py::arg("sinks") = py::none(), py::arg("window") = 0, kNoGIL);
  m.def("paged_decode_attention_", &paged_decode_attention_, "decode attention over the paged KV cache",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("sinks") = py::none(), py::arg("window") = 0, kNoGIL);
  m.def("sample_rows", &sample_rows, "one token per row of logits, drawn by inverting its CDF at u");
  // decode_stack.cpp, lora.cpp
  m.def("projection_kinds", [] {
    py::dict kinds;
    for (const auto& k : kProjectionKinds) kinds[k.name] = static_cast<int64_t>(k.kind);
    return kinds;
  }, "decode_layer's projection kinds, {name: value} (llmserve/model/kernels/kinds.py's ProjectionKind holds the same)");
  m.def("decode_layer", &decode_layer, "one decoder layer for decode rows, all in C++", kNoGIL);
  m.def("lora_linear_add_", &lora_linear_add_, "out[adapter rows] += x[rows] @ A^T @ B^T (one projection)");
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<const DecodeStack::Args&, double, at::Tensor, at::Tensor, int64_t, int64_t, int64_t, double>())
      .def("run", &DecodeStack::run, "every layer's decode_layer in turn", kNoGIL)
      .def("run_lora", &DecodeStack::run_lora, "run, with LoRA adapters' updates on their rows", kNoGIL);
  pybind11::class_<LoRAWeights, std::shared_ptr<LoRAWeights>>(m, "LoRAWeights")
      .def(pybind11::init<std::vector<at::Tensor>>());
}
