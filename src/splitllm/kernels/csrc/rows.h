// The per-row operations between a decoder layer's projections, stated once over simd.h's layer: RMS norm,
// rotary embedding, SiLU / GELU (tanh), residual adds. Norms, rotary and activation compute in float32
// and round once on store.
#pragma once
#include <cmath>
#include <cstdint>

#include "simd.h"

namespace simd {

// rsqrt(mean(x^2) + eps) over one row.
template <typename In>
float inverse_rms(const In* x, int64_t size, float eps) {
  Vec total = zero();
  for (int64_t i = 0; i < size; i += kLanes) {
    const Vec v = load(x + i, size - i);
    total = fmadd(v, v, total);
  }
  return 1.0f / std::sqrt(reduce_add(total) / static_cast<float>(size) + eps);
}

// Lanes [i, i + 16) of a row normed by w with the row's inverse_rms `inv` (w null: the row as it is).
template <typename In>
Vec normed(const In* x, int64_t i, int64_t left, const float* w, float inv) {
  const Vec v = load(x + i, left);
  return w ? mul(mul(v, set1(inv)), load(w + i, left)) : v;
}

// y = x * rsqrt(mean(x^2) + eps) * w over one row (w null: y = x), in float32, rounded once on store.
template <typename In, typename Out>
void norm_row(const In* x, int64_t size, const float* w, float eps, Out* y) {
  const float inv = w ? inverse_rms(x, size, eps) : 1.0f;
  for (int64_t i = 0; i < size; i += kLanes) store(y + i, normed(x, i, size - i, w, inv), size - i);
}

// One head in place (dim a multiple of 32): x * cos + rotate_half(x) * signed_sin, rotate-half's sign folded
// into the table; each lane i pairs with i +- dim / 2, so both halves are loaded before either is stored.
inline void rotate(float* x, const float* cos, const float* sin, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; i += kLanes) {
    const Vec a = load(x + i), b = load(x + half + i);
    store(x + i, fmadd(a, load(cos + i), mul(b, load(sin + i))));
    store(x + half + i, fmadd(b, load(cos + half + i), mul(a, load(sin + half + i))));
  }
}

// SiLU, or GELU's tanh approximation, through exp of -|.| only (no overflow).
inline Vec activate(Vec x, bool gelu) {
  const Vec one = set1(1.0f);
  if (gelu) {
    const Vec y = mul(set1(0.7978845608028654f), fmadd(mul(set1(0.044715f), x), mul(x, x), x));
    const Vec e = exp_nonpositive(mul(set1(-2.0f), abs(y)));
    const Vec magnitude = div(sub(one, e), add(one, e));  // tanh(|y|)
    const Vec tanh = less_select(y, zero(), sub(zero(), magnitude), magnitude);
    return mul(mul(set1(0.5f), x), add(one, tanh));
  }
  const Vec e = exp_nonpositive(sub(zero(), abs(x)));
  const Vec numerator = less_select(x, zero(), e, one);
  return mul(x, div(numerator, add(one, e)));  // x * sigmoid(x)
}

// act(gate) * up over one row of `size` outputs, rounded once to bfloat16.
inline void gated_row(const uint16_t* gate, const uint16_t* up, int64_t size, bool gelu, uint16_t* out) {
  for (int64_t j = 0; j < size; j += kLanes)
    store(out + j, mul(activate(load(gate + j, size - j), gelu), load(up + j, size - j)), size - j);
}

// x = bf16(x + norm(a)), the residual update over one row (no norm unless w: Gemma's sandwich norms).
inline void add_row(uint16_t* x, const uint16_t* a, int64_t size, const float* w, float eps) {
  const float inv = w ? inverse_rms(a, size, eps) : 1.0f;
  for (int64_t i = 0; i < size; i += kLanes) store(x + i, add(load(x + i, size - i), normed(a, i, size - i, w, inv)), size - i);
}

}  // namespace simd
