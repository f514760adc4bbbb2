// AVX-512 pieces shared by the AVX-512 and AMX translation units, which have BF16 and VBMI (each
// includes this after its own target pragma and after moe_generic.h; internal linkage, so each
// gets its own copy): the decode of one packed fp8 line into bf16 pairs, on top of the pieces
// every AVX-512 unit shares (moe_avx512_common.h).
//
// A 64-byte line of the fp8 layout ([Kd/4][16][4] bytes, each row's 4 bytes in the order
// k+2, k, k+3, k+1; see moe_kernels.h) is 16 rows x 4 k; it decodes to the bf16 pairs (k, k+1)
// and (k+2, k+3) of every row: two lines of the bf16 layout ([Kd/2][16][2]), which is also AMX's
// VNNI layout for a B tile. Each value is exact (value / 256, the scale folds the 256 back),
// subnormals included: a line of normal numbers by shifts in place, any other line by 128-entry
// byte tables (AVX512-VBMI); no conversion instruction and no permute on the common path.
#pragma once
#include <immintrin.h>

#include "moe_avx512_common.h"

namespace moelab {
namespace {

struct Fp8Tables {
  __m512i lo0, lo1, hi0, hi1;  // low / high bytes of the bf16 of magnitudes 0-63, 64-127 (/ 256)
  __m512i idx01, idx23;        // output byte -> line byte, for the (k, k+1) and (k+2, k+3) pairs
};

inline const Fp8Tables& fp8_tables() {
  static const Fp8Tables t = [] {
    alignas(64) uint8_t lo[128], hi[128], i01[64], i23[64];
    for (int j = 0; j < 128; ++j) {  // fp8_lut's value / 256 has at most 4 significant bits: its bf16 is exact
      const uint32_t bits = f32_to_bits(fp8_lut()[j]);
      lo[j] = uint8_t(bits >> 16);
      hi[j] = uint8_t(bits >> 24);
    }
    for (int r = 0; r < 16; ++r)  // row r's bytes 4 r .. 4 r + 3 hold k + 2, k, k + 3, k + 1
      for (int b = 0; b < 4; ++b) {  // output bytes 4 r, 4 r + 1: the first value of the pair
        i01[4 * r + b] = uint8_t(4 * r + (b >> 1 ? 3 : 1));
        i23[4 * r + b] = uint8_t(4 * r + (b >> 1 ? 2 : 0));
      }
    Fp8Tables v;
    v.lo0 = _mm512_load_si512(lo);
    v.lo1 = _mm512_load_si512(lo + 64);
    v.hi0 = _mm512_load_si512(hi);
    v.hi1 = _mm512_load_si512(hi + 64);
    v.idx01 = _mm512_load_si512(i01);
    v.idx23 = _mm512_load_si512(i23);
    return v;
  }();
  return t;
}

// One output vector: each row's byte pair moved into its 32-bit lane (vpermb), then the low
// bf16 byte looked up at even bytes and the high byte at odd ones (vpermi2b on the magnitude),
// the sign bit or-ed into the high byte.
inline __m512i fp8_pairs(const Fp8Tables& t, __m512i v, __m512i idx) {
  constexpr __mmask64 kEven = 0x5555555555555555ull;
  const __m512i d = _mm512_permutexvar_epi8(idx, v);
  const __m512i lo = _mm512_mask2_permutex2var_epi8(t.lo0, d, kEven, t.lo1);
  const __m512i w = _mm512_mask2_permutex2var_epi8(t.hi0, lo, ~kEven, t.hi1);
  return _mm512_ternarylogic_epi32(w, d, _mm512_set1_epi16(int16_t(0x8000)), 0xF8);
}

// The bf16 of value / 256 for the fp8 byte in the high byte of each 16-bit lane, for a normal
// magnitude u = b & 0x7F (8 <= u < 127): sign | u << 4 with the exponent raised by 112
// (bf16 bias 127 = e4m3's 7 + 8 for the / 256 + 112). An arithmetic shift by 4 puts the sign at
// bit 11 and copies it up to bit 15, u at bits 10..4. The exponent field e <= 15 and 112 share no
// bit, so adding 112 << 7 is an or: one ternary-logic op, (shifted & 0x87F0) | 0x3800.
inline __m512i fp8_high_bytes_to_bf16(__m512i w) {
  return _mm512_ternarylogic_epi32(_mm512_srai_epi16(w, 4), _mm512_set1_epi16(int16_t(0x87F0)),
                                   _mm512_set1_epi16(int16_t(112 << 7)), 0xEA);
}

// t: fp8_tables(), copied into a local by the caller's loop so the tables stay in registers.
// In the 16-bit lanes of a line, lane 2 r holds (row r, k + 2) low and (row r, k) high, lane
// 2 r + 1 holds k + 3 and k + 1: the high bytes decode in place to row r's pair (k, k + 1) in
// 32-bit lane r, the low bytes (shifted up) to (k + 2, k + 3). A line with a zero or a
// subnormal (exponent field 0: one test against 0x78) takes the byte tables; NaN bytes never
// reach a kernel (packing refuses them). Both give the same bits for a normal number.
inline void fp8_line_to_bf16(const Fp8Tables& t, const uint8_t* line, __m512i& p01, __m512i& p23) {
  const __m512i v = _mm512_load_si512(line);
  if (_mm512_testn_epi8_mask(v, _mm512_set1_epi8(0x78))) {
    p01 = fp8_pairs(t, v, t.idx01);
    p23 = fp8_pairs(t, v, t.idx23);
    return;
  }
  p01 = fp8_high_bytes_to_bf16(v);                          // k, k + 1
  p23 = fp8_high_bytes_to_bf16(_mm512_slli_epi16(v, 8));  // k + 2, k + 3
}

}  // namespace
}  // namespace moelab
