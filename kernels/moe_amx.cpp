// AMX path (AMX-TILE, -BF16 and -INT8 on top of the AVX-512 path: Sapphire Rapids and later).
//
// Compute-bound calls (an expert with >= amx_min_rows(wtype) tokens: 4-8, moe_kernels.h) run on tiles:
// C[16 tokens x 16 rows] += A[16 tokens x 64 bytes of k] . B[64 bytes of k x 16 rows].
//  * bf16 / fp8 weights: tdpbf16ps, 32 k a step. The packed bf16 layout ([Kd/2][16][2]) already
//    is AMX's VNNI layout for B, so a B tile is 16 consecutive 64-byte lines of a weight tile,
//    loaded in place. fp8 weights are decoded exactly to bf16 (moe_avx512_shared.h) into a
//    per-thread buffer in that layout, one k-step ahead of the tile multiplies that read it (the
//    vector ports decode while the AMX unit multiplies; per scale block while the call has at
//    most 32 rows, else once per call and weight tile), and each block of `group` k
//    is summed in fresh C tiles that are scaled into fp32 sums once per block (the AVX-512
//    path's order). A bf16 reduction that is not a multiple of 32 ends with AVX-512 dot products.
//  * int8 / int4 weights (groups of 64 or 128): tdpbsud, 64 k a step, the int8 activations
//    (signed) against the unsigned offset weights; the int8 layout is the VNNI layout for B,
//    int4 nibbles are unpacked to bytes as fp8 tiles are decoded. Each group's int32 sums get the
//    offset correction and both scales in fp32, as on the AVX-512 path.
// Activation rows come as the driver's A panels (amx_panel_at: 1 KiB per tile, consecutive),
// else straight from the caller's buffer when consecutive; a last block of fewer than 16 tokens
// and any non-consecutive rows are copied into a zero-padded per-thread buffer.
// Register blocking: 2 token blocks x 2 weight tiles of C (tmm0-3), A in tmm4-5, B in tmm6-7.
// Everything else (fp32 weights, groups of 32, decode-sized calls) is the AVX-512 path.
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

namespace moelab {

// Baseline code (no target pragma): cpu_features() calls it on every CPU.
bool amx_usable() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kXtiledata = 18;         // XFEATURE_XTILEDATA
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512bf16")) return false;
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1, int8 = (d >> 25) & 1;
    return tile && bf16 && int8 && syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

}  // namespace moelab

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx512vbmi,avx2,fma,f16c,amx-tile,amx-bf16,amx-int8")
#include "moe_generic.h"
#include "moe_avx512_shared.h"

namespace moelab {

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Eight 16 x 64-byte tiles: C 0-3 (fp32 / int32), A 4-5 and B 6-7 (bf16 pairs / int8 quads).
struct Tiles {
  explicit Tiles(int rows0 = 16) {
    TileConfig c;
    for (int i = 0; i < 8; ++i) {
      c.colsb[i] = 64;
      c.rows[i] = 16;
    }
    c.rows[0] = c.rows[1] = c.rows[4] = uint8_t(rows0);
    // Volatile asm with a memory clobber rather than _tile_loadconfig: GCC treats that builtin as
    // a read of a local nothing else reads and may sink it past the calls that run the tiles (it
    // did in a trial restructuring of gemm_tiles: tilezero faulted, unconfigured).
    asm volatile("ldtilecfg %0" : : "m"(c) : "memory");
  }
  ~Tiles() { asm volatile("tilerelease" : : : "memory"); }
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

// `lines` packed 64-byte lines from w decoded into dec (128 bytes each: two B-tile lines): fp8 ->
// exact bf16 pairs, int4 -> one int8 line of its low nibbles (k..k+3) and one of its high nibbles
// (k+4..k+7), unsigned like int8's q + 128. A k-step is 8 packed lines of either. Each line is read
// from memory just after its request kPrefetchBytes ahead.
inline void decode_lines(const Fp8Tables& tb, int wtype, const uint8_t* w, int lines, uint8_t* dec) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int q = 0; q < lines; ++q) {
    __m512i x, y;
    _mm_prefetch(reinterpret_cast<const char*>(w + size_t(q) * 64 + kPrefetchBytes), _MM_HINT_T0);
    if (wtype == W_FP8) {
      fp8_line_to_bf16(tb, w + size_t(q) * 64, x, y);
    } else {
      const __m512i v = _mm512_load_si512(w + size_t(q) * 64);
      x = _mm512_and_si512(v, low4);
      y = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    _mm512_store_si512(dec + size_t(q) * 128, x);
    _mm512_store_si512(dec + size_t(q) * 128 + 64, y);
  }
}

// Weights decoded on the way (fp8, int4): weight tile j's packed steps start at raw[j] (512 bytes
// a step), its B tiles go to the run's b[j] (1 KiB a step from s0 on).
struct Decode {
  const uint8_t* raw[2];
  int wtype;
};

// C tiles for MI token blocks x NJ weight tiles over k-steps [s0, s1) (64 bytes of each row per
// step: 32 bf16 k with tdpbf16ps, or 64 int8 k with tdpbsud: signed activations x unsigned,
// offset weights), stored to c[(i * NJ + j) * 256 + token * 16 + row] (fp32, or int32 bits).
// b[j] holds the weight tile's steps from s0 on (1 KiB each). With DEC the run first decodes them
// there (d), one step ahead of the tile multiplies: the tiles multiply step s in the AMX unit while
// the vector ports decode step s + 1, instead of a whole block's decode and then its multiplies.
template <int MI, int NJ, bool INT, bool DEC = false>
void run_tiles(const ATile a[2], const uint8_t* const b[2], int s0, int s1, float* c, const Decode* d = nullptr) {
  const auto decode_step = [&](int s) {
    for (int j = 0; j < NJ; ++j)
      decode_lines(fp8_tables(), d->wtype, d->raw[j] + size_t(s) * 512, 8,
                   const_cast<uint8_t*>(b[j]) + size_t(s - s0) * 1024);  // b[j] is the run's own buffer
  };
  if constexpr (DEC) decode_step(s0);
  _tile_zero(0);
  if constexpr (NJ > 1) _tile_zero(1);
  if constexpr (MI > 1) _tile_zero(2);
  if constexpr (MI > 1 && NJ > 1) _tile_zero(3);
  for (int s = s0; s < s1; ++s) {
    if (s + 1 < s1) {  // the next step's tiles into L1 while this step's multiply (decoded ones are)
      if constexpr (!DEC)
        for (int l = 0; l < 1024; l += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(b[0] + size_t(s + 1 - s0) * 1024 + l), _MM_HINT_T0);
          if constexpr (NJ > 1) _mm_prefetch(reinterpret_cast<const char*>(b[1] + size_t(s + 1 - s0) * 1024 + l), _MM_HINT_T0);
        }
      for (int r = 0; r < 16; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(a[0].p + size_t(s + 1) * a[0].step + r * a[0].stride), _MM_HINT_T0);
        if constexpr (MI > 1) _mm_prefetch(reinterpret_cast<const char*>(a[1].p + size_t(s + 1) * a[1].step + r * a[1].stride), _MM_HINT_T0);
      }
    }
    _tile_loadd(6, b[0] + size_t(s - s0) * 1024, 64);
    _tile_loadd(4, a[0].p + size_t(s) * a[0].step, a[0].stride);
    if constexpr (INT) _tile_dpbsud(0, 4, 6); else _tile_dpbf16ps(0, 4, 6);
    if constexpr (NJ > 1) {
      _tile_loadd(7, b[1] + size_t(s - s0) * 1024, 64);
      if constexpr (INT) _tile_dpbsud(1, 4, 7); else _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (MI > 1) {
      _tile_loadd(5, a[1].p + size_t(s) * a[1].step, a[1].stride);
      if constexpr (INT) _tile_dpbsud(2, 5, 6); else _tile_dpbf16ps(2, 5, 6);
      if constexpr (NJ > 1) { if constexpr (INT) _tile_dpbsud(3, 5, 7); else _tile_dpbf16ps(3, 5, 7); }
    }
    if constexpr (DEC)
      if (s + 1 < s1) decode_step(s + 1);
  }
  _tile_stored(0, c, 64);
  if constexpr (NJ > 1) _tile_stored(1, c + 256, 64);
  if constexpr (MI > 1) _tile_stored(2, c + NJ * 256, 64);
  if constexpr (MI > 1 && NJ > 1) _tile_stored(3, c + 3 * 256, 64);
}

using RunFn = void (*)(const ATile[2], const uint8_t* const[2], int, int, float*, const Decode*);
template <bool INT, bool DEC = false>
RunFn run_for(int mi, int nj) {
  if (mi == 2) return nj == 2 ? run_tiles<2, 2, INT, DEC> : run_tiles<2, 1, INT, DEC>;
  return nj == 2 ? run_tiles<1, 2, INT, DEC> : run_tiles<1, 1, INT, DEC>;
}

// Per-thread scratch, reused across calls.
struct Scratch {
  std::vector<uint8_t> pad, wdec;
  std::vector<float> c, acc;
};
thread_local Scratch scratch;

// run_tiles over steps [s0, s1) of weight tiles tile, tile + 1 (nj of them), decoding them into b
// on the way (fp8, int4).
__attribute__((noinline)) void run_decoding(const MatView& m, int tile, int mi, int nj, const ATile a[2],
                                            const uint8_t* const b[2], int s0, int s1, float* c) {
  Decode d{{nullptr, nullptr}, m.wtype};
  for (int j = 0; j < nj; ++j) d.raw[j] = m.w + size_t(tile + j) * m.tile_bytes;
  (m.wtype == W_INT4 ? run_for<true, true>(mi, nj) : run_for<false, true>(mi, nj))(a, b, s0, s1, c, &d);
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

// The A tile rows of the block of 16 tokens from r0 (x0: row-major rows ld bytes apart): from
// the call's panel (consecutive tiles), else in place when all 16 rows exist, else copied (zero
// rows below the tokens) into pad (only a call's last block is partial, so one pad serves). tail[r]: row r's bytes from the last whole step on.
ATile a_block(const ActView& a, const uint8_t* x0, size_t ld, int r0, int n, size_t rb, std::vector<uint8_t>& pad,
              const uint8_t* tail[16]) {
  const int valid = n - r0 < 16 ? n - r0 : 16;
  const size_t whole = rb / 64 * 64;
  if (a.panel) {
    const uint8_t* blk = a.panel + amx_panel_at(size_t(r0), 0, rb);
    for (int r = 0; r < valid; ++r) tail[r] = blk + (whole / 64) * 1024 + size_t(r) * 64;
    return ATile{blk, 64, 1024};
  }
  for (int r = 0; r < valid; ++r) tail[r] = x0 + size_t(r0 + r) * ld + whole;
  if (valid == 16) return ATile{x0 + size_t(r0) * ld, ld, 64};
  uint8_t* p = aligned_buffer(pad, 16 * rb);
  __builtin_memset(p, 0, 16 * rb);
  for (int r = 0; r < valid; ++r) __builtin_memcpy(p + size_t(r) * rb, x0 + size_t(r0 + r) * ld, rb);
  return ATile{p, rb, 64};
}

// What turns each block of steps' C tiles into the fp32 sums: nothing (bf16: one block, or a
// chunk's sums added), the block scale (fp8), or the group's offset correction and scales (int8/int4).
struct Epilogue {
  const MatView* m;
  const ActView* a;
  int tile0, j0, i0, n;
};

// acc[(i, j)] (+)= C of block g, scaled as the weight type asks. int8/int4: each token block's
// activation scales and offset corrections for the group are gathered once for all its weight
// tiles, so the per-row loop is the four vector operations alone (the tile multiplies of a group
// of 64 take about as long as this fold: in the loop, the index arithmetic and the reloads of the
// views' fields that stores might alias had doubled its cost).
void fold_block(const Epilogue& ep, int mi, int nj, int g, const float* c, float* acc) {
  const MatView& m = *ep.m;
  const bool scaled_rows = m.wtype != W_BF16 && m.wtype != W_FP8;  // int8 / int4
  for (int i = 0; i < mi; ++i) {
    const int r0 = ep.i0 + 16 * i, valid = ep.n - r0 < 16 ? ep.n - r0 : 16;
    alignas(64) float sx[16];
    alignas(64) int32_t corr[16];
    if (scaled_rows) {
      const ActView& a = *ep.a;
      for (int r = 0; r < valid; ++r) {
        const size_t row = size_t(a.rows[r0 + r]) * a.ldg + g;
        sx[r] = a.sx[row];
        corr[r] = a.corr[row];
      }
    }
    for (int j = 0; j < nj; ++j) {
      const float* ct = c + (i * nj + j) * 256;
      float* at = acc + (i * nj + j) * 256;
      const size_t tile = size_t(ep.tile0 + ep.j0 + j);
      if (!scaled_rows) {  // bf16: a chunk's sums, unscaled; fp8: the block scale
        const __m512 s = _mm512_set1_ps(m.wtype == W_BF16 ? 1.0f : m.scales[tile * m.scale_tile + g]);
        for (int r = 0; r < valid; ++r)
          _mm512_store_ps(at + 16 * r, _mm512_fmadd_ps(_mm512_load_ps(ct + 16 * r), s, _mm512_load_ps(at + 16 * r)));
        continue;
      }
      const __m512 sw = _mm512_load_ps(m.scales + tile * m.scale_tile + size_t(g) * 16);
      for (int r = 0; r < valid; ++r) {  // (C - offset * sum(q)) * weight scale * activation scale
        const __m512i ci = _mm512_sub_epi32(_mm512_load_si512(ct + 16 * r), _mm512_set1_epi32(corr[r]));
        const __m512 f = _mm512_mul_ps(sw, _mm512_set1_ps(sx[r]));
        _mm512_store_ps(at + 16 * r, _mm512_fmadd_ps(_mm512_cvtepi32_ps(ci), f, _mm512_load_ps(at + 16 * r)));
      }
    }
  }
}

// What a call's loop nest may keep in L2 (bytes of weight tiles and activation rows) before it
// splits the reduction into chunks (below); half of the 2 MiB L2 of Sapphire/Emerald Rapids.
constexpr size_t kL2Budget = size_t(1) << 20;

// Loop order. Token-block pairs outer, weight tile pairs inner: a pair's rows are read once and
// stay in L2 for every weight tile of the call, and the call's weight tiles (in place, or decoded)
// stay in L2 for the later token-block pairs. That holds while the call's tiles and one pair's
// rows fit in kL2Budget; a call with more than one token-block pair over longer rows (a 14336-long
// down projection: 4 tiles are 1.8 MiB in bf16) would read its tiles from memory again for every
// pair. Such a call runs the reduction in chunks of steps sized so that its tiles' and all its
// rows' chunks fit, weight tile pairs outer and token-block pairs inner within a chunk: each
// weight line comes from memory once, the later pairs reading it from L2, and each (pair, tile
// pair) keeps its fp32 sums across chunks. Size: one loop nest over (chunks, token block pairs,
// weight tile pairs, scale blocks); splitting it further would pass its dozen locals around.
void gemm_tiles(const MatView& m, int tile0, int ntiles, const ActView& a, int n, float* out, size_t ldo) {
  Scratch& sc = scratch;
  const bool is_int = m.wtype == W_INT8 || m.wtype == W_INT4, fp8 = m.wtype == W_FP8;
  const size_t esz = is_int ? 1 : 2, rb = size_t(m.kd) * esz;  // bytes of a row
  const int steps = int(rb / 64), block = is_int || fp8 ? int(size_t(m.group) * esz / 64) : steps;
  const int tail_k2 = m.wtype == W_BF16 ? int(rb % 64) / 4 : 0;  // bf16 pairs after the last step
  // A: the panel, or consecutive row-major rows read in place (gemm_amx sends nothing else)
  const size_t ld = a.ld * esz;
  const uint8_t* x0 = a.panel ? nullptr : static_cast<const uint8_t*>(a.base) + size_t(a.rows[0]) * ld;
  const int npi = (n + 31) / 32, npj = (ntiles + 1) / 2;  // token-block pairs, weight tile pairs
  // chunk: steps of the reduction per pass (all of them unless the call outgrows kL2Budget)
  int chunk = steps;
  if (npi > 1 && (size_t(ntiles) * 16 + 32) * rb > kL2Budget) {
    const int unit = m.wtype == W_BF16 ? 4 : block;  // bf16: 128 k a chunk at least (each chunk adds a fold)
    const int fit = int(kL2Budget / ((size_t(ntiles) * 16 + size_t(n)) * 64)) / unit * unit;
    chunk = fit < unit ? unit : (fit < steps ? fit : steps);
  }
  const bool chunked = chunk < steps;
  // Decoded weights (fp8, int4) are decoded by the first token-block pair's runs, one step ahead
  // of its tile multiplies (run_tiles<..., DEC>). Rows that fit one such pair use each weight once,
  // so each scale block of a tile pair is decoded into the same 2 x block KiB (L1); more rows
  // keep every tile's chunk of the reduction (L2) for the later token-block pairs.
  const bool decoded = fp8 || m.wtype == W_INT4, stream = decoded && n <= 32;
  const size_t dec_tile = size_t(stream ? block : chunk) * 1024;
  uint8_t* dec = decoded ? aligned_buffer(sc.wdec, size_t(stream ? 2 : ntiles) * dec_tile) : nullptr;
  std::vector<const uint8_t*> bt(ntiles);  // each weight tile's B tiles: in place (bf16, int8), or decoded
  for (int j = 0; j < ntiles; ++j)
    bt[j] = decoded ? dec + size_t(stream ? 0 : j) * dec_tile : m.w + size_t(tile0 + j) * m.tile_bytes;
  float* c = aligned_buffer(sc.c, 4 * 256);
  // fp32 sums: one (pair, tile pair) at a time, or all of them when they outlive a chunk
  float* acc0 = aligned_buffer(sc.acc, size_t(chunked ? npi * npj : 1) * 4 * 256);
  std::vector<ATile> ap(size_t(npi) * 2);
  std::vector<const uint8_t*> tail(size_t(npi) * 32);
  for (int ip = 0; ip < npi; ++ip)  // only a call's last block is partial: one pad serves
    for (int i = 0; i < (n - 32 * ip > 16 ? 2 : 1); ++i)
      ap[2 * ip + i] = a_block(a, x0, ld, 32 * ip + 16 * i, n, rb, sc.pad, &tail[size_t(32 * ip + 16 * i)]);
  Tiles tiles(n < 16 ? n : 16);
  for (int c0 = 0; c0 < steps; c0 += chunk) {
    const int c1 = steps - c0 < chunk ? steps : c0 + chunk;
    for (int o = 0; o < npi * npj; ++o) {
      const int ip = chunked ? o % npi : o / npj, jp = chunked ? o / npi : o % npj;
      const int i0 = 32 * ip, j0 = 2 * jp;
      const int mi = n - i0 > 16 ? 2 : 1, nj = ntiles - j0 >= 2 ? 2 : 1;
      const ATile* api = &ap[2 * ip];
      float* acc = acc0 + (chunked ? size_t(ip * npj + jp) * 4 * 256 : 0);
      const uint8_t* b[2] = {bt[j0], nj > 1 ? bt[j0 + 1] : nullptr};
      const RunFn run = is_int ? run_for<true>(mi, nj) : run_for<false>(mi, nj);
      if (m.wtype == W_BF16 && !chunked) {  // one block, no scales
        run(api, b, 0, steps, acc, nullptr);
      } else {
        const Epilogue ep{&m, &a, tile0, j0, i0, n};
        const int blk = m.wtype == W_BF16 ? chunk : block;  // steps per fold (bf16: a chunk, unscaled)
        if (c0 == 0) __builtin_memset(acc, 0, sizeof(float) * 4 * 256);
        for (int g = c0 / blk; g * blk < c1; ++g) {
          const int s0 = g * blk, s1 = c1 - s0 < blk ? c1 : s0 + blk;
          const uint8_t* bg[2] = {nullptr, nullptr};
          for (int j = 0; j < nj; ++j)  // decoded per call: the tile's buffer holds this chunk
            bg[j] = stream ? dec + size_t(j) * dec_tile : b[j] + size_t(decoded ? s0 - c0 : s0) * 1024;
          // int8 weights read once, in place: their lines kPrefetchBytes ahead and the scales two
          // groups ahead (run_tiles prefetches only within a group, so nothing for groups of 64)
          if (m.wtype == W_INT8 && n <= 32)
            for (int j = 0; j < nj; ++j) {
              for (int l = 0; l < block * 1024; l += 64)
                _mm_prefetch(reinterpret_cast<const char*>(bg[j] + kPrefetchBytes + l), _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(m.scales + size_t(tile0 + j0 + j) * m.scale_tile +
                                                         size_t(g + 2) * 16), _MM_HINT_T0);
            }
          if (decoded && i0 == 0) run_decoding(m, tile0 + j0, mi, nj, api, bg, s0, s1, c);
          else run(api, bg, s0, s1, c, nullptr);
          fold_block(ep, mi, nj, g, c, acc);
        }
      }
      if (c1 < steps) continue;  // the sums are complete after the last chunk
      for (int i = 0; i < mi; ++i)
        for (int j = 0; j < nj; ++j) {
          const int r0 = i0 + 16 * i, valid = n - r0 < 16 ? n - r0 : 16;
          float* at = acc + (i * nj + j) * 256;
          for (int r = 0; r < valid; ++r) {
            if (tail_k2)
              tail_dot(m.w + size_t(tile0 + j0 + j) * m.tile_bytes + size_t(steps) * 1024, tail_k2,
                       reinterpret_cast<const uint16_t*>(tail[size_t(r0 + r)]), at + 16 * r);
            __builtin_memcpy(out + size_t(r0 + r) * ldo + size_t(j0 + j) * 16, at + 16 * r, 64);
          }
        }
    }
  }
}

// Tiles for the calls the driver laid panels out for (amx_tiles) and for consecutive rows (stage 2
// of int weights); anything else is the AVX-512 kernel's.
void gemm_amx(const MatView& m, int tile0, int ntiles, const ActView& a, int n, float* out, size_t ldo) {
  bool rows_ok = true;
  for (int t = 1; t < n && rows_ok && !a.panel; ++t) rows_ok = a.rows[t] == a.rows[0] + t;
  if (rows_ok && amx_tiles(m.wtype, m.kd, m.group, n) && amx_usable()) gemm_tiles(m, tile0, ntiles, a, n, out, ldo);
  else avx512_ops().gemm(m, tile0, ntiles, a, n, out, ldo);
}

// Four independent tdpbf16ps chains (four C tiles from two A and two B tiles): the bf16 tile
// peak (2 * 16 * 16 * 32 flops per instruction).
double peak_amx(int64_t iters) {
  if (!amx_usable()) return 0.0;
  std::vector<uint16_t> buf;
  uint16_t* p = aligned_buffer(buf, 4 * 16 * 32);
  for (int i = 0; i < 4 * 16 * 32; ++i) p[i] = 0x3f80;  // bf16 ones
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
