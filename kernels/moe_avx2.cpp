// AVX2/FMA fallback (Haswell and later, Zen 1 and later). Same packed layout as the
// AVX-512 path; a 16-row tile is two 8-lane halves. bf16 weights are widened to fp32
// (even/odd halves of each 32-bit pair); int8 uses the vpsignb/vpmaddubsw trick on the
// signed value (no saturation for |q|, |x| <= 127); int4 uses vpmaddubsw on the
// unsigned nibble and the same offset correction as the AVX-512 path. fp8 (e4m3) bytes
// are decoded in the decode regime by shifts and a mask straight into fp32 bit patterns
// (value * 2^-120, exact) and multiplied against fp32 activation copies scaled by 2^60, in both
// regimes (the compute-bound one decodes a tile once, scale applied). The block scale is
// applied once per block.
//
// Two regimes, chosen per call by the rows (tokens) an expert has:
//  * n < kBlockedMinRows (decode): memory-bound; weights are widened in registers as they
//    stream and each loaded line is used for all n rows.
//  * n >= kBlockedMinRows (prefill, batched decode): compute-bound; for each 16-row tile and
//    each KC-long chunk of the reduction the weights are decoded once (bf16 / fp8 -> fp32,
//    fp8 block scale applied) into a 16 KiB L1-resident scratch tile, and a 6-row x 16-col
//    register-blocked FMA micro-kernel (12 accumulators) sweeps all n rows over it.
// bf16/fp8 activations arrive as fp32 copies (ActView::xf) so rows are broadcast from memory.
#include <immintrin.h>

#include "moe_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "moe_generic.h"

namespace moelab {
namespace {

struct TilePtrs {
  const void* x[4];
  const float* xf[4];  // bf16 / fp8 weights: fp32 activations
  const float* sx[4];
  const int32_t* corr[4];
};

inline int32_t load_i32(const void* p) { int32_t v; __builtin_memcpy(&v, p, 4); return v; }

// Where a tile's stream is prefetched at byte off: kPrefetchBytes ahead, and past the tile's end
// into the start of the tile read next. Two tiles i, i + 1 stream side by side, so the second
// one's overrun is the start of the next pair's first tile (i + 2), and the first one's is moved
// to the start of that pair's second tile (i + 3) rather than into tile i + 1, already streaming.
template <int MT>
inline size_t ahead(int i, size_t off, size_t tile_bytes) {
  const size_t o = off + kPrefetchBytes;
  return MT == 2 && i == 0 && o >= tile_bytes ? o + 2 * tile_bytes : o;
}

// MT row tiles = 2*MT ymm halves; NT tokens.
template <int MT, int NT>
void mk_fp(const MatView& m, int tile, const TilePtrs& p, float* out, size_t ldo) {
  constexpr int MH = 2 * MT;
  __m256 acc[MH][NT];
  for (int i = 0; i < MH; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm256_setzero_ps();
  if (m.wtype == W_F32) {
    const float* w[MT];
    for (int i = 0; i < MT; ++i) w[i] = reinterpret_cast<const float*>(m.w + size_t(tile + i) * m.tile_bytes);
    for (int k = 0; k < m.kd; ++k) {
      __m256 wv[MH];
      for (int i = 0; i < MT; ++i) {
        wv[2 * i] = _mm256_load_ps(w[i] + size_t(k) * 16);
        wv[2 * i + 1] = _mm256_load_ps(w[i] + size_t(k) * 16 + 8);
      }
      for (int t = 0; t < NT; ++t) {
        const __m256 xb = _mm256_set1_ps(static_cast<const float*>(p.x[t])[k]);
        for (int i = 0; i < MH; ++i) acc[i][t] = _mm256_fmadd_ps(wv[i], xb, acc[i][t]);
      }
    }
  } else {  // bf16 pairs [16 rows][2 k]: even k = bits << 16, odd k = bits & 0xffff0000
    const uint16_t* w[MT];
    for (int i = 0; i < MT; ++i) w[i] = reinterpret_cast<const uint16_t*>(m.w + size_t(tile + i) * m.tile_bytes);
    const __m256i hi_mask = _mm256_set1_epi32(int32_t(0xFFFF0000u));
    for (int k = 0; k < m.kd; k += 2) {
      __m256 we[MH], wo[MH];
      for (int i = 0; i < MT; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(w[i] + size_t(k) * 16) + kPrefetchBytes, _MM_HINT_T0);
      for (int i = 0; i < MT; ++i)
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(w[i] + size_t(k) * 16 + h * 16));
          we[2 * i + h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
          wo[2 * i + h] = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
        }
      for (int t = 0; t < NT; ++t) {
        const float* x = p.xf[t];
        const __m256 x0 = _mm256_broadcast_ss(x + k);
        const __m256 x1 = _mm256_broadcast_ss(x + k + 1);
        for (int i = 0; i < MH; ++i) {
          acc[i][t] = _mm256_fmadd_ps(we[i], x0, acc[i][t]);
          acc[i][t] = _mm256_fmadd_ps(wo[i], x1, acc[i][t]);
        }
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < MH; ++i) _mm256_storeu_ps(out + size_t(t) * ldo + i * 8, acc[i][t]);
}

template <bool I4, int MT, int NT>
void mk_int(const MatView& m, int tile, const TilePtrs& p, float* out, size_t ldo) {
  constexpr int MH = 2 * MT;
  __m256 facc[MH][NT];
  const uint8_t* w[MT];
  const float* sc[MT];
  for (int i = 0; i < MT; ++i) {
    w[i] = m.w + size_t(tile + i) * m.tile_bytes;
    sc[i] = m.scales + size_t(tile + i) * m.scale_tile;
  }
  for (int i = 0; i < MH; ++i)
    for (int t = 0; t < NT; ++t) facc[i][t] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i flip = _mm256_set1_epi8(int8_t(0x80));
  const int groups = m.kd / m.group;
  const int step = I4 ? 8 : 4;
  for (int g = 0; g < groups; ++g) {
    __m256i iacc[MH][NT];
    for (int i = 0; i < MH; ++i)
      for (int t = 0; t < NT; ++t) iacc[i][t] = _mm256_setzero_si256();
    for (int k = g * m.group; k < (g + 1) * m.group; k += step) {
      const size_t off = size_t(k / step) * 64;
      for (int i = 0; i < MT; ++i) _mm_prefetch(reinterpret_cast<const char*>(w[i] + ahead<MT>(i, off, m.tile_bytes)), _MM_HINT_T0);
      for (int i = 0; i < MH; ++i) {
        const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(w[i / 2] + off + (i % 2) * 32));
        if constexpr (I4) {
          const __m256i lo = _mm256_and_si256(v, low4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          for (int t = 0; t < NT; ++t) {
            const int8_t* x = static_cast<const int8_t*>(p.x[t]);
            const __m256i x0 = _mm256_set1_epi32(load_i32(x + k));
            const __m256i x1 = _mm256_set1_epi32(load_i32(x + k + 4));
            const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
            iacc[i][t] = _mm256_add_epi32(iacc[i][t], _mm256_madd_epi16(s, ones));
          }
        } else {
          const __m256i ws = _mm256_xor_si256(v, flip);  // q + 128 -> q (two's complement)
          const __m256i wa = _mm256_abs_epi8(ws);
          for (int t = 0; t < NT; ++t) {
            const __m256i xb = _mm256_set1_epi32(load_i32(static_cast<const int8_t*>(p.x[t]) + k));
            const __m256i s = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xb, ws));
            iacc[i][t] = _mm256_add_epi32(iacc[i][t], _mm256_madd_epi16(s, ones));
          }
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      // int8 here computes sum(q * x) directly, so the +128 offset correction is not applied.
      const __m256i c = _mm256_set1_epi32(I4 ? p.corr[t][g] : 0);
      const __m256 s = _mm256_set1_ps(p.sx[t][g]);
      for (int i = 0; i < MH; ++i) {
        const __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(iacc[i][t], c));
        const __m256 scale = _mm256_mul_ps(_mm256_load_ps(sc[i / 2] + size_t(g) * 16 + (i % 2) * 8), s);
        facc[i][t] = _mm256_fmadd_ps(f, scale, facc[i][t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < MH; ++i) _mm256_storeu_ps(out + size_t(t) * ldo + i * 8, facc[i][t]);
}

// fp8: [Kd/4][16][4] bytes. The 32-bit lane j of a half-line (32 bytes at 32 hl) is row
// 8 hl + j, its bytes (low to high) k+2, k, k+3, k+1. Each byte is moved to the top of its lane,
// shifted right arithmetically by 4 and masked: that is the fp32 bit pattern of value * 2^-120
// (sign at 31, e4m3's exponent and mantissa at 26..20), exact for every e4m3 value (subnormals
// become fp32 subnormals). Three integer shifts, four shifts-and-masks per 32 weights and no
// conversion instruction: vcvtph2ps (two uops on Zen) bounded the decode loop at ~60 % of read
// bandwidth. The activations arrive times kFp8XScale (2^60, the fp32 copies of moe_op.cpp), so
// products stay normal; the packed scale (which carries FP8_SCALE_FOLD = 2^8) times
// kFp8Unscale = 2^52 (moe_kernels.h) undoes 2^-120 * 2^60 exactly. Accumulators hold rows in order.

inline __m256 fp8_lane_top(__m256i top) {  // byte in bits 31..24 of each lane -> value * 2^-120
  return _mm256_castsi256_ps(
      _mm256_and_si256(_mm256_srai_epi32(top, 4), _mm256_set1_epi32(int32_t(0x87F00000u))));
}

// fp8 decode on 16-bit lanes: in a half-line's 32-bit lane j (row 8 hl + j) the high byte of each
// 16-bit word is k (low word) or k+1 (high word), the low byte k+2 or k+3. An arithmetic shift right
// by 4 of each word and a mask leave the bf16 pattern of value * 2^-120 (the byte's sign at 15, its
// exponent and mantissa at 10..4) for the high bytes; the low bytes first move up by 8. Unpacking
// each word under a zero word makes it the fp32 of the same value, the lanes then holding
// (row, k) and (row, k+1) side by side: rows 0, 1, 4, 5 from the low words' unpack, 2, 3, 6, 7 from
// the high one. A broadcast pair (x_k, x_k+1) multiplies them, and one horizontal add per block
// and token folds each row's two lanes back into rows 0..7 in order. Per 32 weights: one shift
// up, two shifts right, two masks and four unpacks (the unpacks on the shuffle port) where the
// fp32-lane decode took three shifts up, four shifts right and four masks, all but the masks on
// the two ports the FMAs need; and two broadcasts instead of four. Each row's accumulators double,
// so calls of 3 and 4 tokens keep the fp32-lane decode (mk_fp8_halves), whose accumulators fit the
// 16 registers. In-process A/B on the development VM (scripts/kernels_ab.py --isa avx2, 2026-11-28,
// 12-20 alternating pairs per point, both default shapes): 1-8 tokens +9-13 %, 16 tokens +5-8 %
// (int8, unchanged, 1.00); all 4 tokens per call on the pair decode: -23 % at 16 tokens (spills).
inline __m256i fp8_words(__m256i top) {  // byte in bits 15..8 of each word -> bf16 of value * 2^-120
  return _mm256_and_si256(_mm256_srai_epi16(top, 4), _mm256_set1_epi16(int16_t(0x87F0u)));
}

inline __m256 pair_of(const float* x) {  // (x[0], x[1]) in every 64-bit lane
  return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(x)));
}

template <int MT, int NT>
void mk_fp8_pairs(const MatView& m, int tile, const TilePtrs& p, float* out, size_t ldo) {
  const uint8_t* w[MT];
  const float* sc[MT];
  for (int i = 0; i < MT; ++i) {
    w[i] = m.w + size_t(tile + i) * m.tile_bytes;
    sc[i] = m.scales + size_t(tile + i) * m.scale_tile;
  }
  const __m256i zero = _mm256_setzero_si256();
  const int groups = m.kd / m.group;
  for (int g = 0; g < groups; ++g) {
    __m256 lo[MT][2][NT], hi[MT][2][NT];  // [tile][half-line][token]: rows 0,1,4,5 / 2,3,6,7, (k, k+1) pairs
    for (int i = 0; i < MT; ++i)
      for (int h = 0; h < 2; ++h)
        for (int t = 0; t < NT; ++t) lo[i][h][t] = hi[i][h][t] = _mm256_setzero_ps();
    const int k_end = (g + 1) * m.group;
    for (int k = g * m.group; k < k_end; k += 4) {
      const size_t off = size_t(k / 4) * 64;
      for (int i = 0; i < MT; ++i) _mm_prefetch(reinterpret_cast<const char*>(w[i] + ahead<MT>(i, off, m.tile_bytes)), _MM_HINT_T0);
      for (int hl = 0; hl < 2; ++hl)
        for (int i = 0; i < MT; ++i) {
          const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(w[i] + off + 32 * hl));
          const __m256i a = fp8_words(v);                           // (k, k+1) per row
          const __m256i b = fp8_words(_mm256_slli_epi16(v, 8));     // (k+2, k+3)
          const __m256 a_lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, a));
          const __m256 a_hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, a));
          const __m256 b_lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, b));
          const __m256 b_hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, b));
          for (int t = 0; t < NT; ++t) {
            const float* xk = p.xf[t] + k;
            const __m256 x01 = pair_of(xk), x23 = pair_of(xk + 2);
            lo[i][hl][t] = _mm256_fmadd_ps(a_lo, x01, lo[i][hl][t]);
            hi[i][hl][t] = _mm256_fmadd_ps(a_hi, x01, hi[i][hl][t]);
            lo[i][hl][t] = _mm256_fmadd_ps(b_lo, x23, lo[i][hl][t]);
            hi[i][hl][t] = _mm256_fmadd_ps(b_hi, x23, hi[i][hl][t]);
          }
        }
    }
    for (int i = 0; i < MT; ++i) {
      const __m256 s = _mm256_set1_ps(sc[i][g] * kFp8Unscale);  // once per (tile, block)
      for (int t = 0; t < NT; ++t)
        for (int h = 0; h < 2; ++h) {
          const __m256 r = _mm256_hadd_ps(lo[i][h][t], hi[i][h][t]);  // rows 8 h .. 8 h + 7 in order
          float* o = out + size_t(t) * ldo + i * 16 + h * 8;
          _mm256_storeu_ps(o, g ? _mm256_fmadd_ps(r, s, _mm256_loadu_ps(o)) : _mm256_mul_ps(r, s));
        }
    }
  }
  if (groups == 0)
    for (int t = 0; t < NT; ++t)
      for (int i = 0; i < 2 * MT; ++i) _mm256_storeu_ps(out + size_t(t) * ldo + i * 8, _mm256_setzero_ps());
}

// One 32-byte half-line of the pair decode into a row-pair accumulator pair (lo: rows 0, 1, 4, 5;
// hi: rows 2, 3, 6, 7), as mk_fp8_pairs does it.
inline void fp8_pair_step(const uint8_t* src, __m256i zero, __m256 x01, __m256 x23, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(src));
  const __m256i a = fp8_words(v);
  lo = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, a)), x01, lo);
  hi = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, a)), x01, hi);
  const __m256i b = fp8_words(_mm256_slli_epi16(v, 8));
  lo = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, b)), x23, lo);
  hi = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, b)), x23, hi);
}

// mk_fp8_pairs<2, 1> (one token, two tiles: a decode step) with its eight accumulators as named
// variables, decoded half-line by half-line: the template's [tile][half-line][token] arrays left
// GCC 12 short of registers, and it kept four accumulators on the stack (a store and a reload in
// every FMA chain).
inline void store_pair_rows(float* o, __m256 lo, __m256 hi, __m256 s, bool add) {
  const __m256 r = _mm256_hadd_ps(lo, hi);  // rows 0..7 in order
  _mm256_storeu_ps(o, add ? _mm256_fmadd_ps(r, s, _mm256_loadu_ps(o)) : _mm256_mul_ps(r, s));
}

void mk_fp8_pairs_one(const MatView& m, int tile, const TilePtrs& p, float* out) {
  const uint8_t* w0 = m.w + size_t(tile) * m.tile_bytes;
  const uint8_t* w1 = w0 + m.tile_bytes;
  const float* sc0 = m.scales + size_t(tile) * m.scale_tile;
  const float* sc1 = sc0 + m.scale_tile;
  const float* x = p.xf[0];
  const __m256i zero = _mm256_setzero_si256();
  const int groups = m.kd / m.group;
  for (int g = 0; g < groups; ++g) {
    __m256 l00 = _mm256_setzero_ps(), h00 = l00, l01 = l00, h01 = l00, l10 = l00, h10 = l00, l11 = l00, h11 = l00;
    const int k_end = (g + 1) * m.group;
    for (int k = g * m.group; k < k_end; k += 4) {
      const size_t off = size_t(k / 4) * 64;
      _mm_prefetch(reinterpret_cast<const char*>(w0 + ahead<2>(0, off, m.tile_bytes)), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w1 + ahead<2>(1, off, m.tile_bytes)), _MM_HINT_T0);
      const __m256 x01 = pair_of(x + k), x23 = pair_of(x + k + 2);
      fp8_pair_step(w0 + off, zero, x01, x23, l00, h00);
      fp8_pair_step(w1 + off, zero, x01, x23, l10, h10);
      fp8_pair_step(w0 + off + 32, zero, x01, x23, l01, h01);
      fp8_pair_step(w1 + off + 32, zero, x01, x23, l11, h11);
    }
    const __m256 s0 = _mm256_set1_ps(sc0[g] * kFp8Unscale), s1 = _mm256_set1_ps(sc1[g] * kFp8Unscale);
    store_pair_rows(out, l00, h00, s0, g > 0);
    store_pair_rows(out + 8, l01, h01, s0, g > 0);
    store_pair_rows(out + 16, l10, h10, s1, g > 0);
    store_pair_rows(out + 24, l11, h11, s1, g > 0);
  }
  if (groups == 0)
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + i * 8, _mm256_setzero_ps());
}

// fp8 weights, 3 or 4 tokens, one row tile, its half-lines in two passes per block: rows 0-7 over
// the block's lines, then rows 8-15 over the same lines (a 128-k block of one tile is 2 KiB: the
// second pass reads L1). Only one half's accumulators are live, so each token keeps two chains
// ((k, k+1) and (k+2, k+3): FMA latency) in 2 NT registers, and the four weights of a half-line
// are decoded one at a time: nothing spills. Both halves in one pass (2 NT accumulators plus four
// decoded weights) left GCC storing and reloading accumulators every line. In-process A/B
// (scripts/kernels_ab.py --isa avx2, 2026-11-29): 16 tokens on 4096x14336x8x2 (4 rows an expert)
// 1.08x [1.04-1.11], on 2048x1408x64x6 1.02x [0.99-1.04]; 4 rows on 2048x1408x2x2 1.05x.
template <int NT>
void mk_fp8_halves(const MatView& m, int tile, const TilePtrs& p, float* out, size_t ldo) {
  const uint8_t* w = m.w + size_t(tile) * m.tile_bytes;
  const float* sc = m.scales + size_t(tile) * m.scale_tile;
  const int groups = m.kd / m.group;
  for (int g = 0; g < groups; ++g) {
    const __m256 s = _mm256_set1_ps(sc[g] * kFp8Unscale);  // once per (tile, block)
    const int k0 = g * m.group, k1 = k0 + m.group;
    for (int hl = 0; hl < 2; ++hl) {
      __m256 a[NT][2];
      for (int t = 0; t < NT; ++t) a[t][0] = a[t][1] = _mm256_setzero_ps();
      for (int k = k0; k < k1; k += 4) {
        const size_t off = size_t(k / 4) * 64;
        if (hl == 0) _mm_prefetch(reinterpret_cast<const char*>(w + ahead<1>(0, off, m.tile_bytes)), _MM_HINT_T0);
        const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + off + 32 * hl));
        __m256 wk = fp8_lane_top(_mm256_slli_epi32(v, 16));  // k
        for (int t = 0; t < NT; ++t) a[t][0] = _mm256_fmadd_ps(wk, _mm256_broadcast_ss(p.xf[t] + k), a[t][0]);
        wk = fp8_lane_top(_mm256_slli_epi32(v, 24));  // k + 2
        for (int t = 0; t < NT; ++t) a[t][1] = _mm256_fmadd_ps(wk, _mm256_broadcast_ss(p.xf[t] + k + 2), a[t][1]);
        wk = fp8_lane_top(v);  // k + 1
        for (int t = 0; t < NT; ++t) a[t][0] = _mm256_fmadd_ps(wk, _mm256_broadcast_ss(p.xf[t] + k + 1), a[t][0]);
        wk = fp8_lane_top(_mm256_slli_epi32(v, 8));  // k + 3
        for (int t = 0; t < NT; ++t) a[t][1] = _mm256_fmadd_ps(wk, _mm256_broadcast_ss(p.xf[t] + k + 3), a[t][1]);
      }
      for (int t = 0; t < NT; ++t) {
        const __m256 r = _mm256_add_ps(a[t][0], a[t][1]);
        float* o = out + size_t(t) * ldo + hl * 8;
        _mm256_storeu_ps(o, g ? _mm256_fmadd_ps(r, s, _mm256_loadu_ps(o)) : _mm256_mul_ps(r, s));
      }
    }
  }
  if (groups == 0)
    for (int t = 0; t < NT; ++t)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + size_t(t) * ldo + h * 8, _mm256_setzero_ps());
}

template <int MT, int NT>
void mk_dispatch(const MatView& m, int tile, const TilePtrs& p, float* out, size_t ldo) {
  switch (m.wtype) {
    case W_F32:
    case W_BF16: mk_fp<MT, NT>(m, tile, p, out, ldo); break;
    case W_INT8: mk_int<false, MT, NT>(m, tile, p, out, ldo); break;
    case W_FP8:  // the pair decode doubles the accumulators: from 3 tokens they would spill
      if constexpr (MT == 2 && NT == 1) mk_fp8_pairs_one(m, tile, p, out);
      else if constexpr (NT <= 2) mk_fp8_pairs<MT, NT>(m, tile, p, out, ldo);
      else  // (gemm_avx2 gives fp8 weights one tile at a time from 2 tokens: MT is 1 here)
        for (int i = 0; i < MT; ++i) mk_fp8_halves<NT>(m, tile + i, p, out + i * 16, ldo);
      break;
    default: mk_int<true, MT, NT>(m, tile, p, out, ldo); break;
  }
}

template <int MT>
void mk_nt(int nt, const MatView& m, int tile, const TilePtrs& p, float* out, size_t ldo) {
  switch (nt) {
    case 1: mk_dispatch<MT, 1>(m, tile, p, out, ldo); break;
    case 2: mk_dispatch<MT, 2>(m, tile, p, out, ldo); break;
    case 3: mk_dispatch<MT, 3>(m, tile, p, out, ldo); break;
    default: mk_dispatch<MT, 4>(m, tile, p, out, ldo); break;
  }
}

// ---- compute-bound path: decode a tile chunk once, sweep all rows over it ----

constexpr int kBlockedMinRows = 8;  // rows per expert from which the blocked path runs
constexpr int kKc = 256;            // reduction chunk: a 16 KiB fp32 scratch tile (L1)
constexpr int kNr = 6;              // rows per micro-kernel call: 6 x 2 ymm accumulators
constexpr int kMc = 96;             // rows per block (a multiple of kNr)

// Decode rows [k0, k0 + kc) of one packed 16-row tile into wt[kc][16] fp32 (k0, kc multiples of 4).
void decode_tile(const MatView& m, int tile, int k0, int kc, float* wt) {
  const uint8_t* w = m.w + size_t(tile) * m.tile_bytes;
  if (m.wtype == W_BF16) {
    const __m256i hi_mask = _mm256_set1_epi32(int32_t(0xFFFF0000u));
    for (int k = 0; k < kc; k += 2) {
      const uint8_t* line = w + size_t(k0 + k) * 32;
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(line + 32 * h));
        _mm256_store_ps(wt + size_t(k) * 16 + 8 * h, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
        _mm256_store_ps(wt + size_t(k + 1) * 16 + 8 * h, _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask)));
      }
    }
  } else {  // fp8: [Kd/4][16][4]; half-line hl is rows 8 hl .. 8 hl + 7, bytes k+2, k, k+3, k+1
    const float* sc = m.scales + size_t(tile) * m.scale_tile;
    for (int k = 0; k < kc; k += 4) {
      const uint8_t* line = w + size_t((k0 + k) / 4) * 64;
      // a 4-k line lies in one block; value * 2^-120 times the scale times 2^52 is the value
      // times the checkpoint's scale times 2^-60, which undoes the activations' kFp8XScale
      const __m256 s = _mm256_set1_ps(sc[(k0 + k) / m.group] * kFp8Unscale);
      for (int hl = 0; hl < 2; ++hl) {
        const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(line + 32 * hl));
        float* d = wt + size_t(k) * 16 + 8 * hl;
        _mm256_store_ps(d, _mm256_mul_ps(fp8_lane_top(_mm256_slli_epi32(v, 16)), s));
        _mm256_store_ps(d + 16, _mm256_mul_ps(fp8_lane_top(v), s));
        _mm256_store_ps(d + 32, _mm256_mul_ps(fp8_lane_top(_mm256_slli_epi32(v, 24)), s));
        _mm256_store_ps(d + 48, _mm256_mul_ps(fp8_lane_top(_mm256_slli_epi32(v, 8)), s));
      }
    }
  }
}

// o[t][0..16) (+)= sum_k wt[k][0..16) * x[t][k] for NR rows; wt is [kc][16] fp32.
template <int NR>
void mk_blocked(const float* wt, int kc, const float* const* x, float* o, size_t ldo, bool add) {
  __m256 c[NR][2];
  for (int t = 0; t < NR; ++t) c[t][0] = c[t][1] = _mm256_setzero_ps();
  for (int k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_load_ps(wt + size_t(k) * 16);
    const __m256 w1 = _mm256_load_ps(wt + size_t(k) * 16 + 8);
    for (int t = 0; t < NR; ++t) {
      const __m256 xb = _mm256_broadcast_ss(x[t] + k);
      c[t][0] = _mm256_fmadd_ps(w0, xb, c[t][0]);
      c[t][1] = _mm256_fmadd_ps(w1, xb, c[t][1]);
    }
  }
  for (int t = 0; t < NR; ++t) {
    float* d = o + size_t(t) * ldo;
    if (add) {
      c[t][0] = _mm256_add_ps(c[t][0], _mm256_loadu_ps(d));
      c[t][1] = _mm256_add_ps(c[t][1], _mm256_loadu_ps(d + 8));
    }
    _mm256_storeu_ps(d, c[t][0]);
    _mm256_storeu_ps(d + 8, c[t][1]);
  }
}

void mk_blocked_n(int nr, const float* wt, int kc, const float* const* x, float* o, size_t ldo, bool add) {
  switch (nr) {
    case 1: mk_blocked<1>(wt, kc, x, o, ldo, add); break;
    case 2: mk_blocked<2>(wt, kc, x, o, ldo, add); break;
    case 3: mk_blocked<3>(wt, kc, x, o, ldo, add); break;
    case 4: mk_blocked<4>(wt, kc, x, o, ldo, add); break;
    case 5: mk_blocked<5>(wt, kc, x, o, ldo, add); break;
    default: mk_blocked<6>(wt, kc, x, o, ldo, add); break;
  }
}

// fp32 / bf16 / fp8 weights, n >= kBlockedMinRows. Blocks of kMc rows (their fp32
// activations for one chunk, kMc x kKc x 4 = 96 KiB, stay in L2 across the tiles), then
// chunks of the reduction, then tiles: each tile chunk is decoded once per row block.
void gemm_blocked(const MatView& m, int tile0, int ntiles, const ActView& a, int n, float* out,
                  size_t ldo) {
  alignas(64) float wt[kKc * 16];
  const bool f32 = m.wtype == W_F32;
  const float* xbase = f32 ? static_cast<const float*>(a.base) : a.xf;
  const float* xr[kNr];
  for (int r0 = 0; r0 < n; r0 += kMc) {
    const int r1 = n - r0 < kMc ? n : r0 + kMc;
    for (int k0 = 0; k0 < m.kd; k0 += kKc) {
      const int kc = m.kd - k0 < kKc ? m.kd - k0 : kKc;
      for (int ti = 0; ti < ntiles; ++ti) {
        const float* w;
        if (f32) {
          w = reinterpret_cast<const float*>(m.w + size_t(tile0 + ti) * m.tile_bytes) + size_t(k0) * 16;
        } else {
          decode_tile(m, tile0 + ti, k0, kc, wt);
          w = wt;
        }
        for (int t0 = r0; t0 < r1; t0 += kNr) {
          const int nr = r1 - t0 < kNr ? r1 - t0 : kNr;
          for (int t = 0; t < nr; ++t) xr[t] = xbase + size_t(a.rows[t0 + t]) * a.ld + k0;
          mk_blocked_n(nr, w, kc, xr, out + size_t(t0) * ldo + size_t(ti) * 16, ldo, k0 > 0);
        }
      }
    }
  }
}

void gemm_avx2(const MatView& m, int tile0, int ntiles, const ActView& a, int n, float* out,
               size_t ldo) {
  const bool is_int = m.wtype == W_INT8 || m.wtype == W_INT4;
  if (!is_int && n >= kBlockedMinRows) {
    gemm_blocked(m, tile0, ntiles, a, n, out, ldo);
    return;
  }
  const size_t esize = m.wtype == W_F32 ? 4 : (m.wtype == W_BF16 || m.wtype == W_FP8 ? 2 : 1);
  // Register budget (16 ymm): float weights take two row tiles only with one token, else the
  // accumulators of 2 tiles x NT tokens plus the widened weights would spill. Tiles are the
  // outer loop so each tile's weights stream from memory once for all n (< 8) tokens.
  const int mt = (n == 1 || is_int) ? 2 : 1;
  for (int ti = 0; ti < ntiles; ti += mt) {
    const bool two = mt == 2 && ntiles - ti >= 2;
    for (int t0 = 0; t0 < n; t0 += 4) {
      const int nt = n - t0 < 4 ? n - t0 : 4;
      TilePtrs p;
      for (int t = 0; t < nt; ++t) {
        const size_t row = size_t(a.rows[t0 + t]);
        p.x[t] = static_cast<const uint8_t*>(a.base) + row * a.ld * esize;
        p.xf[t] = a.xf ? a.xf + row * a.ld : nullptr;
        if (is_int) {
          p.sx[t] = a.sx + row * a.ldg;
          p.corr[t] = a.corr + row * a.ldg;
        }
      }
      float* o = out + size_t(t0) * ldo + size_t(ti) * 16;
      if (two) mk_nt<2>(nt, m, tile0 + ti, p, o, ldo);
      else mk_nt<1>(nt, m, tile0 + ti, p, o, ldo);
    }
    if (!two && mt == 2) ti -= 1;  // odd last tile: advance by one
  }
}

// 12 independent ymm FMA chains (2 FMA ports x latency 4-5 cycles need >= 10 in flight).
double peak_avx2(int64_t iters) {
  __m256 acc[12];
  for (int j = 0; j < 12; ++j) acc[j] = _mm256_set1_ps(float(j) * 1e-3f);
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-4f);
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < 12; ++j) acc[j] = _mm256_fmadd_ps(acc[j], a, b);
  __m256 s = acc[0];
  for (int j = 1; j < 12; ++j) s = _mm256_add_ps(s, acc[j]);
  volatile float sink = _mm256_cvtss_f32(s);
  (void)sink;
  return 2.0 * 12 * 8 * double(iters);
}

}  // namespace

IsaOps avx2_ops() { return IsaOps{gemm_avx2, quant_generic, act_generic, peak_avx2}; }

}  // namespace moelab
#pragma GCC pop_options
