// AMX path (AMX-TILE + AMX-BF16 on top of the AVX-512 path: Sapphire Rapids and later).
//
// Compute-bound calls (an expert with >= kAmxMinRows tokens) of bf16 and fp8 weights run on
// tiles: C[16 tokens x 16 rows] += A[16 tokens x 32 k] . B[32 k x 16 rows] with tdpbf16ps.
// The packed bf16 layout ([Kd/2][16][2]) already is AMX's VNNI layout for B, so a B tile is
// 16 consecutive 64-byte lines of a weight tile, loaded in place. fp8 weights are decoded
// exactly to bf16 (moe_avx512_shared.h) once per call and weight tile into a per-thread buffer in
// that layout; every token block then reuses it, and each block of `group` k is accumulated in
// fresh C tiles that are scaled into fp32 sums once per block (the AVX-512 path's order).
// Activation rows come straight from the caller's buffer when they are consecutive (stage 2,
// and stage 1 once the driver gathered them per expert); a last block of fewer than 16 tokens
// and any non-consecutive rows are copied into a zero-padded per-thread buffer. A reduction
// length that is not a multiple of 32 ends with AVX-512 dot products on the stored sums.
// Register blocking: 2 token blocks x 2 weight tiles of C (tmm0-3), A in tmm4-5, B in tmm6-7.
// Everything else (fp32/int weights, decode-sized calls) is the AVX-512 path.
//
// Linux hands a thread AMX state only after the process asked for it (arch_prctl
// ARCH_REQ_XCOMP_PERM, kernel >= 5.16): amx_usable() asks once; without it this path is the
// AVX-512 one. Each call loads its tile configuration (other libraries, e.g. oneDNN inside
// torch, configure tiles on the same threads) and releases the tiles when it returns.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

#include "moe_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx512vbmi,avx2,fma,f16c,amx-tile,amx-bf16,amx-int8")
#include "moe_generic.h"
#include "moe_avx512_shared.h"

namespace moelab {

bool amx_usable() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kXtiledata = 18;         // XFEATURE_XTILEDATA
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512bf16")) return false;
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
    return tile && bf16 && syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Eight 16 x 64-byte tiles: C 0-3 (fp32), A 4-5 and B 6-7 (bf16 pairs).
struct Tiles {
  Tiles() {
    TileConfig c;
    for (int i = 0; i < 8; ++i) {
      c.colsb[i] = 64;
      c.rows[i] = 16;
    }
    _tile_loadconfig(&c);
  }
  ~Tiles() { _tile_release(); }
};

template <typename T>
T* aligned_buffer(std::vector<T>& v, size_t n) {
  v.resize(n + 64 / sizeof(T));
  const uintptr_t p = reinterpret_cast<uintptr_t>(v.data());
  return reinterpret_cast<T*>((p + 63) & ~uintptr_t(63));
}

// A block of 16 token rows: k-step s's tile is at p + s * step, its rows stride bytes apart.
struct ATile {
  const uint8_t* p;
  size_t stride, step;
};

// C tiles for MI token blocks x NJ weight tiles over k-steps [s0, s1) (32 k each); stored to
// c[(i * NJ + j) * 256 + token * 16 + row].
template <int MI, int NJ>
void run_tiles(const ATile a[2], const uint8_t* const b[2], int s0, int s1, float* c) {
  _tile_zero(0);
  if constexpr (NJ > 1) _tile_zero(1);
  if constexpr (MI > 1) _tile_zero(2);
  if constexpr (MI > 1 && NJ > 1) _tile_zero(3);
  for (int s = s0; s < s1; ++s) {
    if (s + 1 < s1) {  // the next step's tiles into L1 while this step's multiply
      for (int l = 0; l < 1024; l += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(b[0] + size_t(s + 1) * 1024 + l), _MM_HINT_T0);
        if constexpr (NJ > 1) _mm_prefetch(reinterpret_cast<const char*>(b[1] + size_t(s + 1) * 1024 + l), _MM_HINT_T0);
      }
      for (int r = 0; r < 16; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(a[0].p + size_t(s + 1) * a[0].step + r * a[0].stride), _MM_HINT_T0);
        if constexpr (MI > 1) _mm_prefetch(reinterpret_cast<const char*>(a[1].p + size_t(s + 1) * a[1].step + r * a[1].stride), _MM_HINT_T0);
      }
    }
    _tile_loadd(6, b[0] + size_t(s) * 1024, 64);
    _tile_loadd(4, a[0].p + size_t(s) * a[0].step, a[0].stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NJ > 1) {
      _tile_loadd(7, b[1] + size_t(s) * 1024, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (MI > 1) {
      _tile_loadd(5, a[1].p + size_t(s) * a[1].step, a[1].stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NJ > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (NJ > 1) _tile_stored(1, c + 256, 64);
  if constexpr (MI > 1) _tile_stored(2, c + NJ * 256, 64);
  if constexpr (MI > 1 && NJ > 1) _tile_stored(3, c + 3 * 256, 64);
}

using RunFn = void (*)(const ATile[2], const uint8_t* const[2], int, int, float*);
RunFn run_for(int mi, int nj) {
  if (mi == 2) return nj == 2 ? run_tiles<2, 2> : run_tiles<2, 1>;
  return nj == 2 ? run_tiles<1, 2> : run_tiles<1, 1>;
}

// Per-thread scratch, reused across calls.
struct Scratch {
  std::vector<uint16_t> rows, pad[2], wdec;
  std::vector<float> c, acc;
};
thread_local Scratch scratch;

// Weight tile j of this call as bf16 B tiles: in place (bf16) or decoded from fp8.
const uint8_t* b_tiles(const MatView& m, int tile, uint16_t* dec) {
  const uint8_t* w = m.w + size_t(tile) * m.tile_bytes;
  if (m.wtype == W_BF16) return w;
  const Fp8Tables tb = fp8_tables();
  for (int q = 0; q < m.kd / 4; ++q) {
    __m512i p01, p23;
    fp8_line_to_bf16(tb, w + size_t(q) * 64, p01, p23);
    _mm512_store_si512(dec + size_t(q) * 64, p01);
    _mm512_store_si512(dec + size_t(q) * 64 + 32, p23);
  }
  return reinterpret_cast<const uint8_t*>(dec);
}

// The reduction's tail (kd % 32 k, bf16 only) for one token row: acc[16] += W[tail] . x[tail],
// w at the tail's first line (k2 pairs of lines), x at its first k.
void tail_dot(const uint8_t* w, int k2, const uint16_t* x, float* acc) {
  __m512 v = _mm512_loadu_ps(acc);
  for (int q = 0; q < k2; ++q) {
    int32_t pair;
    __builtin_memcpy(&pair, x + 2 * q, 4);
    v = _mm512_dpbf16_ps(v, (__m512bh)_mm512_load_si512(w + size_t(q) * 64), (__m512bh)_mm512_set1_epi32(pair));
  }
  _mm512_storeu_ps(acc, v);
}

// The A tile rows of the block of 16 tokens from r0: from the call's panel (consecutive tiles),
// else in place when all 16 rows exist, else copied (zero rows below the tokens) into pad.
// tail[r]: row r's k from 32 * (kd / 32) on (the reduction's tail, kd % 32 of them).
ATile a_block(const ActView& a, const uint16_t* x0, size_t ld, int r0, int n, int kd,
              std::vector<uint16_t>& pad, const uint16_t* tail[16]) {
  const int valid = n - r0 < 16 ? n - r0 : 16, k32 = kd / 32 * 32;
  if (a.panel) {
    const uint16_t* blk = a.panel + amx_panel_at(size_t(r0), 0, kd);
    for (int r = 0; r < valid; ++r) tail[r] = blk + size_t(k32 / 32) * 512 + size_t(r) * 32;
    return ATile{reinterpret_cast<const uint8_t*>(blk), 64, 1024};
  }
  for (int r = 0; r < valid; ++r) tail[r] = x0 + size_t(r0 + r) * ld + k32;
  if (valid == 16) return ATile{reinterpret_cast<const uint8_t*>(x0 + size_t(r0) * ld), 2 * ld, 64};
  uint16_t* p = aligned_buffer(pad, size_t(16) * kd);
  __builtin_memset(p, 0, size_t(16) * kd * 2);
  for (int r = 0; r < valid; ++r) __builtin_memcpy(p + size_t(r) * kd, x0 + size_t(r0 + r) * ld, 2 * size_t(kd));
  return ATile{reinterpret_cast<const uint8_t*>(p), 2 * size_t(kd), 64};
}

// acc[(i, j)] = sum over the scale blocks of scale(tile j, block) * C(block) (fp8), or C (bf16).
void accumulate(RunFn run, const ATile ap[2], const uint8_t* const b[2],
                const float* const scl[2], int mi, int nj, int steps, int block_steps, float* c, float* acc) {
  if (!scl[0]) {
    run(ap, b, 0, steps, acc);
    return;
  }
  for (int q = 0; q < mi * nj * 256; ++q) acc[q] = 0.0f;
  for (int g = 0; g * block_steps < steps; ++g) {
    run(ap, b, g * block_steps, (g + 1) * block_steps, c);
    for (int i = 0; i < mi; ++i)
      for (int j = 0; j < nj; ++j) {
        const __m512 s = _mm512_set1_ps(scl[j][g]);  // once per (tile, block)
        const float* ct = c + (i * nj + j) * 256;
        float* at = acc + (i * nj + j) * 256;
        for (int r = 0; r < 16; ++r)
          _mm512_store_ps(at + 16 * r, _mm512_fmadd_ps(_mm512_load_ps(ct + 16 * r), s, _mm512_load_ps(at + 16 * r)));
      }
  }
}

// Token blocks outer, weight tile pairs inner: a block's rows are read from memory once and
// stay in L2 for every weight tile of the call; the call's weight tiles (in place, or decoded)
// stay in L2 for every token block.
void gemm_tiles(const MatView& m, int tile0, int ntiles, const ActView& a, int n, float* out, size_t ldo) {
  Scratch& sc = scratch;
  const int kd = m.kd, steps = kd / 32, k2_32 = steps * 16;
  const bool fp8 = m.wtype == W_FP8;
  const int block_steps = fp8 ? m.group / 32 : steps;  // fp8: a scale per (tile, block)
  // A: consecutive rows are read in place; otherwise gathered once.
  const uint16_t* base = static_cast<const uint16_t*>(a.base);
  bool consecutive = true;
  for (int t = 1; t < n && consecutive && !a.panel; ++t) consecutive = a.rows[t] == a.rows[0] + t;
  const uint16_t* x0 = a.panel ? nullptr : base + size_t(a.rows[0]) * a.ld;
  size_t ld = a.ld;
  if (!consecutive) {
    uint16_t* g = aligned_buffer(sc.rows, size_t(n) * kd);
    for (int t = 0; t < n; ++t) __builtin_memcpy(g + size_t(t) * kd, base + size_t(a.rows[t]) * a.ld, 2 * size_t(kd));
    x0 = g;
    ld = size_t(kd);
  }
  uint16_t* dec = fp8 ? aligned_buffer(sc.wdec, size_t(ntiles) * kd * 16) : nullptr;
  std::vector<const uint8_t*> bt(ntiles);
  for (int j = 0; j < ntiles; ++j) bt[j] = b_tiles(m, tile0 + j, dec ? dec + size_t(j) * kd * 16 : nullptr);
  float* c = aligned_buffer(sc.c, 4 * 256);
  float* acc = aligned_buffer(sc.acc, 4 * 256);
  Tiles tiles;
  for (int i0 = 0; i0 < n; i0 += 32) {
    const int mi = n - i0 > 16 ? 2 : 1;
    ATile ap[2];
    const uint16_t* tail[2][16];
    for (int i = 0; i < mi; ++i) ap[i] = a_block(a, x0, ld, i0 + 16 * i, n, kd, sc.pad[i], tail[i]);
    for (int j0 = 0; j0 < ntiles; j0 += 2) {
      const int nj = ntiles - j0 >= 2 ? 2 : 1;
      const uint8_t* b[2] = {bt[j0], nj > 1 ? bt[j0 + 1] : nullptr};
      const float* scl[2] = {nullptr, nullptr};
      for (int j = 0; j < nj && fp8; ++j) scl[j] = m.scales + size_t(tile0 + j0 + j) * m.scale_tile;
      accumulate(run_for(mi, nj), ap, b, scl, mi, nj, steps, block_steps, c, acc);
      for (int i = 0; i < mi; ++i)
        for (int j = 0; j < nj; ++j) {
          const int r0 = i0 + 16 * i, valid = n - r0 < 16 ? n - r0 : 16;
          float* at = acc + (i * nj + j) * 256;
          for (int r = 0; r < valid; ++r) {
            if (k2_32 < kd / 2) tail_dot(b[j] + size_t(k2_32) * 64, kd / 2 - k2_32, tail[i][r], at + 16 * r);
            __builtin_memcpy(out + size_t(r0 + r) * ldo + size_t(j0 + j) * 16, at + 16 * r, 64);
          }
        }
    }
  }
}

void gemm_amx(const MatView& m, int tile0, int ntiles, const ActView& a, int n, float* out, size_t ldo) {
  if (amx_tiles(m.wtype, m.kd, m.group, n) && amx_usable()) gemm_tiles(m, tile0, ntiles, a, n, out, ldo);
  else avx512_ops().gemm(m, tile0, ntiles, a, n, out, ldo);
}

// Eight independent tdpbf16ps chains... on four C tiles from two A and two B tiles: the bf16
// tile peak (2 * 16 * 16 * 32 flops per instruction).
double peak_amx(int64_t iters) {
  if (!amx_usable()) return 0.0;
  std::vector<uint16_t> buf(16 * 32 * 4 + 32, 0x3f80);  // ones
  uint16_t* p = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
  Tiles tiles;
  _tile_loadd(4, p, 64);
  _tile_loadd(5, p + 512, 64);
  _tile_loadd(6, p + 1024, 64);
  _tile_loadd(7, p + 1536, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float sink[256];
  _tile_stored(0, sink, 64);
  volatile float keep = sink[0];
  (void)keep;
  return 4.0 * 2 * 16 * 16 * 32 * double(iters);
}

}  // namespace

IsaOps amx_ops() {
  const IsaOps base = avx512_ops();
  return IsaOps{gemm_amx, base.quant, base.act, peak_amx};
}

}  // namespace moelab
#pragma GCC pop_options
