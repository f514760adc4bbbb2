// AVX2/FMA fallback (Haswell and later, Zen 1 and later). Same packed layout as the
// AVX-512 path; a 16-row tile is two 8-lane halves. bf16 weights are widened to fp32
// (even/odd halves of each 32-bit pair); int8 uses the vpsignb/vpmaddubsw trick on the
// signed value (no saturation for |q|, |x| <= 127); int4 uses vpmaddubsw on the
// unsigned nibble and the same offset correction as the AVX-512 path. fp8 (e4m3) bytes
// are decoded exactly to fp16 with two shifts and a mask, widened with vcvtph2ps and
// multiplied in fp32 against bf16 activations; the block scale is applied once per block.
#include <immintrin.h>

#include "moe_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "moe_generic.h"

namespace moelab {
namespace {

struct TilePtrs {
  const void* x[4];
  const float* sx[4];
  const int32_t* corr[4];
};

inline int32_t load_i32(const void* p) { int32_t v; __builtin_memcpy(&v, p, 4); return v; }

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
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(w[i] + size_t(k) * 16 + h * 16));
          we[2 * i + h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
          wo[2 * i + h] = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
        }
      for (int t = 0; t < NT; ++t) {
        const uint16_t* x = static_cast<const uint16_t*>(p.x[t]);
        const __m256 x0 = _mm256_set1_ps(bf16_to_f32(x[k]));
        const __m256 x1 = _mm256_set1_ps(bf16_to_f32(x[k + 1]));
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

// fp8: [Kd/4][2][16][2] bytes. A half-line (32 bytes) holds 16 rows x {k, k+2} (low,
// high byte of each 16-bit lane); e4m3 bits moved to bits 13..7 with the sign at 15 are
// the fp16 of value / 256 (the 256 is folded into the scales). Only the block's
// accumulators live in registers (AVX2 has 16): at the end of each block they are scaled
// once and added to the output rows, which stay in L1.
template <int MT, int NT>
void mk_fp8(const MatView& m, int tile, const TilePtrs& p, float* out, size_t ldo) {
  constexpr int MH = 2 * MT;
  const uint8_t* w[MT];
  const float* sc[MT];
  const uint16_t* x[NT];
  for (int i = 0; i < MT; ++i) {
    w[i] = m.w + size_t(tile + i) * m.tile_bytes;
    sc[i] = m.scales + size_t(tile + i) * m.scale_tile;
  }
  for (int t = 0; t < NT; ++t) x[t] = static_cast<const uint16_t*>(p.x[t]);
  const __m256i fmask = _mm256_set1_epi16(int16_t(0xBF80));
  const __m256i himask = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  const int groups = m.kd / m.group;
  for (int g = 0; g < groups; ++g) {
    __m256 acc[MH][NT];
    for (int i = 0; i < MH; ++i)
      for (int t = 0; t < NT; ++t) acc[i][t] = _mm256_setzero_ps();
    const int k_end = (g + 1) * m.group;
    for (int k = g * m.group; k < k_end; k += 4) {
      const size_t off = size_t(k / 4) * 64;
      for (int hl = 0; hl < 2; ++hl) {
        __m256i h16[2][MT];  // [0]: rows at k + hl, [1]: rows at k + hl + 2 (fp16 bits)
        for (int i = 0; i < MT; ++i) {
          const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(w[i] + off + 32 * hl));
          h16[0][i] = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(v, 8), 1), fmask);
          h16[1][i] = _mm256_and_si256(_mm256_srai_epi16(v, 1), fmask);
        }
        for (int j = 0; j < 2; ++j) {
          const int kk = k + hl + 2 * j;
          __m256 wv[MH];
          for (int i = 0; i < MT; ++i) {
            wv[2 * i] = _mm256_cvtph_ps(_mm256_castsi256_si128(h16[j][i]));
            wv[2 * i + 1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h16[j][i], 1));
          }
          for (int t = 0; t < NT; ++t) {
            // bf16 pair (kk & ~1, kk | 1) broadcast as 32 bits; its low or high half is x[kk]
            const __m256i xp = _mm256_set1_epi32(load_i32(x[t] + (kk & ~1)));
            const __m256 xb = _mm256_castsi256_ps(hl ? _mm256_and_si256(xp, himask) : _mm256_slli_epi32(xp, 16));
            for (int i = 0; i < MH; ++i) acc[i][t] = _mm256_fmadd_ps(wv[i], xb, acc[i][t]);
          }
        }
      }
    }
    for (int i = 0; i < MH; ++i) {
      const __m256 s = _mm256_set1_ps(sc[i / 2][g]);  // once per (tile, block)
      for (int t = 0; t < NT; ++t) {
        float* o = out + size_t(t) * ldo + i * 8;
        _mm256_storeu_ps(o, g ? _mm256_fmadd_ps(acc[i][t], s, _mm256_loadu_ps(o)) : _mm256_mul_ps(acc[i][t], s));
      }
    }
  }
  if (groups == 0)
    for (int t = 0; t < NT; ++t)
      for (int i = 0; i < MH; ++i) _mm256_storeu_ps(out + size_t(t) * ldo + i * 8, _mm256_setzero_ps());
}

template <int MT, int NT>
void mk_dispatch(const MatView& m, int tile, const TilePtrs& p, float* out, size_t ldo) {
  switch (m.wtype) {
    case W_F32:
    case W_BF16: mk_fp<MT, NT>(m, tile, p, out, ldo); break;
    case W_INT8: mk_int<false, MT, NT>(m, tile, p, out, ldo); break;
    case W_FP8: mk_fp8<MT, NT>(m, tile, p, out, ldo); break;
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

void gemm_avx2(const MatView& m, int tile0, int ntiles, const ActView& a, int n, float* out,
               size_t ldo) {
  const bool is_int = m.wtype == W_INT8 || m.wtype == W_INT4;
  const size_t esize = m.wtype == W_F32 ? 4 : (m.wtype == W_BF16 || m.wtype == W_FP8 ? 2 : 1);
  for (int ti = 0; ti < ntiles; ti += 2) {
    const int mt = ntiles - ti < 2 ? 1 : 2;
    for (int t0 = 0; t0 < n; t0 += 4) {
      const int nt = n - t0 < 4 ? n - t0 : 4;
      TilePtrs p;
      for (int t = 0; t < nt; ++t) {
        const size_t row = size_t(a.rows[t0 + t]);
        p.x[t] = static_cast<const uint8_t*>(a.base) + row * a.ld * esize;
        if (is_int) {
          p.sx[t] = a.sx + row * a.ldg;
          p.corr[t] = a.corr + row * a.ldg;
        }
      }
      float* o = out + size_t(t0) * ldo + size_t(ti) * 16;
      if (mt == 2) mk_nt<2>(nt, m, tile0 + ti, p, o, ldo);
      else mk_nt<1>(nt, m, tile0 + ti, p, o, ldo);
    }
  }
}

}  // namespace

IsaOps avx2_ops() { return IsaOps{gemm_avx2, quant_generic, act_generic}; }

}  // namespace moelab
#pragma GCC pop_options
