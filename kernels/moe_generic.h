// Scalar building blocks shared by every ISA translation unit: activation epilogue,
// activation quantisation and the portable GEMM. Everything has internal linkage so
// that each ISA unit gets its own copy compiled for its target (no ODR merging of
// AVX-512 code into the portable path). Loops are written to auto-vectorise.
#pragma once
#include "moe_kernels.h"

namespace moelab {
namespace {

inline float bits_to_f32(uint32_t b) { float f; __builtin_memcpy(&f, &b, 4); return f; }
inline uint32_t f32_to_bits(float f) { uint32_t b; __builtin_memcpy(&b, &f, 4); return b; }
inline float bf16_to_f32(uint16_t v) { return bits_to_f32(uint32_t(v) << 16); }

// e4m3fn byte -> its value / 256 (exact), the scalar twin of the SIMD decode: the byte's
// magnitude bits shifted left by 7 form the fp16 of value / 256 (normals and subnormals
// alike), and fp16 -> fp32 is exact. NaN bytes (0x7f, 0xff) are not decoded as NaN;
// packing refuses them.
struct Fp8Lut {
  float v[256];
  Fp8Lut() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      // value / 256 = (8 + m) * 2^(e - 18) for normals, m * 2^-17 for subnormals
      const float mag = e ? float(8 + m) * bits_to_f32(uint32_t(127 + e - 18) << 23)
                          : float(m) * bits_to_f32(uint32_t(127 - 17) << 23);
      v[b] = (b & 0x80) ? -mag : mag;
    }
  }
};
inline const float* fp8_lut() {
  static const Fp8Lut lut;
  return lut.v;
}

// exp(x) with ~1 ulp error on [-87, 88] (Cephes polynomial); branch-free so it vectorises.
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * bits_to_f32(uint32_t(int32_t(n) + 127) << 23);
}

void act_generic(const float* gu, size_t ldgu, const float* bias, int n, int rows, int act,
                 float alpha, float limit, float* h, size_t ldh) {
  const int tiles = rows / 16;
  for (int t = 0; t < n; ++t) {
    const float* src = gu + size_t(t) * ldgu;
    float* dst = h + size_t(t) * ldh;
    for (int i = 0; i < tiles; ++i) {
      const float* g = src + size_t(2 * i) * 16;
      const float* u = g + 16;
      const float* bg = bias ? bias + size_t(2 * i) * 16 : nullptr;
      float* o = dst + size_t(i) * 16;
      if (act == ACT_SILU) {
        for (int l = 0; l < 16; ++l) {
          float gv = g[l] + (bg ? bg[l] : 0.0f);
          float uv = u[l] + (bg ? bg[16 + l] : 0.0f);
          o[l] = gv / (1.0f + exp_approx(-gv)) * uv;
        }
      } else {  // gpt_oss: clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate)
        for (int l = 0; l < 16; ++l) {
          float gv = g[l] + (bg ? bg[l] : 0.0f);
          float uv = u[l] + (bg ? bg[16 + l] : 0.0f);
          gv = gv > limit ? limit : gv;
          uv = uv > limit ? limit : (uv < -limit ? -limit : uv);
          o[l] = (uv + 1.0f) * (gv / (1.0f + exp_approx(-alpha * gv)));
        }
      }
    }
  }
}

void quant_generic(const float* src, size_t lds, int n, int kd, int group, int offset, int8_t* q,
                   size_t ldq, float* sx, int32_t* corr, size_t ldg) {
  const int groups = kd / group;
  for (int r = 0; r < n; ++r) {
    const float* x = src + size_t(r) * lds;
    int8_t* qr = q + size_t(r) * ldq;
    for (int g = 0; g < groups; ++g) {
      const float* xg = x + size_t(g) * group;
      float amax = 0.0f;
      for (int j = 0; j < group; ++j) {
        float a = __builtin_fabsf(xg[j]);
        amax = a > amax ? a : amax;
      }
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      for (int j = 0; j < group; ++j) {
        int32_t v = int32_t(__builtin_rintf(xg[j] * inv));
        qr[size_t(g) * group + j] = int8_t(v);
        sum += v;
      }
      sx[size_t(r) * ldg + g] = amax / 127.0f;
      corr[size_t(r) * ldg + g] = offset * sum;
    }
  }
}

// Portable peak probe: 12 independent multiply-add chains of W floats (vectorised as far as
// the compiler goes); the result is kept live so nothing is optimised away.
template <int W>
double peak_generic(int64_t iters) {
  float acc[12][W];
  for (int j = 0; j < 12; ++j)
    for (int l = 0; l < W; ++l) acc[j][l] = float(j + l) * 1e-3f;
  const float a = 0.999f, b = 1e-4f;
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < 12; ++j)
      for (int l = 0; l < W; ++l) acc[j][l] = acc[j][l] * a + b;
  float s = 0;
  for (int j = 0; j < 12; ++j)
    for (int l = 0; l < W; ++l) s += acc[j][l];
  volatile float sink = s;
  (void)sink;
  return 2.0 * 12 * W * double(iters);
}

// Reference-order scalar GEMM over the packed layout (the portable path).
void gemm_generic(const MatView& m, int tile0, int ntiles, const ActView& a, int n, float* out,
                  size_t ldo) {
  const int kd = m.kd;
  for (int ti = 0; ti < ntiles; ++ti) {
    const uint8_t* w = m.w + size_t(tile0 + ti) * m.tile_bytes;
    for (int t = 0; t < n; ++t) {
      float acc[16] = {0};
      const size_t row = size_t(a.rows[t]);
      if (m.wtype == W_F32) {
        const float* wf = reinterpret_cast<const float*>(w);
        const float* x = static_cast<const float*>(a.base) + row * a.ld;
        for (int k = 0; k < kd; ++k)
          for (int l = 0; l < 16; ++l) acc[l] += wf[size_t(k) * 16 + l] * x[k];
      } else if (m.wtype == W_BF16) {
        const uint16_t* wb = reinterpret_cast<const uint16_t*>(w);
        const uint16_t* x = static_cast<const uint16_t*>(a.base) + row * a.ld;
        for (int k = 0; k < kd; k += 2) {
          const float x0 = bf16_to_f32(x[k]), x1 = bf16_to_f32(x[k + 1]);
          const uint16_t* wk = wb + size_t(k) * 16;
          for (int l = 0; l < 16; ++l)
            acc[l] += bf16_to_f32(wk[2 * l]) * x0 + bf16_to_f32(wk[2 * l + 1]) * x1;
        }
      } else if (m.wtype == W_FP8) {
        // [Kd/4][16][4] bytes: (row l, k = 4 q + j) at 4 l + kFp8Pos[j] (order k+2, k, k+3, k+1).
        const float* lut = fp8_lut();
        const uint16_t* x = static_cast<const uint16_t*>(a.base) + row * a.ld;
        const float* sc = m.scales + size_t(tile0 + ti) * m.scale_tile;
        const int groups = kd / m.group;
        for (int g = 0; g < groups; ++g) {
          float gacc[16] = {0};
          for (int k = g * m.group; k < (g + 1) * m.group; k += 4) {
            const uint8_t* blk = w + size_t(k / 4) * 64;
            for (int j = 0; j < 4; ++j) {
              const float xv = bf16_to_f32(x[k + j]);
              const uint8_t* bj = blk + kFp8Pos[j];
              for (int l = 0; l < 16; ++l) gacc[l] += lut[bj[4 * l]] * xv;
            }
          }
          for (int l = 0; l < 16; ++l) acc[l] += gacc[l] * sc[g];  // once per block
        }
      } else {
        const int8_t* x = static_cast<const int8_t*>(a.base) + row * a.ld;
        const float* sc = m.scales + size_t(tile0 + ti) * m.scale_tile;
        const int groups = kd / m.group;
        const bool i4 = m.wtype == W_INT4;
        for (int g = 0; g < groups; ++g) {
          int32_t iacc[16] = {0};
          for (int k = g * m.group; k < (g + 1) * m.group; k += i4 ? 8 : 4) {
            const uint8_t* blk = w + size_t(i4 ? k / 8 : k / 4) * 64;
            for (int l = 0; l < 16; ++l)
              for (int j = 0; j < 4; ++j) {
                const uint8_t b = blk[l * 4 + j];
                if (i4) {
                  iacc[l] += int32_t(b & 15) * x[k + j] + int32_t(b >> 4) * x[k + 4 + j];
                } else {
                  iacc[l] += int32_t(b) * x[k + j];
                }
              }
          }
          const float s = a.sx[row * a.ldg + g];
          const int32_t c = a.corr[row * a.ldg + g];
          for (int l = 0; l < 16; ++l)
            acc[l] += float(iacc[l] - c) * (sc[size_t(g) * 16 + l] * s);
        }
      }
      float* o = out + size_t(t) * ldo + size_t(ti) * 16;
      for (int l = 0; l < 16; ++l) o[l] = acc[l];
    }
  }
}

}  // namespace
}  // namespace moelab
