// AVX-512 pieces every AVX-512 translation unit shares (AVX-512 F/BW/VL/DQ + VNNI only: the
// avx512vnni unit, which has no BF16 or VBMI, includes this alone; the AVX-512 and AMX units
// through moe_avx512_shared.h). Each includes it after its own target pragma and after
// moe_generic.h; internal linkage, so each gets its own copy: the fp32 and int8/int4 decode
// micro-kernels, the stage-1 activation epilogue and the FMA peak loop.
#pragma once
#include <immintrin.h>

namespace moelab {
namespace {

struct TilePtrs {
  const void* x[8];
  const float* xf[8];  // bf16 / fp8 weights without BF16 (avx512vnni): fp32 activations
  const float* sx[8];
  const int32_t* corr[8];
};

inline int32_t load_i32(const void* p) { int32_t v; __builtin_memcpy(&v, p, 4); return v; }

template <int MT, int NT>
void mk_f32(const MatView& m, int tile, const TilePtrs& p, float* out, size_t ldo) {
  __m512 acc[MT][NT];
  const float* w[MT];
  const float* x[NT];
  for (int i = 0; i < MT; ++i) w[i] = reinterpret_cast<const float*>(m.w + size_t(tile + i) * m.tile_bytes);
  for (int t = 0; t < NT; ++t) x[t] = static_cast<const float*>(p.x[t]);
  for (int i = 0; i < MT; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int k = 0; k < m.kd; ++k) {
    __m512 wv[MT];
    for (int i = 0; i < MT; ++i) wv[i] = _mm512_load_ps(w[i] + size_t(k) * 16);
    for (int t = 0; t < NT; ++t) {
      const __m512 xb = _mm512_set1_ps(x[t][k]);
      for (int i = 0; i < MT; ++i) acc[i][t] = _mm512_fmadd_ps(wv[i], xb, acc[i][t]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < MT; ++i) _mm512_storeu_ps(out + size_t(t) * ldo + i * 16, acc[i][t]);
}

template <bool I4, int MT, int NT>
void mk_int(const MatView& m, int tile, const TilePtrs& p, float* out, size_t ldo) {
  __m512 facc[MT][NT];
  const uint8_t* w[MT];
  const float* sc[MT];
  const int8_t* x[NT];
  for (int i = 0; i < MT; ++i) {
    w[i] = m.w + size_t(tile + i) * m.tile_bytes;
    sc[i] = m.scales + size_t(tile + i) * m.scale_tile;
  }
  for (int t = 0; t < NT; ++t) x[t] = static_cast<const int8_t*>(p.x[t]);
  for (int i = 0; i < MT; ++i)
    for (int t = 0; t < NT; ++t) facc[i][t] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int groups = m.kd / m.group;
  const int step = I4 ? 8 : 4;
  for (int g = 0; g < groups; ++g) {
    __m512i iacc[MT][NT];
    for (int i = 0; i < MT; ++i)
      for (int t = 0; t < NT; ++t) iacc[i][t] = _mm512_setzero_si512();
    const int k_end = (g + 1) * m.group;
    for (int k = g * m.group; k < k_end; k += step) {
      const size_t off = size_t(k / step) * 64;
      if constexpr (I4) {
        __m512i lo[MT], hi[MT];
        for (int i = 0; i < MT; ++i) {
          _mm_prefetch(reinterpret_cast<const char*>(w[i] + off + kPrefetchBytes), _MM_HINT_T0);
          const __m512i v = _mm512_load_si512(w[i] + off);
          lo[i] = _mm512_and_si512(v, low4);
          hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        for (int t = 0; t < NT; ++t) {
          const __m512i x0 = _mm512_set1_epi32(load_i32(x[t] + k));
          const __m512i x1 = _mm512_set1_epi32(load_i32(x[t] + k + 4));
          for (int i = 0; i < MT; ++i) {
            iacc[i][t] = _mm512_dpbusd_epi32(iacc[i][t], lo[i], x0);
            iacc[i][t] = _mm512_dpbusd_epi32(iacc[i][t], hi[i], x1);
          }
        }
      } else {
        __m512i wv[MT];
        for (int i = 0; i < MT; ++i) _mm_prefetch(reinterpret_cast<const char*>(w[i] + off + kPrefetchBytes), _MM_HINT_T0);
        for (int i = 0; i < MT; ++i) wv[i] = _mm512_load_si512(w[i] + off);
        for (int t = 0; t < NT; ++t) {
          const __m512i xb = _mm512_set1_epi32(load_i32(x[t] + k));
          for (int i = 0; i < MT; ++i) iacc[i][t] = _mm512_dpbusd_epi32(iacc[i][t], wv[i], xb);
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      const __m512i c = _mm512_set1_epi32(p.corr[t][g]);
      const __m512 s = _mm512_set1_ps(p.sx[t][g]);
      for (int i = 0; i < MT; ++i) {
        const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(iacc[i][t], c));
        const __m512 scale = _mm512_mul_ps(_mm512_load_ps(sc[i] + size_t(g) * 16), s);
        facc[i][t] = _mm512_fmadd_ps(f, scale, facc[i][t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < MT; ++i) _mm512_storeu_ps(out + size_t(t) * ldo + i * 16, facc[i][t]);
}

// The decode-regime driver of the AVX-512 units: row tiles outer (four in flight for memory-level
// parallelism while a call has at most 2 rows, else two), blocks of up to nt_max rows inner, so
// each tile's weights stream from memory once for all n rows. run(mt, nt, tile, p, out) runs the
// unit's MT = mt (4, 2 or 1) x NT = nt micro-kernel.
template <class Run>
void decode_tiles(const MatView& m, int tile0, int ntiles, const ActView& a, int n, float* out, size_t ldo,
                  int nt_max, Run&& run) {
  const bool is_int = m.wtype == W_INT8 || m.wtype == W_INT4;
  const size_t esize = m.wtype == W_F32 ? 4 : (m.wtype == W_BF16 || m.wtype == W_FP8 ? 2 : 1);
  const int mt_max = n <= 2 ? 4 : 2;
  for (int ti = 0; ti < ntiles; ti += mt_max) {
    const int mt = ntiles - ti < mt_max ? ntiles - ti : mt_max;
    for (int t0 = 0; t0 < n; t0 += nt_max) {
      const int nt = n - t0 < nt_max ? n - t0 : nt_max;
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
      int done = 0;
      while (done < mt) {  // mt in {1..4}: run as 4, 2 or 1 tiles (4 only while n <= 2)
        const int left = mt - done, step = left >= 4 ? 4 : (left >= 2 ? 2 : 1);
        run(step, nt, tile0 + ti + done, p, o + done * 16);
        done += step;
      }
    }
  }
}

// exp_approx (moe_generic.h) on 16 lanes: the same clamp, range reduction and polynomial.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// act_generic's epilogue, 16 lanes (one tile) at a time.
void act_avx512(const float* gu, size_t ldgu, const float* bias, int n, int rows, int act, float alpha, float limit,
                float* h, size_t ldh) {
  const int tiles = rows / 16;
  const __m512 one = _mm512_set1_ps(1.0f), lim = _mm512_set1_ps(limit), nlim = _mm512_set1_ps(-limit);
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < tiles; ++i) {
      const float* g = gu + size_t(t) * ldgu + size_t(2 * i) * 16;
      __m512 gv = _mm512_loadu_ps(g), uv = _mm512_loadu_ps(g + 16);
      if (bias) {
        gv = _mm512_add_ps(gv, _mm512_loadu_ps(bias + size_t(2 * i) * 16));
        uv = _mm512_add_ps(uv, _mm512_loadu_ps(bias + size_t(2 * i) * 16 + 16));
      }
      __m512 o;
      if (act == ACT_SILU) {
        o = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv)))), uv);
      } else {  // gpt_oss: clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate)
        gv = _mm512_min_ps(lim, gv);  // (a, b) order: a NaN in b comes through, as in act_generic
        uv = _mm512_max_ps(nlim, _mm512_min_ps(lim, uv));
        const __m512 sg = exp16(_mm512_mul_ps(_mm512_set1_ps(-alpha), gv));
        o = _mm512_mul_ps(_mm512_add_ps(uv, one), _mm512_div_ps(gv, _mm512_add_ps(one, sg)));
      }
      _mm512_storeu_ps(h + size_t(t) * ldh + size_t(i) * 16, o);
    }
}

// 12 independent zmm FMA chains (fp32 FMA peak; the bf16 dot product does 2x the flops).
double peak_avx512(int64_t iters) {
  __m512 acc[12];
  for (int j = 0; j < 12; ++j) acc[j] = _mm512_set1_ps(float(j) * 1e-3f);
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-4f);
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < 12; ++j) acc[j] = _mm512_fmadd_ps(acc[j], a, b);
  __m512 s = acc[0];
  for (int j = 1; j < 12; ++j) s = _mm512_add_ps(s, acc[j]);
  volatile float sink = _mm512_reduce_add_ps(s);
  (void)sink;
  return 2.0 * 12 * 16 * double(iters);
}

}  // namespace
}  // namespace moelab
