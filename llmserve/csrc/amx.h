// The integer sums of many rows on AMX tiles (Intel's Advanced Matrix Extensions: Sapphire Rapids and later): what
// q8_vnni_gemm (vnni.cpp) runs from kAmxRows rows where the CPU has AMX-INT8. A tile dot product (tdpbusd) takes
// 16 rows x 64 u8 activations and 16 groups of 4 inputs x 16 channels of s8 weights: the weights' VNNI layout
// ([N / 16, K / 4, 16, 4], ops.vnni_pack) is already the instruction's B tile, so no copy of the weights is kept. The
// sums are integers, exact in any order: the same int32 as the VNNI kernel's and its twin's, and the same epilogue
// after them, so the output is the same bits whichever of the three ran.
#pragma once

#include <cstdint>

namespace llmserve {

// Rows of x from which q8_vnni_gemm runs its sums on AMX tiles (measured on one Sapphire Rapids core, 2 threads, int8
// weights 3072 x 8192 and 8192 x 3072, act_bits 8 / 16, against the VNNI kernel: 0.86-1.14x at 8 rows, 1.5 / 1.7x
// at 16, 2.3 / 2.6x at 32, 2.6 / 2.9x at 1,000; at SmolLM2's 576 x 1536, 1.3 / 1.2x at 16). Rows are padded to
// whole tiles of 32 per level of rounding: below 16 the padding costs what the tiles save.
inline constexpr int64_t kAmxRows = 16;

// Whether the AMX tiles run here: the CPU has AMX-TILE and AMX-INT8, Linux granted this process the tile state
// (asked once: arch_prctl ARCH_REQ_XCOMP_PERM), the VNNI kernels run on their instructions, and toggles.amx allows.
bool use_amx();
// toggles.amx_twin: the AMX path's portable twin (amx_sums_32's tile arithmetic in plain loops) in place of the
// tiles, on any CPU, so the driver's padding, chunking and epilogue are tested everywhere.
bool amx_path();

// The tile shapes amx_sums_32 uses (8 tiles of 16 rows x 64 bytes), loaded on this thread for the object's life
// (ldtilecfg / tilerelease). No-op for the twin.
struct AmxTiles {
  AmxTiles();
  ~AmxTiles();
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
  bool real;
};

// acc[r * 32 + c] (int32) = sum over k of xq[r * K + k] * w(c, k), for the 32 rows r of u8 activations at xq and
// `blocks` (1 or 2) blocks of 16 channels of VNNI-layout weights at wv (block j at wv + j * K * 16); K a multiple
// of 64. Inside an AmxTiles' life.
void amx_sums_32(const AmxTiles& tiles, const uint8_t* xq, int64_t K, const int8_t* wv, int blocks, int32_t* acc);

}  // namespace llmserve
