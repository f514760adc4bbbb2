// moelab fused MoE expert kernels: shared declarations.
//
// Shape legend: T tokens, K top-k, E experts, H hidden, I intermediate,
// S = T*K (token, expert) pairs, G groups along a reduction dimension.
//
// Packed layout (built once by moelab/kernels/packing.py, 64-byte aligned):
// a matrix W[N rows][Kd reduction] is stored as N/16 row tiles; inside a tile,
//   f32 : [Kd][16]            (one 64-byte line per k)
//   bf16: [Kd/2][16][2]       (one line per 2 k; vdpbf16ps pairs)
//   int8: [Kd/4][16][4] u8    (one line per 4 k; value = q + 128; vpdpbusd quads)
//   int4: [Kd/8][16][4] u8    (one line per 8 k; low nibble k+j, high nibble k+4+j;
//                              value = q + 8)
//   fp8 : [Kd/4][16][4] u8    (one line per 4 k, e4m3fn bytes; a row's 4 bytes hold k+2, k,
//                              k+3, k+1: the high bytes of its two 16-bit lanes are the pair
//                              (k, k+1), the low bytes (k+2, k+3), each pair where vdpbf16ps
//                              and AMX's bf16 B tiles want it once decoded in place)
// int8/int4 scales are fp32 [N/16][G][16]. fp8 scales are fp32 [N/16][G], one per
// (16-row tile, block of `group` k): the checkpoint's 128x128 block scale (its row
// block holds whole tiles) times 256, because the kernels decode e4m3 exactly to the
// value / 256 (AVX2: value * 2^-120, its scale adjusted by a power of two), then apply the
// scale once per block. Gate and up rows are interleaved per tile
// (gate tile i, then up tile i) so one pass over the weights yields both.
//
// This header is included by the ISA translation units, which are compiled with
// target pragmas: it must not include torch or other template-heavy headers.
#pragma once
#include <cstddef>
#include <cstdint>

namespace moelab {

// fp8 weights on AVX2 and avx512vnni: the fp32 activation copies (ActView::xf) are the bf16
// values times 2^60, so that the decode loop's weights (value * 2^-120, see moe_avx2.cpp) multiply into
// normal fp32 products; an fp32 copy overflows only for |x| > 2^68. Powers of two: exact.
constexpr float kFp8XScale = 0x1p60f;
// ...and the kernels decode e4m3 to value * 2^-120: the packed scale (which carries the 2^8 fold)
// times this undoes 2^-120 * 2^60 exactly, once per block.
constexpr float kFp8Unscale = 0x1p52f;  // 2^(120 - 60 - 8)

// How far ahead (bytes) a kernel prefetches a weight stream it reads once: each row tile's packed
// lines on the AVX-512 and AVX2 decode kernels, the streamed fp8/int4 decode and in-place int8
// tiles on AMX. The hardware prefetchers alone left decode-sized calls well below the memory's
// bandwidth, fp8 most: its decode takes about nine instructions a 64-byte line where int8 takes
// two, so the reorder window holds a quarter of int8's loads in flight. In-process A/B on the
// development VM (scripts/kernels_ab.py, 2026-11-28; median ratio of 10-30 alternating call
// pairs per point, quartiles up to 10 % either side; load 0.5-1.3 at the benchmarks around them),
// 1 and 16 tokens, both default shapes:
// AVX-512 fp8 +15-26 % (1 and 4 KiB ahead: the same or less), bf16 +5-13 %, int8 +2 % at 1 token
// and +8-14 % at 16, int4 +8-10 %; forced avx2 bf16/int8/int4 +18-38 %, fp8 +12-16 %; AMX at 256
// tokens fp8 +29 %, int8 +15 %, int4 +3 %. Prefetching past a tile's end touches the next tile.
constexpr int kPrefetchBytes = 2048;

// fp8 layout: the byte of (row, k = 4 q + j) in line q of a tile is 4 row + kFp8Pos[j].
constexpr int kFp8Pos[4] = {1, 3, 0, 2};

enum WeightType : int { W_F32 = 0, W_BF16 = 1, W_INT8 = 2, W_INT4 = 3, W_FP8 = 4 };
enum ActKind : int { ACT_SILU = 0, ACT_GPT_OSS = 1 };
// Codes as moelab/kernels/build.py numbers them (avx512vnni came last: codes never change).
enum Isa : int { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AMX = 3, ISA_AVX512VNNI = 4 };

// AMX path: an expert call with at least this many rows (tokens) runs on tiles. A tile pass
// costs nearly the same from 1 row to 16 (a call of fewer than 16 configures its A and C tiles
// to its rows), while the AVX-512 kernel's cost grows with the rows: the crossover is where they
// meet. Measured on an Emerald Rapids Xeon (2 cores, both default shapes, 2026-11-28): bf16
// tiles win from 4 rows, int8 from 6, int4 from 8. fp8 (whose tiles are decoded to bf16 on the
// way) from 4: in-process A/B (scripts/kernels_ab.py) against 6, with the scale fold over the
// call's rows only, 1.14x at T = 64 on the small shape, 1.12-1.15x at T = 16-32 on the large one;
// from 2 rows it loses (0.85-0.93x); 3 measured even with 4 (0.96-1.02x), so fp8 keeps bf16's 4.
inline int amx_min_rows(int wtype) {
  switch (wtype) {
    case W_BF16: return 4;
    case W_FP8: return 4;
    case W_INT8: return 6;
    default: return 8;
  }
}

// Activations for one GEMM call: row r of the input is base + rows[r] * ld.
struct ActView {
  const void* base;       // f32 / bf16(uint16) / int8 elements (fp8 weights: bf16)
  const int32_t* rows;    // n row indices
  size_t ld;              // elements per row
  const float* sx;        // int only: per-(row, group) scale, row stride ldg
  const int32_t* corr;    // int only: offset * sum(q) per (row, group)
  size_t ldg;
  const float* xf;        // bf16/fp8 weights on AVX2 / avx512vnni: the same rows as fp32 (exact copies of
                          // the bf16 values, stride ld), so kernels broadcast from memory
  const uint8_t* panel;   // AMX, optional: the same n rows as AMX A tiles (amx_panel_at)
};

// AMX A panels: an expert's rows (bf16, or int8 for int weights) in blocks of 16 (the last one
// zero-padded), each block [ceil(row bytes / 64)][16 rows][64 bytes] (bytes zero-padded), so
// every A tile is 1 KiB of consecutive memory (row-major rows 4 KiB apart alias in L1 and
// cross a page per row). Offsets in bytes; row_bytes = reduction length x element size.
inline size_t amx_panel_row_bytes(size_t row_bytes) { return (row_bytes + 63) / 64 * 64; }
inline size_t amx_panel_rows(int n) { return (size_t(n) + 15) / 16 * 16; }
inline size_t amx_panel_at(size_t r, size_t byte, size_t row_bytes) {
  return (r / 16) * amx_panel_row_bytes(row_bytes) * 16 + (byte / 64) * 1024 + (r % 16) * 64 + byte % 64;
}

// Whether an AMX call with n rows runs on tiles (else on the AVX-512 kernel); the driver lays
// out panels exactly for these calls. bf16/fp8 weights: tdpbf16ps (32 k per step; fp8 blocks
// of whole steps); int8/int4: tdpbsud on the int8 activations (64 k per step, whole groups).
inline bool amx_tiles(int wtype, int kd, int group, int n) {
  if (n < amx_min_rows(wtype)) return false;
  if (wtype == W_BF16) return kd >= 32;
  if (wtype == W_FP8) return group % 32 == 0;
  return (wtype == W_INT8 || wtype == W_INT4) && group % 64 == 0;
}

// One expert's packed matrix.
struct MatView {
  const uint8_t* w;       // first tile of this expert
  size_t tile_bytes;      // bytes per 16-row tile
  const float* scales;    // int/fp8 only: first tile's scales
  size_t scale_tile;      // floats per tile of scales (int: G*16, fp8: G)
  int kd;                 // padded reduction length
  int group;              // int: quantisation group; fp8: block length along k
  int wtype;
};

// out[r * ldo + (tile - tile0) * 16 + lane] = dot(row, W row) for ntiles tiles, n rows.
using GemmFn = void (*)(const MatView& m, int tile0, int ntiles, const ActView& a, int n,
                        float* out, size_t ldo);

// Quantise n rows of fp32 (length kd, zero padded) to int8 per group; offset is the
// unsigned offset of the weights (128 int8, 8 int4) folded into corr.
using QuantFn = void (*)(const float* src, size_t lds, int n, int kd, int group, int offset,
                         int8_t* q, size_t ldq, float* sx, int32_t* corr, size_t ldg);

// Stage-1 epilogue: gate/up dot products laid out by tile pairs -> activated h (fp32).
using ActFn = void (*)(const float* gu, size_t ldgu, const float* bias, int n, int rows,
                       int act, float alpha, float limit, float* h, size_t ldh);

// Peak-FLOP probe: iters rounds of independent FMAs on this ISA's vectors; returns the flops
// done (the benchmark's "machine FMA peak").
using PeakFn = double (*)(int64_t iters);

struct IsaOps {
  GemmFn gemm;
  QuantFn quant;
  ActFn act;
  PeakFn peak;
};

IsaOps portable_ops();
IsaOps avx2_ops();
IsaOps avx512vnni_ops();
IsaOps avx512_ops();
IsaOps amx_ops();
// The CPU has AMX-TILE, AMX-BF16 and AMX-INT8 and the OS granted this process tile state (asked once).
bool amx_usable();

}  // namespace moelab
