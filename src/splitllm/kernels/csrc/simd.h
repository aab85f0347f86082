// The kernels' SIMD layer: one logical vector type `Vec` of 16 float32 lanes on every CPU, so each kernel
// states its math once (linear_core.h, attention_core.h, rows.h) and every backend computes it in the same
// order with the same roundings. One backend is compiled per build, picked by a macro cpu_kernels.py sets:
//   SPLITLLM_SIMD_AVX512  one zmm register per Vec; AVX-512 BF16 dot products, VBMI byte tables
//   SPLITLLM_SIMD_AVX2    two ymm registers (x86-64-v3: AVX2, FMA, F16C)
//   SPLITLLM_SIMD_NEON    four q registers (ARM64)
//   otherwise             sixteen floats in plain C++ (the reference the others are checked against)
//
// Every backend provides, for Vec v, float* / bfloat16 (uint16_t*) pointers p and `left` lanes still to go
// (>= 16: a whole vector):
//   zero(), set1(f), load(p), load(p, left), load_half(p) (16 float16 values, widened exactly), store(p, v), store(p, v, left), add, sub, mul, div,
//   fmadd(a, b, c) = a * b + c and fnmadd(a, b, c) = c - a * b (fused: one rounding), abs,
//   less_select(a, b, x, y) = a < b ? x : y per lane, round_even(v) (to integral values, ties to even),
//   times_pow2(p, n) = p * 2^n for integral n >= -126, reduce_add(v) and sum16(a[16]) (fixed orders below),
//   storing to bfloat16 rounds to nearest even and flushes float32 subnormals to zero (as AVX-512 BF16's
//   conversion does);
// and for the linear kernel, whose weights are packed as pairs of inputs for a block of 32 outputs:
//   Pairs (16 outputs' bfloat16-valued weights for one pair of inputs), XPair (a row's pair of inputs),
//   broadcast_pair(x), dot(acc, xpair, pairs) = acc + x1 w1, then + x0 w0 (each fused, as AVX-512 BF16's
//   VDPBF16PS rounds: checked against it by tests/test_kernels.py where both run), and loaders of 32 outputs'
//   pairs from bfloat16 (64 bytes) and int8 (64 bytes in `int8_slot` order) weights;
//   and for int4, exact integer arithmetic: IVec (16 int32 lanes), izero(), to_float(v) (exact below 2^24),
//   IPairs (16 outputs' nibble pairs as int16), XIPair, broadcast_ipair(x) (a row's int16 pair),
//   idot(acc, xpair, pairs) = acc + x0 w0 + x1 w1, and int4_ipairs(w, vector) (one 16-output vector's pairs of
//   32 bytes: vector 0 in the low nibbles, 1 in the high).
// The one place backends may differ: VDPBF16PS flushes float32 subnormals (below 1.2e-38) to zero, the
// fused multiply-adds of the other backends keep them; bfloat16 stores flush them on every backend.
//
// reduce_add(v): ((v0+v8 + v4+v12) + (v2+v10 + v6+v14)) + ((v1+v9 + v5+v13) + (v3+v11 + v7+v15)), i.e.
//   halves added lane-wise (lanes i and i + 8), then quarters, then pairs [0]+[2] and [1]+[3], then those two.
// sum16(a): lane j is the sum of a[j]'s lanes as ((a0 + a2) + (a1 + a3)) per group of four lanes, then
//   (group0 + group1) + (group2 + group3).
#pragma once
#include <cstdint>
#include <cstring>

#if defined(SPLITLLM_SIMD_AVX512)
#include "simd/avx512.h"
#elif defined(SPLITLLM_SIMD_AVX2)
#include "simd/avx2.h"
#elif defined(SPLITLLM_SIMD_NEON)
#include "simd/neon.h"
#else
#include "simd/scalar.h"
#endif

namespace simd {

constexpr int kLanes = 16;

// exp(x) for x <= 0, to about 2 ulp (Cephes' expf polynomial); -inf and x < -87 give exactly 0.
inline Vec exp_nonpositive(Vec x) {
  const Vec n = round_even(mul(x, set1(1.44269504088896341f)));
  Vec r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  Vec p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = fmadd(mul(p, r), r, add(r, set1(1.0f)));
  const Vec below = set1(-87.0f);
  return less_select(x, below, zero(), times_pow2(p, less_select(x, below, zero(), n)));
}

// Round-to-nearest-even bfloat16 bits of a float32 with subnormals flushed to zero and NaNs kept quiet: the
// scalar statement of what every backend's bfloat16 store does.
inline uint16_t bfloat16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7F800000u) == 0) u &= 0x80000000u;
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// The float32 value of IEEE half-precision bits, exactly (subnormals included): what every backend's
// load_half gives.
inline float half_value(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  uint32_t u;
  if (exponent == 0x1F) {
    u = sign | 0x7F800000u | mantissa << 13;
  } else if (exponent != 0) {
    u = sign | (exponent + 112) << 23 | mantissa << 13;
  } else {
    float f = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // 2^-24, exact
    return sign ? -f : f;
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float bfloat16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Where weight (output o % 32, input i % 2) of a block's pair of inputs lies among its 64 int8 bytes: the
// order the backend's int8 loader reads.
inline int int8_slot(int o, int e) { return int8_slot_of(o * 2 + e); }

}  // namespace simd
