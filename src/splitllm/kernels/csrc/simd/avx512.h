// simd.h's layer on AVX-512 (F, BW, VL, BF16, VBMI): a Vec is one zmm register; a linear's pairs go through
// VDPBF16PS, and int8 weights widen through VBMI byte tables.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace simd {

using Vec = __m512;

inline __mmask16 lanes(int64_t left) { return static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1); }

inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec set1(float f) { return _mm512_set1_ps(f); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const float* p, int64_t left) { return _mm512_maskz_loadu_ps(lanes(left), p); }
inline Vec load(const uint16_t* p, int64_t left = 16) {  // bfloat16 widens exactly
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes(left), p)), 16));
}
inline Vec load_half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline void store(float* p, Vec v, int64_t left) { _mm512_mask_storeu_ps(p, lanes(left), v); }
inline void store(uint16_t* p, Vec v, int64_t left = 16) { _mm256_mask_storeu_epi16(p, lanes(left), (__m256i)_mm512_cvtneps_pbh(v)); }

inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }
inline Vec abs(Vec a) { return _mm512_abs_ps(a); }
inline Vec less_select(Vec a, Vec b, Vec x, Vec y) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x); }
inline Vec round_even(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT); }
inline Vec times_pow2(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }

inline float reduce_add(Vec v) {
  const __m256 half = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)), _mm512_castps512_ps256(v));
  const __m128 quarter = _mm_add_ps(_mm256_extractf128_ps(half, 1), _mm256_castps256_ps128(half));
  const __m128 pairs = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}

inline Vec sum16(const Vec* a) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane L: [a0 L0+2, a1 L0+2, a0 L1+3, a1 L1+3] of the pair
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane L: the four vectors' sums over that lane
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // 128-bit lanes [y0 L0+1, y0 L2+3, y1 L0+1, y1 L2+3]
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// The linear's pairs: 16 outputs' bfloat16 pairs in one register, multiplied by VDPBF16PS.
using Pairs = __m512bh;
using XPair = __m512bh;
constexpr int kRowTile = 6;      // rows per pass over a block (24 of the 32 registers accumulate)
constexpr int kInt4RowTile = 4;  // 8 accumulators and 16 group sums
constexpr int kInt4PassVectors = 2;

inline XPair broadcast_pair(const uint16_t* p) {  // copied out as one int32 (no aliasing through int32*)
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return (XPair)_mm512_set1_epi32(pair);
}
inline Vec dot(Vec acc, XPair x, Pairs w) { return _mm512_dpbf16_ps(acc, x, w); }

inline void bfloat16_pairs(const uint16_t* w, Pairs* v) {
  for (int j = 0; j < 2; ++j) v[j] = (Pairs)_mm512_loadu_si512(w + j * 32);
}

// int8: a pair's 64 bytes as (128-bit lane, vector, byte), the order in which unpacking the low and high
// bytes of |q|'s bfloat16 (two 128-entry VBMI byte tables) gives the two vectors back; q's sign is put back
// with one ternary-logic op: six instructions for 64 weights, all exact (every int8 value is a bfloat16).
inline int int8_slot_of(int position) {
  const int vector = position / 32, lane = position % 32 / 8, byte = position % 8;
  return lane * 16 + vector * 8 + byte;
}
struct Int8Pairs {
  __m512i low[2], high[2];
  Int8Pairs() {
    alignas(64) uint8_t bytes[2][128];
    for (int a = 0; a < 128; ++a) {
      const float f = static_cast<float>(a);
      uint32_t bits;
      std::memcpy(&bits, &f, sizeof bits);
      bytes[0][a] = static_cast<uint8_t>(bits >> 16);
      bytes[1][a] = static_cast<uint8_t>(bits >> 24);
    }
    for (int h = 0; h < 2; ++h) {
      low[h] = _mm512_load_si512(bytes[0] + 64 * h);
      high[h] = _mm512_load_si512(bytes[1] + 64 * h);
    }
  }
  void operator()(const int8_t* w, Pairs* v) const {
    const __m512i q = _mm512_loadu_si512(w), magnitude = _mm512_abs_epi8(q);
    const __m512i lo = _mm512_permutex2var_epi8(low[0], magnitude, low[1]);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(high[0], magnitude, high[1]), q,
                                                 _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // a | b & c
    v[0] = (Pairs)_mm512_unpacklo_epi8(lo, hi);
    v[1] = (Pairs)_mm512_unpackhi_epi8(lo, hi);
  }
};

// int4 against int16 inputs: 16 outputs' pairs of nibbles as int16 and 16 int32 sums; VNNI's VPDPWSSD adds
// both products of a pair to its output's sum, exactly.
using IVec = __m512i;
using IPairs = __m512i;
using XIPair = __m512i;
inline IVec izero() { return _mm512_setzero_si512(); }
inline Vec to_float(IVec v) { return _mm512_cvtepi32_ps(v); }
inline XIPair broadcast_ipair(const int16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return _mm512_set1_epi32(pair);
}
inline IVec idot(IVec acc, XIPair x, IPairs w) { return _mm512_dpwssd_epi32(acc, x, w); }
inline IPairs int4_ipairs(const uint8_t* w, int vector) {
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return vector == 0 ? _mm512_and_si512(bytes, _mm512_set1_epi16(0x000F)) : _mm512_srli_epi16(bytes, 4);
}

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

}  // namespace simd
