// AMX tiles for the integer sums of q8_vnni_gemm (amx.h). Compiled per function for AMX-TILE + AMX-INT8, reached
// only where use_amx() holds; the twin (toggles.amx_twin) makes the same sums in plain loops on any CPU.
#include "amx.h"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "isa.h"

#define LLMSERVE_AMX __attribute__((target("amx-tile,amx-int8")))

namespace llmserve {

namespace {

// ldtilecfg's 64-byte operand (palette 1: 8 tiles of up to 16 rows x 64 bytes)
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool cpu_grants_amx() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;  // AMX-TILE, AMX-INT8
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // Linux: ask for the tile data state
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

LLMSERVE_AMX void load_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  asm volatile("ldtilecfg %0" : : "m"(c));  // (GCC 12 drops the stores before _tile_loadconfig: its builtin reads no memory)
}

LLMSERVE_AMX void release_tiles() { _tile_release(); }

// tiles 0..3: sums (rows 0-15 x block 0, rows 0-15 x block 1, rows 16-31 x block 0, rows 16-31 x block 1);
// 4, 5: the two 16-row halves of the activations; 6, 7: the two weight blocks; 64 inputs a step
LLMSERVE_AMX void tile_sums(const uint8_t* xq, int64_t K, const int8_t* wv, int blocks, int32_t* acc) {
  const int8_t* b0 = wv;
  const int8_t* b1 = wv + K * 16;
  _tile_zero(0);
  _tile_zero(2);
  if (blocks == 2) {
    _tile_zero(1);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 64) {
      _tile_loadd(4, xq + k, K);
      _tile_loadd(5, xq + 16 * K + k, K);
      _tile_loadd(6, b0 + k * 16, 64);
      _tile_loadd(7, b1 + k * 16, 64);
      _tile_dpbusd(0, 4, 6);
      _tile_dpbusd(1, 4, 7);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    }
    _tile_stored(1, acc + 16, 128);
    _tile_stored(3, acc + 16 * 32 + 16, 128);
  } else {
    for (int64_t k = 0; k < K; k += 64) {
      _tile_loadd(4, xq + k, K);
      _tile_loadd(5, xq + 16 * K + k, K);
      _tile_loadd(6, b0 + k * 16, 64);
      _tile_dpbusd(0, 4, 6);
      _tile_dpbusd(2, 5, 6);
    }
  }
  _tile_stored(0, acc, 128);
  _tile_stored(2, acc + 16 * 32, 128);
}

// The twin: each sum as tdpbusd makes it (u8 x s8 products of 4 inputs added to the int32 sum), in plain loops.
void tile_sums_twin(const uint8_t* xq, int64_t K, const int8_t* wv, int blocks, int32_t* acc) {
  for (int r = 0; r < 32; ++r)
    for (int c = 0; c < 16 * blocks; ++c) {
      const int8_t* w = wv + (c / 16) * K * 16 + (c % 16) * 4;
      int32_t a = 0;
      for (int64_t k = 0; k < K; ++k) a += static_cast<int32_t>(xq[r * K + k]) * w[(k / 4) * 64 + k % 4];
      acc[r * 32 + c] = a;
    }
}

}  // namespace

bool use_amx() { return toggles.amx && !toggles.amx_twin && use_vnni() && !toggles.vnni_twin && cpu_grants_amx(); }
bool amx_path() { return toggles.amx_twin || use_amx(); }

AmxTiles::AmxTiles() : real(use_amx()) {
  if (real) load_tiles();
}

AmxTiles::~AmxTiles() {
  if (real) release_tiles();
}

void amx_sums_32(const AmxTiles& tiles, const uint8_t* xq, int64_t K, const int8_t* wv, int blocks, int32_t* acc) {
  if (tiles.real)
    tile_sums(xq, K, wv, blocks, acc);
  else
    tile_sums_twin(xq, K, wv, blocks, acc);
}

}  // namespace llmserve
