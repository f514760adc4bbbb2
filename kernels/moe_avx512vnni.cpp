// avx512vnni path: AVX-512 F/BW/VL/DQ + VNNI without BF16 or VBMI (Cascade Lake, Cooper Lake,
// Ice Lake; most cloud Xeons of 2019-2022). Same packed layouts as the other paths; a 16-row tile
// is one zmm, twice the AVX2 path's width, with twice its registers (32).
//  * int8 / int4 weights: the AVX-512 path's vpdpbusd kernels (moe_avx512_common.h), unchanged.
//  * bf16 weights widen to fp32 in registers (even k = bits << 16, odd k = bits & 0xffff0000) and
//    multiply the fp32 activation copies (ActView::xf) with FMA: no vdpbf16ps here.
//  * fp8 (e4m3) weights decode into fp32 lanes as on the AVX2 path: each byte moved to the top of
//    its 32-bit lane, shifted right arithmetically by 4 and masked is the fp32 of value * 2^-120
//    (exact, subnormals included); the activations arrive times kFp8XScale (2^60) and the block
//    scale times kFp8Unscale (2^52) undoes both, once per block. A 64-byte line (16 rows x 4 k) is
//    four zmm of weights in 11 integer operations; no byte tables (those need VBMI).
// Two regimes, chosen per call by the rows (tokens) an expert has, as on the AVX2 path:
//  * n < kBlockedMinRows (decode, memory-bound): weights widen in registers as they stream, each
//    loaded line used for all n rows; MT row tiles x NT tokens of accumulators.
//  * n >= kBlockedMinRows (prefill, batched decode; fp32/bf16/fp8 weights): for each pair of
//    row tiles and each kKc-long chunk of the reduction the weights are decoded once (fp8 block
//    scale applied) into a 16 KiB L1-resident fp32 scratch, and an 8-row x 32-column register
//    block (16 zmm accumulators) sweeps all n rows over it: per k two weight loads, eight
//    broadcasts and sixteen FMAs, so the FMA ports, not the loads, set the pace.
#include <immintrin.h>

#include "moe_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#include "moe_generic.h"
#include "moe_avx512_common.h"

namespace moelab {
namespace {

// The four k of one fp8 line (16 rows x bytes k+2, k, k+3, k+1 in each 32-bit lane), fp32. One
// arithmetic shift of the 16-bit words by 4 serves two bytes: the high word's top byte (k + 1)
// is in place, the low word's (k) moves up by 16; the line shifted up by 8 gives k + 3 and
// k + 2 the same way. Nine operations where a shift per byte took eleven.
inline void fp8_line_f32(const uint8_t* line, __m512& w0, __m512& w1, __m512& w2, __m512& w3) {
  const __m512i v = _mm512_load_si512(line), mask = _mm512_set1_epi32(int32_t(0x87F00000u));
  const __m512i s = _mm512_srai_epi16(v, 4), t = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 4);
  w0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(s, 16), mask));  // k
  w1 = _mm512_castsi512_ps(_mm512_and_si512(s, mask));                         // k + 1
  w2 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(t, 16), mask));  // k + 2
  w3 = _mm512_castsi512_ps(_mm512_and_si512(t, mask));                         // k + 3
}

// bf16 weights, decode regime: one line is (k, k+1) of 16 rows. One token keeps the even and odd
// k in two accumulator chains (FMA latency); more tokens have chains enough.
template <int MT, int NT>
void mk_bf16w(const MatView& m, int tile, const TilePtrs& p, float* out, size_t ldo) {
  constexpr int CH = NT == 1 ? 2 : 1;
  __m512 acc[MT][NT][CH];
  const uint16_t* w[MT];
  for (int i = 0; i < MT; ++i) w[i] = reinterpret_cast<const uint16_t*>(m.w + size_t(tile + i) * m.tile_bytes);
  for (int i = 0; i < MT; ++i)
    for (int t = 0; t < NT; ++t)
      for (int c = 0; c < CH; ++c) acc[i][t][c] = _mm512_setzero_ps();
  const __m512i hi_mask = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  for (int k = 0; k < m.kd; k += 2) {
    __m512 we[MT], wo[MT];
    for (int i = 0; i < MT; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(w[i] + size_t(k) * 16) + kPrefetchBytes, _MM_HINT_T0);
      const __m512i v = _mm512_load_si512(w[i] + size_t(k) * 16);
      we[i] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      wo[i] = _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask));
    }
    for (int t = 0; t < NT; ++t) {
      const __m512 x0 = _mm512_set1_ps(p.xf[t][k]), x1 = _mm512_set1_ps(p.xf[t][k + 1]);
      for (int i = 0; i < MT; ++i) {
        acc[i][t][0] = _mm512_fmadd_ps(we[i], x0, acc[i][t][0]);
        acc[i][t][CH - 1] = _mm512_fmadd_ps(wo[i], x1, acc[i][t][CH - 1]);
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < MT; ++i) {
      const __m512 r = CH == 2 ? _mm512_add_ps(acc[i][t][0], acc[i][t][CH - 1]) : acc[i][t][0];
      _mm512_storeu_ps(out + size_t(t) * ldo + i * 16, r);
    }
}

// fp8 weights, decode regime: per block of `group` k, fp32 sums scaled once.
template <int MT, int NT>
void mk_fp8w(const MatView& m, int tile, const TilePtrs& p, float* out, size_t ldo) {
  constexpr int CH = NT == 1 ? 2 : 1;
  const uint8_t* w[MT];
  const float* sc[MT];
  for (int i = 0; i < MT; ++i) {
    w[i] = m.w + size_t(tile + i) * m.tile_bytes;
    sc[i] = m.scales + size_t(tile + i) * m.scale_tile;
  }
  __m512 facc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int t = 0; t < NT; ++t) facc[i][t] = _mm512_setzero_ps();
  const int groups = m.kd / m.group;
  for (int g = 0; g < groups; ++g) {
    __m512 acc[MT][NT][CH];
    for (int i = 0; i < MT; ++i)
      for (int t = 0; t < NT; ++t)
        for (int c = 0; c < CH; ++c) acc[i][t][c] = _mm512_setzero_ps();
    const int k_end = (g + 1) * m.group;
    for (int k = g * m.group; k < k_end; k += 4) {
      const size_t off = size_t(k / 4) * 64;
      for (int i = 0; i < MT; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(w[i] + off + kPrefetchBytes), _MM_HINT_T0);
        __m512 w0, w1, w2, w3;
        fp8_line_f32(w[i] + off, w0, w1, w2, w3);
        for (int t = 0; t < NT; ++t) {
          const float* xk = p.xf[t] + k;
          __m512& a0 = acc[i][t][0];
          __m512& a1 = acc[i][t][CH - 1];
          a0 = _mm512_fmadd_ps(w0, _mm512_set1_ps(xk[0]), a0);
          a1 = _mm512_fmadd_ps(w2, _mm512_set1_ps(xk[2]), a1);
          a0 = _mm512_fmadd_ps(w1, _mm512_set1_ps(xk[1]), a0);
          a1 = _mm512_fmadd_ps(w3, _mm512_set1_ps(xk[3]), a1);
        }
      }
    }
    for (int i = 0; i < MT; ++i) {
      const __m512 s = _mm512_set1_ps(sc[i][g] * kFp8Unscale);  // once per (tile, block)
      for (int t = 0; t < NT; ++t) {
        const __m512 r = CH == 2 ? _mm512_add_ps(acc[i][t][0], acc[i][t][CH - 1]) : acc[i][t][0];
        facc[i][t] = _mm512_fmadd_ps(r, s, facc[i][t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < MT; ++i) _mm512_storeu_ps(out + size_t(t) * ldo + i * 16, facc[i][t]);
}

template <int MT, int NT>
void mk_dispatch(const MatView& m, int tile, const TilePtrs& p, float* out, size_t ldo) {
  if constexpr (MT * NT <= 8) {  // the driver never asks for more (register-resident blockings)
    switch (m.wtype) {
      case W_F32: mk_f32<MT, NT>(m, tile, p, out, ldo); break;
      case W_BF16: mk_bf16w<MT, NT>(m, tile, p, out, ldo); break;
      case W_INT8: mk_int<false, MT, NT>(m, tile, p, out, ldo); break;
      case W_FP8: mk_fp8w<MT, NT>(m, tile, p, out, ldo); break;
      default: mk_int<true, MT, NT>(m, tile, p, out, ldo); break;
    }
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

// ---- compute-bound path: decode a tile pair's chunk once, sweep all rows over it ----

constexpr int kBlockedMinRows = 8;  // rows per expert from which the blocked path runs
constexpr int kKc = 128;            // reduction chunk: two tiles' fp32 scratch, 16 KiB (L1)
constexpr int kNr = 8;              // rows per micro-kernel call: 8 x 2 zmm accumulators
constexpr int kMc = 96;             // rows per block (their chunk of activations stays in L2)

// Rows [k0, k0 + kc) of one packed 16-row tile into wt[k * 32 + col], fp32 (k0, kc multiples of 4).
void decode_tile(const MatView& m, int tile, int k0, int kc, float* wt) {
  const uint8_t* w = m.w + size_t(tile) * m.tile_bytes;
  if (m.wtype == W_F32) {
    for (int k = 0; k < kc; ++k)
      _mm512_store_ps(wt + size_t(k) * 32, _mm512_load_ps(reinterpret_cast<const float*>(w + size_t(k0 + k) * 64)));
  } else if (m.wtype == W_BF16) {
    const __m512i hi_mask = _mm512_set1_epi32(int32_t(0xFFFF0000u));
    for (int k = 0; k < kc; k += 2) {
      const __m512i v = _mm512_load_si512(w + size_t(k0 + k) * 32);
      _mm512_store_ps(wt + size_t(k) * 32, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
      _mm512_store_ps(wt + size_t(k + 1) * 32, _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask)));
    }
  } else {  // fp8: a 4-k line lies in one block; its scale times 2^52 undoes 2^-120 * 2^60
    const float* sc = m.scales + size_t(tile) * m.scale_tile;
    for (int k = 0; k < kc; k += 4) {
      const __m512 s = _mm512_set1_ps(sc[(k0 + k) / m.group] * kFp8Unscale);
      __m512 w0, w1, w2, w3;
      fp8_line_f32(w + size_t((k0 + k) / 4) * 64, w0, w1, w2, w3);
      float* d = wt + size_t(k) * 32;
      _mm512_store_ps(d, _mm512_mul_ps(w0, s));
      _mm512_store_ps(d + 32, _mm512_mul_ps(w1, s));
      _mm512_store_ps(d + 64, _mm512_mul_ps(w2, s));
      _mm512_store_ps(d + 96, _mm512_mul_ps(w3, s));
    }
  }
}

// The packed lines the next decode_tile of a call reads: two tiles' chunks, `lines` each.
struct NextChunk {
  const uint8_t* p[2];
  int lines;
};

// o[t][0 .. 16 NTL) (+)= sum_k wt[k * 32 + col] * x[t][k] for NR rows and NTL (1 or 2) tiles; the
// k-th step also prefetches line k of each of pf's chunks into L2.
template <int NR, int NTL>
void mk_blocked(const float* wt, int kc, const float* const* x, float* o, size_t ldo, bool add, const NextChunk& pf) {
  __m512 c[NR][NTL];
  for (int t = 0; t < NR; ++t)
    for (int j = 0; j < NTL; ++j) c[t][j] = _mm512_setzero_ps();
  for (int k = 0; k < kc; ++k) {
    if (k < pf.lines) {
      _mm_prefetch(reinterpret_cast<const char*>(pf.p[0] + size_t(k) * 64), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(pf.p[1] + size_t(k) * 64), _MM_HINT_T1);
    }
    __m512 w[NTL];
    for (int j = 0; j < NTL; ++j) w[j] = _mm512_load_ps(wt + size_t(k) * 32 + 16 * j);
    for (int t = 0; t < NR; ++t) {
      const __m512 xb = _mm512_set1_ps(x[t][k]);
      for (int j = 0; j < NTL; ++j) c[t][j] = _mm512_fmadd_ps(w[j], xb, c[t][j]);
    }
  }
  for (int t = 0; t < NR; ++t)
    for (int j = 0; j < NTL; ++j) {
      float* d = o + size_t(t) * ldo + 16 * j;
      _mm512_storeu_ps(d, add ? _mm512_add_ps(c[t][j], _mm512_loadu_ps(d)) : c[t][j]);
    }
}

template <int NTL>
void mk_blocked_n(int nr, const float* wt, int kc, const float* const* x, float* o, size_t ldo, bool add,
                  const NextChunk& pf) {
  switch (nr) {
    case 1: mk_blocked<1, NTL>(wt, kc, x, o, ldo, add, pf); break;
    case 2: mk_blocked<2, NTL>(wt, kc, x, o, ldo, add, pf); break;
    case 3: mk_blocked<3, NTL>(wt, kc, x, o, ldo, add, pf); break;
    case 4: mk_blocked<4, NTL>(wt, kc, x, o, ldo, add, pf); break;
    case 5: mk_blocked<5, NTL>(wt, kc, x, o, ldo, add, pf); break;
    case 6: mk_blocked<6, NTL>(wt, kc, x, o, ldo, add, pf); break;
    case 7: mk_blocked<7, NTL>(wt, kc, x, o, ldo, add, pf); break;
    default: mk_blocked<8, NTL>(wt, kc, x, o, ldo, add, pf); break;
  }
}

// fp32 / bf16 / fp8 weights, n >= kBlockedMinRows. Blocks of kMc rows, then chunks of the
// reduction, then tile pairs: each pair's chunk is decoded once per row block. Each pair's chunk
// is 2-8 KiB of two tiles a whole tile apart, which the hardware prefetchers meet cold; the first
// sweep over the current pair prefetches the next one's lines, one per k (in-process A/B on a
// Cascade Lake-class VM, 2026-11-28, two runs, both default shapes: bf16 +8-15 % at 256 tokens,
// +5-10 % at 64; fp8 +1-7 %). Rows stay where they are: copying them into a panel of consecutive
// rows, which would keep eight rows 4 KiB apart from sharing an L1 set, cost 10-14 % at 256
// tokens (a task's call covers four tiles, too few to amortise the copy).
void gemm_blocked(const MatView& m, int tile0, int ntiles, const ActView& a, int n, float* out,
                  size_t ldo) {
  alignas(64) float wt[kKc * 32];
  const float* xbase = m.wtype == W_F32 ? static_cast<const float*>(a.base) : a.xf;
  const float* xr[kNr];
  const size_t line_k = m.wtype == W_F32 ? 1 : (m.wtype == W_BF16 ? 2 : 4);  // k per 64-byte line
  const NextChunk none{{nullptr, nullptr}, 0};
  for (int r0 = 0; r0 < n; r0 += kMc) {
    const int r1 = n - r0 < kMc ? n : r0 + kMc;
    for (int k0 = 0; k0 < m.kd; k0 += kKc) {
      const int kc = m.kd - k0 < kKc ? m.kd - k0 : kKc;
      for (int ti = 0; ti < ntiles; ti += 2) {
        const bool two = ti + 1 < ntiles;
        decode_tile(m, tile0 + ti, k0, kc, wt);
        if (two) decode_tile(m, tile0 + ti + 1, k0, kc, wt + 16);
        NextChunk next = none;  // the pair after this one in this loop order, if any
        const int nti = ti + 2 < ntiles ? ti + 2 : 0, nk0 = ti + 2 < ntiles ? k0 : k0 + kKc;
        if (nk0 < m.kd) {
          const int nkc = m.kd - nk0 < kKc ? m.kd - nk0 : kKc;
          const uint8_t* p0 = m.w + size_t(tile0 + nti) * m.tile_bytes + size_t(nk0 / line_k) * 64;
          next = {{p0, nti + 1 < ntiles ? p0 + m.tile_bytes : p0}, int(size_t(nkc) / line_k)};
        }
        for (int t0 = r0; t0 < r1; t0 += kNr) {
          const int nr = r1 - t0 < kNr ? r1 - t0 : kNr;
          for (int t = 0; t < nr; ++t) xr[t] = xbase + size_t(a.rows[t0 + t]) * a.ld + k0;
          float* o = out + size_t(t0) * ldo + size_t(ti) * 16;
          const NextChunk& pf = t0 == r0 ? next : none;
          if (two) mk_blocked_n<2>(nr, wt, kc, xr, o, ldo, k0 > 0, pf);
          else mk_blocked_n<1>(nr, wt, kc, xr, o, ldo, k0 > 0, pf);
        }
      }
    }
  }
}

void gemm_avx512vnni(const MatView& m, int tile0, int ntiles, const ActView& a, int n, float* out,
                     size_t ldo) {
  const bool is_int = m.wtype == W_INT8 || m.wtype == W_INT4;
  if (!is_int && n >= kBlockedMinRows) {
    gemm_blocked(m, tile0, ntiles, a, n, out, ldo);
    return;
  }
  // MT x NT (x 2 chains for one token) accumulators fit the registers with the widened weights
  decode_tiles(m, tile0, ntiles, a, n, out, ldo, 4, [&](int mt, int nt, int tile, const TilePtrs& p, float* o) {
    if (mt == 4) mk_nt<4>(nt, m, tile, p, o, ldo);
    else if (mt == 2) mk_nt<2>(nt, m, tile, p, o, ldo);
    else mk_nt<1>(nt, m, tile, p, o, ldo);
  });
}

}  // namespace

IsaOps avx512vnni_ops() { return IsaOps{gemm_avx512vnni, quant_generic, act_avx512, peak_avx512}; }

}  // namespace moelab
#pragma GCC pop_options
