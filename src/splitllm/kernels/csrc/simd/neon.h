// simd.h's layer on ARM64 NEON (Advanced SIMD, in every ARMv8-A core): a Vec is four q registers. A
// linear's pairs are widened to float32 and multiplied with two fused multiply-adds, odd input first, as
// on AVX2 (simd/avx2.h).
#pragma once
#include <arm_neon.h>
#include <cstdint>
#include <cstring>

namespace simd {

struct Vec {
  float32x4_t q[4];
};

inline Vec zero() { return {{vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}}; }
inline Vec set1(float f) { return {{vdupq_n_f32(f), vdupq_n_f32(f), vdupq_n_f32(f), vdupq_n_f32(f)}}; }
inline Vec load(const float* p) { return {{vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}}; }
inline Vec load(const float* p, int64_t left) {
  if (left >= 16) return load(p);
  float buffer[16] = {};
  std::memcpy(buffer, p, left * sizeof(float));
  return load(buffer);
}
inline Vec load(const uint16_t* p, int64_t left = 16) {
  uint16_t buffer[16] = {};
  if (left < 16) {
    std::memcpy(buffer, p, left * sizeof(uint16_t));
    p = buffer;
  }
  Vec v;
  for (int h = 0; h < 2; ++h) {
    const uint16x8_t b = vld1q_u16(p + 8 * h);
    v.q[2 * h] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(b), 16));
    v.q[2 * h + 1] = vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(b), 16));
  }
  return v;
}
inline Vec load_half(const uint16_t* p) {  // float16 widens exactly
  Vec v;
  for (int i = 0; i < 4; ++i) v.q[i] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * i)));
  return v;
}
inline void store(float* p, Vec v) {
  for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, v.q[i]);
}
inline void store(float* p, Vec v, int64_t left) {
  if (left >= 16) return store(p, v);
  float buffer[16];
  store(buffer, v);
  std::memcpy(p, buffer, left * sizeof(float));
}
// Round to nearest even, float32 subnormals flushed to zero, NaNs quiet: bfloat16_bits, four lanes at once.
inline uint16x4_t bfloat16_lanes(float32x4_t v) {
  uint32x4_t u = vreinterpretq_u32_f32(v);
  const uint32x4_t subnormal = vceqq_u32(vandq_u32(u, vdupq_n_u32(0x7F800000u)), vdupq_n_u32(0));
  u = vbslq_u32(subnormal, vandq_u32(u, vdupq_n_u32(0x80000000u)), u);
  const uint32x4_t nan = vcgtq_u32(vandq_u32(u, vdupq_n_u32(0x7FFFFFFFu)), vdupq_n_u32(0x7F800000u));
  const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  const uint32x4_t rounded = vshrq_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7FFF)), odd), 16);
  const uint32x4_t quiet = vorrq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(0x40));
  return vmovn_u32(vbslq_u32(nan, quiet, rounded));
}
inline void store(uint16_t* p, Vec v, int64_t left = 16) {
  uint16_t buffer[16];
  uint16_t* out = left >= 16 ? p : buffer;
  for (int i = 0; i < 4; ++i) vst1_u16(out + 4 * i, bfloat16_lanes(v.q[i]));
  if (left < 16) std::memcpy(p, buffer, left * sizeof(uint16_t));
}

template <typename F>
inline Vec each(F&& op) {
  Vec out;
  for (int i = 0; i < 4; ++i) out.q[i] = op(i);
  return out;
}
inline Vec add(Vec a, Vec b) { return each([&](int i) { return vaddq_f32(a.q[i], b.q[i]); }); }
inline Vec sub(Vec a, Vec b) { return each([&](int i) { return vsubq_f32(a.q[i], b.q[i]); }); }
inline Vec mul(Vec a, Vec b) { return each([&](int i) { return vmulq_f32(a.q[i], b.q[i]); }); }
inline Vec div(Vec a, Vec b) { return each([&](int i) { return vdivq_f32(a.q[i], b.q[i]); }); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return each([&](int i) { return vfmaq_f32(c.q[i], a.q[i], b.q[i]); }); }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return each([&](int i) { return vfmsq_f32(c.q[i], a.q[i], b.q[i]); }); }
inline Vec abs(Vec a) { return each([&](int i) { return vabsq_f32(a.q[i]); }); }
inline Vec less_select(Vec a, Vec b, Vec x, Vec y) {
  return each([&](int i) { return vbslq_f32(vcltq_f32(a.q[i], b.q[i]), x.q[i], y.q[i]); });
}
inline Vec round_even(Vec v) { return each([&](int i) { return vrndnq_f32(v.q[i]); }); }
inline Vec times_pow2(Vec p, Vec n) {  // 2^n for integral n in -126..127, built in the exponent field
  return each([&](int i) {
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n.q[i]), vdupq_n_s32(127)), 23);
    return vmulq_f32(p.q[i], vreinterpretq_f32_s32(e));
  });
}

inline float reduce_add(Vec v) {
  const float32x4_t quarter = vaddq_f32(vaddq_f32(v.q[0], v.q[2]), vaddq_f32(v.q[1], v.q[3]));
  const float pair0 = vgetq_lane_f32(quarter, 0) + vgetq_lane_f32(quarter, 2);
  const float pair1 = vgetq_lane_f32(quarter, 1) + vgetq_lane_f32(quarter, 3);
  return pair0 + pair1;
}

// Lane j: vector a[j]'s (v0 + v2) + (v1 + v3) over its four lanes, for four vectors' q registers.
inline float32x4_t lane_sums(float32x4_t a0, float32x4_t a1, float32x4_t a2, float32x4_t a3) {
  const float32x4x2_t t01 = vtrnq_f32(a0, a1), t23 = vtrnq_f32(a2, a3);
  // rows: element k of every vector (k = 0..3)
  const float32x4_t r0 = vcombine_f32(vget_low_f32(t01.val[0]), vget_low_f32(t23.val[0]));
  const float32x4_t r1 = vcombine_f32(vget_low_f32(t01.val[1]), vget_low_f32(t23.val[1]));
  const float32x4_t r2 = vcombine_f32(vget_high_f32(t01.val[0]), vget_high_f32(t23.val[0]));
  const float32x4_t r3 = vcombine_f32(vget_high_f32(t01.val[1]), vget_high_f32(t23.val[1]));
  return vaddq_f32(vaddq_f32(r0, r2), vaddq_f32(r1, r3));
}
inline Vec sum16(const Vec* a) {
  Vec out;
  for (int g = 0; g < 4; ++g) {
    float32x4_t lane[4];
    for (int l = 0; l < 4; ++l) lane[l] = lane_sums(a[4 * g].q[l], a[4 * g + 1].q[l], a[4 * g + 2].q[l], a[4 * g + 3].q[l]);
    out.q[g] = vaddq_f32(vaddq_f32(lane[0], lane[1]), vaddq_f32(lane[2], lane[3]));
  }
  return out;
}

struct Pairs {
  float32x4_t even[4], odd[4];
};
struct XPair {
  float32x4_t even, odd;
};
constexpr int kRowTile = 2;
constexpr int kInt4RowTile = 2;
constexpr int kInt4PassVectors = 2;

inline XPair broadcast_pair(const uint16_t* p) {  // one 32-bit broadcast, then each half under a zero half
  uint32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  const uint32x4_t both = vdupq_n_u32(pair);
  return {vreinterpretq_f32_u32(vshlq_n_u32(both, 16)), vreinterpretq_f32_u32(vandq_u32(both, vdupq_n_u32(0xFFFF0000u)))};
}
inline Vec dot(Vec acc, XPair x, const Pairs& w) {
  return each([&](int i) { return vfmaq_f32(vfmaq_f32(acc.q[i], x.odd, w.odd[i]), x.even, w.even[i]); });
}

inline void bfloat16_pairs(const uint16_t* w, Pairs* v) {
  for (int j = 0; j < 2; ++j)
    for (int i = 0; i < 4; ++i) {
      const uint32x4_t p = vld1q_u32(reinterpret_cast<const uint32_t*>(w + j * 32 + i * 8));
      v[j].even[i] = vreinterpretq_f32_u32(vshlq_n_u32(p, 16));
      v[j].odd[i] = vreinterpretq_f32_u32(vandq_u32(p, vdupq_n_u32(0xFFFF0000u)));
    }
}

// int8: per 8 outputs, their 8 even-input bytes then their 8 odd-input bytes (as on AVX2).
inline int int8_slot_of(int position) {
  const int vector = position / 32, half = position % 32 / 16, output = position % 16 / 2, element = position % 2;
  return vector * 32 + half * 16 + element * 8 + output;
}
struct Int8Pairs {
  static void widen8(const int8_t* p, float32x4_t* out) {
    const int16x8_t wide = vmovl_s8(vld1_s8(p));
    out[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide)));
    out[1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(wide)));
  }
  void operator()(const int8_t* w, Pairs* v) const {
    for (int j = 0; j < 2; ++j)
      for (int h = 0; h < 2; ++h) {
        widen8(w + j * 32 + h * 16, v[j].even + 2 * h);
        widen8(w + j * 32 + h * 16 + 8, v[j].odd + 2 * h);
      }
  }
};

// int4 against int16 inputs: 16 outputs' pairs of nibbles as int16 (four outputs a register) and 16 int32
// sums; each pair's two products are widened, then added pairwise, exactly.
struct IVec {
  int32x4_t q[4];
};
struct IPairs {
  int16x8_t q[4];
};
using XIPair = int16x8_t;
inline IVec izero() { return {{vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)}}; }
inline Vec to_float(IVec v) { return {{vcvtq_f32_s32(v.q[0]), vcvtq_f32_s32(v.q[1]), vcvtq_f32_s32(v.q[2]), vcvtq_f32_s32(v.q[3])}}; }
inline XIPair broadcast_ipair(const int16_t* p) {
  uint32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return vreinterpretq_s16_u32(vdupq_n_u32(pair));
}
inline IVec idot(IVec acc, XIPair x, const IPairs& w) {
  IVec out;
  for (int i = 0; i < 4; ++i) {
    const int32x4_t products = vpaddq_s32(vmull_s16(vget_low_s16(w.q[i]), vget_low_s16(x)), vmull_high_s16(w.q[i], x));
    out.q[i] = vaddq_s32(acc.q[i], products);
  }
  return out;
}
inline IPairs int4_ipairs(const uint8_t* w, int vector) {
  IPairs v;
  for (int h = 0; h < 4; ++h) {  // 8 bytes: 4 outputs' pairs of the low half, 4 of the high half
    const uint16x8_t bytes = vmovl_u8(vld1_u8(w + 8 * h));
    v.q[h] = vreinterpretq_s16_u16(vector == 0 ? vandq_u16(bytes, vdupq_n_u16(0x000F)) : vshrq_n_u16(bytes, 4));
  }
  return v;
}

inline void prefetch(const void* p) { __builtin_prefetch(p); }

}  // namespace simd
