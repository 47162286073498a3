// The instruction sets llmserve's kernels are built for, what this CPU has, and the process-wide switches.
//
// Every file is compiled for AVX2 + FMA + F16C (llmserve/model/kernels/cpu_ext.py's flags): that is the floor, and a CPU
// without AVX2 never loads the module. Wider variants are compiled per function with one of the target
// macros below (the rest of a file stays AVX2) and chosen at run time: a kernel asks avx512_kernels() / avx512_real()
// or vnni_kernels() / vnni_real() (below) and keeps an AVX2 path beside the wide one. One meaning for each macro:
//   LLMSERVE_AVX512       AVX-512 F/BW/DQ/VL                 (use_avx512())
//   LLMSERVE_AVX512_VNNI  the same + VNNI (vpdpbusd, vpdpwssd) (use_vnni())
//   (AMX tiles: amx.cpp's own target, use_amx() in amx.h)
//   LLMSERVE_AVX512_BF16  the same + BF16 (vdpbf16ps)          (cpu_has_avx512_bf16(); no kernel of ours yet:
//                         bfloat16 projections run oneDNN's matmul, llmserve/model/formats/bf16.py)
#pragma once

#include <immintrin.h>

#include <cstdint>

#define LLMSERVE_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#define LLMSERVE_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#define LLMSERVE_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

namespace llmserve {

// The process-wide switches, one instance for the module: set from Python (llmserve/model/kernels/cpu_ext.py, through
// bindings.cpp's set_* functions) when the module loads and whenever configure (cpu_ext.py) changes them.
struct Toggles {
  bool avx512 = true;         // envs.LLMSERVE_AVX512: the AVX-512 variants may run (where the CPU has them)
  bool gemm_onednn = false;   // gemm() runs oneDNN's matmul, else at::linear (ops.gemm_engine)
  bool q8_int_gemm = true;    // many rows of per-channel int8: the integer GEMM, else float32 tiles (KernelConfig.int8_gemm)
  bool q4_vnni = true;        // many rows of int4: the VNNI integer GEMM, else float32 tiles (KernelConfig.int4_vnni)
  int64_t kq_panel_rows = 12; // K-quant dots from this many rows: panels of 16 weight rows (KernelConfig.kquant_panel_rows)
  int64_t q8_block_rows = 4;  // Q8_0 x Q8_0 (q8_linear's group 32, 8-bit x) from this many rows: q8b_vnni_gemm
  bool vnni_twin = false;     // the VNNI kernels' portable twins in place of the instructions, on any CPU (LLMSERVE_VNNI)
  bool avx512_twin = false;   // the AVX-512 kernels' portable twins in place of the instructions, on any CPU (LLMSERVE_AVX512)
  bool amx = true;            // q8_vnni_gemm's many rows on AMX tiles where the CPU has them (LLMSERVE_AMX; amx.h)
  bool amx_twin = false;      // the AMX path with its tiles' portable twin, on any CPU (LLMSERVE_AMX=twin)
};
inline Toggles toggles;

// What cpuid reports (asked once).
inline bool cpu_has_avx512() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  }();
  return ok;
}

inline bool cpu_has_avx512_vnni() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
  }();
  return ok;
}

inline bool cpu_has_avx512_bf16() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  }();
  return ok;
}

// Whether the LLMSERVE_AVX512 / LLMSERVE_AVX512_VNNI variants run: the CPU has them and they are allowed.
inline bool use_avx512() { return toggles.avx512 && cpu_has_avx512(); }
inline bool use_vnni() { return use_avx512() && cpu_has_avx512_vnni(); }

// The kernels of VNNI's layouts (vnni.cpp's integer GEMMs, gguf_panels.cpp): whether they run (vnni_kernels(): the
// instructions, or their portable twins where toggles.vnni_twin asks), and whether by the instructions (vnni_real()).
// A twin sums the same integers and makes the same float operations in the same order: the same bits, on any CPU.
inline bool vnni_kernels() { return use_vnni() || toggles.vnni_twin; }
inline bool vnni_real() { return use_vnni() && !toggles.vnni_twin; }

// The same for the AVX-512 kernels (linear.cpp's float32 GEMV and int8 x int16 dots; the prefill attention, whose
// twin is its AVX2 variant): avx512_kernels() whether they run (the instructions, or their portable twins where
// toggles.avx512_twin asks), avx512_real() whether by the instructions; otherwise their AVX2 counterparts run.
inline bool avx512_kernels() { return use_avx512() || toggles.avx512_twin; }
inline bool avx512_real() { return use_avx512() && !toggles.avx512_twin; }

}  // namespace llmserve
