// simd.h's layer in plain C++: sixteen floats, each operation a loop over lanes with std::fma for the fused
// ones. The reference the vector backends are checked against (kernel_check.cpp); it must be compiled with
// -ffp-contract=off, so that the compiler fuses nothing the layer does not.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace simd {

inline uint16_t bfloat16_bits(float f);
inline float bfloat16_value(uint16_t b);
inline float half_value(uint16_t h);

struct Vec {
  float f[16];
};

template <typename F>
inline Vec each(F&& op) {
  Vec out;
  for (int i = 0; i < 16; ++i) out.f[i] = op(i);
  return out;
}

inline Vec zero() { return each([](int) { return 0.0f; }); }
inline Vec set1(float f) { return each([f](int) { return f; }); }
inline Vec load(const float* p, int64_t left = 16) { return each([=](int i) { return i < left ? p[i] : 0.0f; }); }
inline Vec load(const uint16_t* p, int64_t left = 16) {
  return each([=](int i) { return i < left ? bfloat16_value(p[i]) : 0.0f; });
}
inline Vec load_half(const uint16_t* p) { return each([=](int i) { return half_value(p[i]); }); }
inline void store(float* p, Vec v, int64_t left = 16) {
  for (int i = 0; i < 16 && i < left; ++i) p[i] = v.f[i];
}
inline void store(uint16_t* p, Vec v, int64_t left = 16) {
  for (int i = 0; i < 16 && i < left; ++i) p[i] = bfloat16_bits(v.f[i]);
}

inline Vec add(Vec a, Vec b) { return each([&](int i) { return a.f[i] + b.f[i]; }); }
inline Vec sub(Vec a, Vec b) { return each([&](int i) { return a.f[i] - b.f[i]; }); }
inline Vec mul(Vec a, Vec b) { return each([&](int i) { return a.f[i] * b.f[i]; }); }
inline Vec div(Vec a, Vec b) { return each([&](int i) { return a.f[i] / b.f[i]; }); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return each([&](int i) { return std::fma(a.f[i], b.f[i], c.f[i]); }); }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return each([&](int i) { return std::fma(-a.f[i], b.f[i], c.f[i]); }); }
inline Vec abs(Vec a) { return each([&](int i) { return std::fabs(a.f[i]); }); }
inline Vec less_select(Vec a, Vec b, Vec x, Vec y) { return each([&](int i) { return a.f[i] < b.f[i] ? x.f[i] : y.f[i]; }); }
inline Vec round_even(Vec v) { return each([&](int i) { return std::nearbyint(v.f[i]); }); }
inline Vec times_pow2(Vec p, Vec n) {
  return each([&](int i) { return std::isnan(n.f[i]) ? n.f[i] : std::ldexp(p.f[i], static_cast<int>(n.f[i])); });
}

inline float reduce_add(Vec v) {
  float quarter[4];
  for (int i = 0; i < 4; ++i) quarter[i] = (v.f[i] + v.f[i + 8]) + (v.f[i + 4] + v.f[i + 12]);
  return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

inline Vec sum16(const Vec* a) {
  return each([&](int j) {
    float lane[4];
    for (int l = 0; l < 4; ++l) {
      const float* v = a[j].f + 4 * l;
      lane[l] = (v[0] + v[2]) + (v[1] + v[3]);
    }
    return (lane[0] + lane[1]) + (lane[2] + lane[3]);
  });
}

struct Pairs {
  float even[16], odd[16];
};
struct XPair {
  float even, odd;
};
constexpr int kRowTile = 1;
constexpr int kInt4RowTile = 1;
constexpr int kInt4PassVectors = 2;

inline XPair broadcast_pair(const uint16_t* p) { return {bfloat16_value(p[0]), bfloat16_value(p[1])}; }
inline Vec dot(Vec acc, XPair x, const Pairs& w) {
  return each([&](int i) { return std::fma(x.even, w.even[i], std::fma(x.odd, w.odd[i], acc.f[i])); });
}

inline void bfloat16_pairs(const uint16_t* w, Pairs* v) {
  for (int o = 0; o < 32; ++o) {
    v[o / 16].even[o % 16] = bfloat16_value(w[2 * o]);
    v[o / 16].odd[o % 16] = bfloat16_value(w[2 * o + 1]);
  }
}

inline int int8_slot_of(int position) { return position; }
struct Int8Pairs {
  void operator()(const int8_t* w, Pairs* v) const {
    for (int o = 0; o < 32; ++o) {
      v[o / 16].even[o % 16] = static_cast<float>(w[2 * o]);
      v[o / 16].odd[o % 16] = static_cast<float>(w[2 * o + 1]);
    }
  }
};

struct IVec {
  int32_t i[16];
};
struct IPairs {
  int16_t w[32];  // output j's pair at 2j, 2j + 1
};
struct XIPair {
  int16_t x0, x1;
};
inline IVec izero() { return {}; }
inline Vec to_float(IVec v) { return each([&](int j) { return static_cast<float>(v.i[j]); }); }
inline XIPair broadcast_ipair(const int16_t* p) { return {p[0], p[1]}; }
inline IVec idot(IVec acc, XIPair x, const IPairs& w) {
  for (int j = 0; j < 16; ++j) acc.i[j] += int32_t{x.x0} * w.w[2 * j] + int32_t{x.x1} * w.w[2 * j + 1];
  return acc;
}
inline IPairs int4_ipairs(const uint8_t* w, int vector) {
  IPairs v;
  for (int b = 0; b < 32; ++b) v.w[b] = static_cast<int16_t>(vector == 0 ? w[b] & 15 : w[b] >> 4);
  return v;
}

inline void prefetch(const void*) {}

}  // namespace simd
