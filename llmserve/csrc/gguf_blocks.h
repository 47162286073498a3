// GGUF's quantized blocks as the file holds them, byte for byte (gguf_ops.cpp, gguf_dots.cpp): a weight is a uint8
// tensor [N, row_bytes], each row K values in the type's blocks.
//
// Each type is a struct (its layout in a comment, then how to read it): kValues values in kBytes bytes;
// quants(block, i) the i-th 32 quants as bytes, in value order; header(block) the scales. A value is
//   d_g * (q - kZero) + min_g     (g: its group of 16 values for the K-quants, the block otherwise)
// with q unsigned bytes, or signed ones where kSigned (Q8_0 and the IQ4 types, whose 4-bit indices quants() maps
// to their int8 values).
// Half floats ("f16") and all multi-byte fields are little endian.
#pragma once

#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace llmserve::gguf {

enum QType : int64_t {   // GGMLQuantizationType's numbers
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
  Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30, MXFP4 = 39,
  // not GGML's: Q4_K, Q6_K and MXFP4 repacked at load into panels of 16 rows (gguf_repacked.cpp)
  Q4_K16 = 100, Q6_K16 = 101, MXFP4_16 = 102,
};

// Whether qtype is one of the layouts repacked at load (gguf_repacked.cpp's kernels read them at every row count).
inline bool is_repacked(int64_t qtype) { return qtype == Q4_K16 || qtype == Q6_K16 || qtype == MXFP4_16; }
// The values of a repacked layout's blocks (x is rounded per as many): MXFP4's 32, the K-quants' 256.
inline int64_t repacked_block(int64_t qtype) { return qtype == MXFP4_16 ? 32 : 256; }

// The compiler may fuse a * b + c into one FMA (one rounding instead of NumPy's two); passing the
// product through here forbids that.
inline __m256 unfused(__m256 v) {
  asm("" : "+x"(v));
  return v;
}

inline __m256i low4() { return _mm256_set1_epi8(0x0F); }

// ---------------------------------------------------------------------------------------------
// The 32-value types: one scale d (and a min m for _1) per block of 32 values.

struct Scales32 {
  float d, m;
};

// Q4_0, 18 bytes: f16 d | qs[16]. Value j < 16: the low nibble of qs[j], j + 16: its high nibble;
// d * (q - 8).
struct TQ4_0 {
  static constexpr int64_t kValues = 32, kBytes = 18;
  static constexpr int kZero = 8;
  static constexpr bool kMin = false, kSigned = false;
  static Scales32 header(const uint8_t* b) { return {f16(b), 0.0f}; }
  static __m256i quants(const uint8_t* b) { return nibbles(b + 2); }
  static __m256i nibbles(const uint8_t* qs) {   // 16 bytes -> their low nibbles, then their high ones
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4());
  }
};

// Q4_1, 20 bytes: f16 d | f16 m | qs[16] as Q4_0's; d * q + m.
struct TQ4_1 {
  static constexpr int64_t kValues = 32, kBytes = 20;
  static constexpr int kZero = 0;
  static constexpr bool kMin = true, kSigned = false;
  static Scales32 header(const uint8_t* b) { return {f16(b), f16(b + 2)}; }
  static __m256i quants(const uint8_t* b) { return TQ4_0::nibbles(b + 4); }
};

// The fifth bits of Q5_0 / Q5_1: bit j of the little-endian uint32 qh is bit 4 of value j.
inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  // byte j of the vector gets byte j / 8 of qh; then keep bit j % 8 of it, and move it to bit 4
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(h)),
                                            _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                               0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}

// Q5_0, 22 bytes: f16 d | uint32 qh | qs[16]. q = Q4_0's nibble | (bit j of qh) << 4; d * (q - 16).
struct TQ5_0 {
  static constexpr int64_t kValues = 32, kBytes = 22;
  static constexpr int kZero = 16;
  static constexpr bool kMin = false, kSigned = false;
  static Scales32 header(const uint8_t* b) { return {f16(b), 0.0f}; }
  static __m256i quants(const uint8_t* b) { return _mm256_or_si256(TQ4_0::nibbles(b + 6), fifth_bits(b + 2)); }
};

// Q5_1, 24 bytes: f16 d | f16 m | uint32 qh | qs[16], q as Q5_0's; d * q + m.
struct TQ5_1 {
  static constexpr int64_t kValues = 32, kBytes = 24;
  static constexpr int kZero = 0;
  static constexpr bool kMin = true, kSigned = false;
  static Scales32 header(const uint8_t* b) { return {f16(b), f16(b + 2)}; }
  static __m256i quants(const uint8_t* b) { return _mm256_or_si256(TQ4_0::nibbles(b + 8), fifth_bits(b + 4)); }
};

// Q8_0, 34 bytes: f16 d | int8 qs[32]; q * d.
struct TQ8_0 {
  static constexpr int64_t kValues = 32, kBytes = 34;
  static constexpr int kZero = 0;
  static constexpr bool kMin = false, kSigned = true;
  static Scales32 header(const uint8_t* b) { return {f16(b), 0.0f}; }
  static __m256i quants(const uint8_t* b) { return load32(b + 2); }
};

// The IQ4 types' 16 values (a non-linear table of int8, the same in every file): 4-bit indices -> int8 within
// each 128-bit lane (the table in both lanes).
inline __m256i iq4_values(__m256i indices) {
  const __m128i t = _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
  return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), indices);
}

// IQ4_NL, 18 bytes: f16 d | qs[16], indices into iq4_values in Q4_0's nibble order; d * value (signed quants).
struct TIQ4_NL {
  static constexpr int64_t kValues = 32, kBytes = 18;
  static constexpr int kZero = 0;
  static constexpr bool kMin = false, kSigned = true;
  static Scales32 header(const uint8_t* b) { return {f16(b), 0.0f}; }
  static __m256i quants(const uint8_t* b) { return iq4_values(TQ4_0::nibbles(b + 2)); }
};

// MXFP4 (OCP microscaling, gpt-oss's experts), 17 bytes: uint8 e | qs[16], 4-bit E2M1 indices in Q4_0's nibble order.
// The table holds E2M1's values doubled (integers, signed quants) and d = 2^(e - 128), half the E8M0 scale 2^(e - 127):
// ggml's e8m0_to_fp32_half, whose bits for e < 2 are the subnormals 2^-128 and 2^-127.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float d;
  std::memcpy(&d, &bits, 4);
  return d;
}

inline __m256i mxfp4_values(__m256i indices) {
  const __m128i t = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), indices);
}

struct TMXFP4 {
  static constexpr int64_t kValues = 32, kBytes = 17;
  static constexpr int kZero = 0;
  static constexpr bool kMin = false, kSigned = true;
  static Scales32 header(const uint8_t* b) { return {e8m0_half(b[0]), 0.0f}; }
  static __m256i quants(const uint8_t* b) { return mxfp4_values(TQ4_0::nibbles(b + 1)); }
};

// ---------------------------------------------------------------------------------------------
// The K-quants: super-blocks of 256 values, an f16 d (and dmin) scaling small integer scales (and mins)
// of 16- or 32-value groups. header() gives them per 16 values: sc[g], mn[g] (int8), so that value k
// of group g is (d * sc[g]) * (q - kZero) - dmin * mn[g].

struct ScalesK {
  float d, dmin;
  __m128i sc, mn;   // 16 int8 each, one per 16 values
};

// Q2_K, 84 bytes: scales[16] | qs[64] | f16 d | f16 dmin. Group g of 16 values: a 4-bit scale (the low nibble of
// scales[g]) and min (the high one). Sub-block i = 4h + j (32 values): bits 2j, 2j + 1 of qs[32h .. 32h + 31].
// Value: (d * scale) * q - dmin * min.
struct TQ2_K {
  static constexpr int64_t kValues = 256, kBytes = 84;
  static constexpr int kZero = 0;
  static constexpr bool kMin = true, kSigned = false;
  static ScalesK header(const uint8_t* b) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), low = _mm_set1_epi8(0x0F);
    return {f16(b + 80), f16(b + 82), _mm_and_si128(v, low), _mm_and_si128(_mm_srli_epi16(v, 4), low)};
  }
  static __m256i two_bits(const uint8_t* qs, int i) {   // sub-block i's 2-bit fields of 32 bytes qs[32 * (i / 4) ..]
    return _mm256_and_si256(_mm256_srli_epi16(load32(qs + 32 * (i / 4)), 2 * (i % 4)), _mm256_set1_epi8(3));
  }
  static __m256i quants(const uint8_t* b, int i) { return two_bits(b + 16, i); }
};

// Q3_K, 110 bytes: hmask[32] | qs[64] | scales[12] | f16 d. Sixteen 6-bit scales less 32: group g's low 4 bits are
// the low (g < 8) or high (g >= 8) nibble of scales[g % 8], its high 2 bits bits 2 (g / 4), + 1 of scales[8 + g % 4].
// Value l of sub-block i: Q2_K's 2 bits from qs, less 4 where bit i of hmask[l] is clear: q = low | bit << 2, and
// (d * scale) * (q - 4).
struct TQ3_K {
  static constexpr int64_t kValues = 256, kBytes = 110;
  static constexpr int kZero = 4;
  static constexpr bool kMin = false, kSigned = false;
  static ScalesK header(const uint8_t* b) {
    uint32_t a[3];
    std::memcpy(a, b + 96, 12);
    const uint32_t n = 0x0F0F0F0F, h = 0x03030303;
    const __m128i v = _mm_setr_epi32(static_cast<int>((a[0] & n) | (a[2] & h) << 4),
                                     static_cast<int>((a[1] & n) | (a[2] >> 2 & h) << 4),
                                     static_cast<int>((a[0] >> 4 & n) | (a[2] >> 4 & h) << 4),
                                     static_cast<int>((a[1] >> 4 & n) | (a[2] >> 6 & h) << 4));
    return {f16(b + 108), 0.0f, _mm_sub_epi8(v, _mm_set1_epi8(32)), _mm_setzero_si128()};
  }
  static __m256i quants(const uint8_t* b, int i) {
    const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(load32(b), i), _mm256_set1_epi8(1));
    return _mm256_or_si256(TQ2_K::two_bits(b + 32, i), _mm256_slli_epi16(bit, 2));
  }
};

// IQ4_XS, 136 bytes: f16 d | uint16 scales_h | scales_l[4] | qs[128]. Eight 32-value sub-blocks, each a 6-bit
// scale less 32 (low 4 bits: nibble i % 2 of scales_l[i / 2], high 2: bits 2i, 2i + 1 of scales_h); sub-block i:
// qs[16i .. 16i + 15] as IQ4_NL's. Value: (d * scale) * value (signed quants; one scale per 32 values).
struct TIQ4_XS {
  static constexpr int64_t kValues = 256, kBytes = 136;
  static constexpr int kZero = 0;
  static constexpr bool kMin = false, kSigned = true;
  static ScalesK header(const uint8_t* b) {
    const int hi = b[2] | b[3] << 8;
    alignas(16) int8_t sc[16];
    for (int i = 0; i < 8; ++i) {
      const int low = b[4 + i / 2] >> 4 * (i % 2) & 15, high = hi >> 2 * i & 3;
      sc[2 * i] = sc[2 * i + 1] = static_cast<int8_t>((low | high << 4) - 32);
    }
    return {f16(b), 0.0f, _mm_load_si128(reinterpret_cast<const __m128i*>(sc)), _mm_setzero_si128()};
  }
  static __m256i quants(const uint8_t* b, int i) { return iq4_values(TQ4_0::nibbles(b + 8 + 16 * i)); }
};

// Q4_K, 144 bytes: f16 d | f16 dmin | scales[12] | qs[128]. Eight 32-value sub-blocks, each with a 6-bit
// scale and min packed in `scales`: for j < 4 the low 6 bits of bytes j (scale) and j + 4 (min); for
// j >= 4 the scale is (byte j + 4 & 15) | (byte j - 4 >> 6) << 4, the min (byte j + 4 >> 4) | (byte j >> 6)
// << 4. qs[32c .. 32c + 31]: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1.
// Value: (d * scale) * q - dmin * min.
struct TQ4_K {
  static constexpr int64_t kValues = 256, kBytes = 144;
  static constexpr int kZero = 0;
  static constexpr bool kMin = true, kSigned = false;
  static ScalesK header(const uint8_t* b) {
    uint32_t u[3];
    std::memcpy(u, b + 4, 12);
    const uint32_t sc_lo = u[0] & 0x3F3F3F3F, mn_lo = u[1] & 0x3F3F3F3F;
    const uint32_t sc_hi = (u[2] & 0x0F0F0F0F) | ((u[0] >> 2) & 0x30303030);
    const uint32_t mn_hi = ((u[2] >> 4) & 0x0F0F0F0F) | ((u[1] >> 2) & 0x30303030);
    const __m128i v = _mm_setr_epi32(static_cast<int>(sc_lo), static_cast<int>(sc_hi), static_cast<int>(mn_lo),
                                     static_cast<int>(mn_hi));   // bytes: 8 scales, 8 mins
    const __m128i twice = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);   // one per 16 values
    return {f16(b), f16(b + 2), _mm_shuffle_epi8(v, twice), _mm_shuffle_epi8(v, _mm_add_epi8(twice, _mm_set1_epi8(8)))};
  }
  static __m256i quants(const uint8_t* b, int i) { return low_or_high(load32(b + 16 + 32 * (i / 2)), i % 2); }
  static __m256i low_or_high(__m256i v, int high) {
    return _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, low4());
  }
};

// Q5_K, 176 bytes: f16 d | f16 dmin | scales[12] | qh[32] | qs[128]. As Q4_K, and bit i of qh[l] is bit 4
// of value l of sub-block i.
struct TQ5_K {
  static constexpr int64_t kValues = 256, kBytes = 176;
  static constexpr int kZero = 0;
  static constexpr bool kMin = true, kSigned = false;
  static ScalesK header(const uint8_t* b) { return TQ4_K::header(b); }
  static __m256i quants(const uint8_t* b, int i) {
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(load32(b + 16), i), _mm256_set1_epi8(1));
    return _mm256_or_si256(TQ4_K::low_or_high(load32(b + 48 + 32 * (i / 2)), i % 2), _mm256_slli_epi16(hi, 4));
  }
};

// Q6_K, 210 bytes: ql[128] | qh[64] | int8 scales[16] | f16 d. Two halves of 128 values; in half h, with
// L = ql + 64h and H = qh + 32h, value l of its four 32-value quarters is
//   (L[l] & 15 | (H[l] & 3) << 4), (L[l + 32] & 15 | (H[l] >> 2 & 3) << 4),
//   (L[l] >> 4 | (H[l] >> 4 & 3) << 4), (L[l + 32] >> 4 | (H[l] >> 6) << 4).
// One scale per 16 values; value: (d * scale) * (q - 32).
struct TQ6_K {
  static constexpr int64_t kValues = 256, kBytes = 210;
  static constexpr int kZero = 32;
  static constexpr bool kMin = false, kSigned = false;
  static ScalesK header(const uint8_t* b) {
    return {f16(b + 208), 0.0f, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)), _mm_setzero_si128()};
  }
  static __m256i quants(const uint8_t* b, int i) {
    const int h = i / 4, quarter = i % 4;
    const __m256i low = TQ4_K::low_or_high(load32(b + 64 * h + 32 * (quarter % 2)), quarter / 2);
    const __m256i H = load32(b + 128 + 32 * h);
    // bits 2 * quarter and 2 * quarter + 1 of H, moved to bits 4 and 5 (16-bit shifts: the mask drops
    // what crosses from the neighbouring byte)
    const __m256i two = quarter == 0 ? _mm256_slli_epi16(H, 4) : quarter == 1 ? _mm256_slli_epi16(H, 2)
                        : quarter == 2 ? H : _mm256_srli_epi16(H, 2);
    return _mm256_or_si256(low, _mm256_and_si256(two, _mm256_set1_epi8(0x30)));
  }
};

// f(T{}) with T the struct of a quantized qtype; false for the plain types (F32, F16, BF16).
template <typename F>
bool with_quant_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case Q4_0: f(TQ4_0{}); return true;
    case Q4_1: f(TQ4_1{}); return true;
    case Q5_0: f(TQ5_0{}); return true;
    case Q5_1: f(TQ5_1{}); return true;
    case Q8_0: f(TQ8_0{}); return true;
    case IQ4_NL: f(TIQ4_NL{}); return true;
    case Q2_K: f(TQ2_K{}); return true;
    case Q3_K: f(TQ3_K{}); return true;
    case Q4_K: f(TQ4_K{}); return true;
    case Q5_K: f(TQ5_K{}); return true;
    case Q6_K: f(TQ6_K{}); return true;
    case IQ4_XS: f(TIQ4_XS{}); return true;
    case MXFP4: f(TMXFP4{}); return true;
    default: return false;
  }
}

// Q4_0, Q4_1 and Q8_0 have llmserve's own kernel family (linear.cpp's q4_linear / q8_linear, on the blocks
// repacked at load: llmserve/model/formats/gguf_kernels.py's repack): their structs above serve dequantization only.
// f(T{}) for the types whose integer dots are gguf_dots.cpp's (Q5_0, Q5_1, IQ4_NL, MXFP4, the K-quants, IQ4_XS); false
// otherwise.
template <typename F>
bool with_dot_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case Q5_0: f(TQ5_0{}); return true;
    case Q5_1: f(TQ5_1{}); return true;
    case IQ4_NL: f(TIQ4_NL{}); return true;
    case Q2_K: f(TQ2_K{}); return true;
    case Q3_K: f(TQ3_K{}); return true;
    case Q4_K: f(TQ4_K{}); return true;
    case Q5_K: f(TQ5_K{}); return true;
    case Q6_K: f(TQ6_K{}); return true;
    case IQ4_XS: f(TIQ4_XS{}); return true;
    case MXFP4: f(TMXFP4{}); return true;
    default: return false;
  }
}

// The row layout of raw for qtype and K; raw's rows may be strided (stride(0) >= row_bytes).
struct Layout {
  int64_t N, row_bytes, ld;
  const uint8_t* p;
};


// raw's layout for qtype and K, checked (`what`: the caller's name in the errors).
Layout check_layout(const at::Tensor& raw, int64_t qtype, int64_t K, const char* what);

// Row n of w widened to float32 (bit-exact with the gguf package's NumPy code).
void dequant_any_row(const Layout& w, int64_t qtype, int64_t K, int64_t n, float* out);

// One GGUF tensor of a projection: its N rows are the output's columns [col, col + N).
struct Part {
  Layout w;
  int64_t qtype, col;
};

// out [M, ldo]: every part's columns = x @ dequantize(part).T through the integer dots (with_dot_type's types
// only). x is rounded once per block size; one parallel region over all the parts' rows.
void dot_parts(const at::Tensor& x, const std::vector<Part>& parts, int64_t ldo, float* op);

}  // namespace llmserve::gguf
