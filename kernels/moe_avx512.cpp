// AVX-512 path (F/BW/VL + VNNI + BF16 + VBMI: Sapphire Rapids, Zen 4 and later; Cooper Lake,
// without VBMI, runs the AVX2 path). bf16 uses vdpbf16ps, int8/int4 use vpdpbusd on unsigned
// (offset) weights and int8 activations; fp32 uses FMA with broadcast activations. fp8 (e4m3)
// bytes are decoded exactly into bf16 (k, k+1) pairs by byte tables (moe_avx512_shared.h) for
// vdpbf16ps against the bf16 activations; the block scale (x 256) is applied once per block. Register blocking: MT row
// tiles (16 rows each) x NT tokens of accumulators; weights stream once per token tile.
#include <immintrin.h>

#include "moe_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx512vbmi,avx2,fma,f16c")
#include "moe_generic.h"
#include "moe_avx512_shared.h"

namespace moelab {
namespace {

template <int MT, int NT>
void mk_bf16(const MatView& m, int tile, const TilePtrs& p, float* out, size_t ldo) {
  __m512 acc[MT][NT];
  const uint16_t* w[MT];
  const uint16_t* x[NT];
  for (int i = 0; i < MT; ++i) w[i] = reinterpret_cast<const uint16_t*>(m.w + size_t(tile + i) * m.tile_bytes);
  for (int t = 0; t < NT; ++t) x[t] = static_cast<const uint16_t*>(p.x[t]);
  for (int i = 0; i < MT; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  const int k2n = m.kd / 2;
  for (int k2 = 0; k2 < k2n; ++k2) {
    __m512bh wv[MT];
    for (int i = 0; i < MT; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(w[i] + size_t(k2) * 32) + kPrefetchBytes, _MM_HINT_T0);
    for (int i = 0; i < MT; ++i) wv[i] = (__m512bh)_mm512_load_si512(w[i] + size_t(k2) * 32);
    for (int t = 0; t < NT; ++t) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(load_i32(x[t] + 2 * k2));
      for (int i = 0; i < MT; ++i) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], wv[i], xb);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < MT; ++i) _mm512_storeu_ps(out + size_t(t) * ldo + i * 16, acc[i][t]);
}

// fp8: [Kd/4][16][4] bytes, decoded line by line (moe_avx512_shared.h).
template <int MT, int NT>
void mk_fp8(const MatView& m, int tile, const TilePtrs& p, float* out, size_t ldo) {
  __m512 facc[MT][NT];
  const uint8_t* w[MT];
  const float* sc[MT];
  const uint16_t* x[NT];
  for (int i = 0; i < MT; ++i) {
    w[i] = m.w + size_t(tile + i) * m.tile_bytes;
    sc[i] = m.scales + size_t(tile + i) * m.scale_tile;
  }
  for (int t = 0; t < NT; ++t) x[t] = static_cast<const uint16_t*>(p.x[t]);
  for (int i = 0; i < MT; ++i)
    for (int t = 0; t < NT; ++t) facc[i][t] = _mm512_setzero_ps();
  const Fp8Tables tb = fp8_tables();
  const int groups = m.kd / m.group;
  for (int g = 0; g < groups; ++g) {
    __m512 acc[MT][NT];
    for (int i = 0; i < MT; ++i)
      for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
    const int k_end = (g + 1) * m.group;
    for (int k = g * m.group; k < k_end; k += 4) {
      const size_t off = size_t(k / 4) * 64;
      __m512bh p01[MT], p23[MT];
      for (int i = 0; i < MT; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(w[i] + off + kPrefetchBytes), _MM_HINT_T0);
        __m512i a, b;
        fp8_line_to_bf16(tb, w[i] + off, a, b);
        p01[i] = (__m512bh)a;
        p23[i] = (__m512bh)b;
      }
      for (int t = 0; t < NT; ++t) {
        const __m512bh x01 = (__m512bh)_mm512_set1_epi32(load_i32(x[t] + k));
        const __m512bh x23 = (__m512bh)_mm512_set1_epi32(load_i32(x[t] + k + 2));
        for (int i = 0; i < MT; ++i) {
          acc[i][t] = _mm512_dpbf16_ps(acc[i][t], p01[i], x01);
          acc[i][t] = _mm512_dpbf16_ps(acc[i][t], p23[i], x23);
        }
      }
    }
    for (int i = 0; i < MT; ++i) {
      const __m512 s = _mm512_set1_ps(sc[i][g]);  // once per (tile, block)
      for (int t = 0; t < NT; ++t) facc[i][t] = _mm512_fmadd_ps(acc[i][t], s, facc[i][t]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < MT; ++i) _mm512_storeu_ps(out + size_t(t) * ldo + i * 16, facc[i][t]);
}

template <int MT, int NT>
void mk_dispatch(const MatView& m, int tile, const TilePtrs& p, float* out, size_t ldo) {
  // Only register-resident blockings are instantiated (the driver never asks for more).
  if constexpr (MT * NT <= 16) {
    switch (m.wtype) {
      case W_F32: mk_f32<MT, NT>(m, tile, p, out, ldo); break;
      case W_BF16: mk_bf16<MT, NT>(m, tile, p, out, ldo); break;
      case W_INT8: if constexpr (MT * NT <= 8) mk_int<false, MT, NT>(m, tile, p, out, ldo); break;
      case W_FP8: if constexpr (MT * NT <= 8) mk_fp8<MT, NT>(m, tile, p, out, ldo); break;
      default: if constexpr (MT * NT <= 8) mk_int<true, MT, NT>(m, tile, p, out, ldo); break;
    }
  }
}

template <int MT>
void mk_nt(int nt, const MatView& m, int tile, const TilePtrs& p, float* out, size_t ldo) {
  switch (nt) {
    case 1: mk_dispatch<MT, 1>(m, tile, p, out, ldo); break;
    case 2: mk_dispatch<MT, 2>(m, tile, p, out, ldo); break;
    case 3: mk_dispatch<MT, 3>(m, tile, p, out, ldo); break;
    case 4: mk_dispatch<MT, 4>(m, tile, p, out, ldo); break;
    case 5: mk_dispatch<MT, 5>(m, tile, p, out, ldo); break;
    case 6: mk_dispatch<MT, 6>(m, tile, p, out, ldo); break;
    case 7: mk_dispatch<MT, 7>(m, tile, p, out, ldo); break;
    default: mk_dispatch<MT, 8>(m, tile, p, out, ldo); break;
  }
}

void gemm_avx512(const MatView& m, int tile0, int ntiles, const ActView& a, int n, float* out,
                 size_t ldo) {
  const bool is_int = m.wtype == W_INT8 || m.wtype == W_INT4;
  const int nt_max = is_int || m.wtype == W_FP8 ? 4 : 8;  // two accumulator sets: MT*NT <= 8
  decode_tiles(m, tile0, ntiles, a, n, out, ldo, nt_max, [&](int mt, int nt, int tile, const TilePtrs& p, float* o) {
    if (mt == 4) mk_nt<4>(nt, m, tile, p, o, ldo);
    else if (mt == 2) mk_nt<2>(nt, m, tile, p, o, ldo);
    else mk_nt<1>(nt, m, tile, p, o, ldo);
  });
}

}  // namespace

IsaOps avx512_ops() { return IsaOps{gemm_avx512, quant_generic, act_avx512, peak_avx512}; }

}  // namespace moelab
#pragma GCC pop_options
