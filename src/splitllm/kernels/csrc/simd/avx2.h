// simd.h's layer on x86-64-v3 (AVX2, FMA): a Vec is two ymm registers, lanes 0-7 and 8-15. A linear's
// bfloat16 pairs are widened to float32 (even inputs by a shift, odd ones by a mask) and multiplied with
// two fused multiply-adds, odd input first: VDPBF16PS's exact result, since a product of two bfloat16
// values is exact in float32.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace simd {

struct Vec {
  __m256 lo, hi;
};

inline Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec set1(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
inline Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Vec load(const float* p, int64_t left) {
  if (left >= 16) return load(p);
  alignas(32) float buffer[16] = {};
  std::memcpy(buffer, p, left * sizeof(float));
  return load(buffer);
}
inline __m256 widen(__m128i bf16) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16), 16)); }
inline Vec load(const uint16_t* p, int64_t left = 16) {
  alignas(32) uint16_t buffer[16] = {};
  if (left < 16) {
    std::memcpy(buffer, p, left * sizeof(uint16_t));
    p = buffer;
  }
  return {widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline Vec load_half(const uint16_t* p) {  // F16C: exact
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void store(float* p, Vec v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline void store(float* p, Vec v, int64_t left) {
  if (left >= 16) return store(p, v);
  alignas(32) float buffer[16];
  store(buffer, v);
  std::memcpy(p, buffer, left * sizeof(float));
}
// Round to nearest even, float32 subnormals flushed to zero, NaNs quiet: bfloat16_bits, eight lanes at once.
inline __m256i bfloat16_lanes(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  const __m256i subnormal = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7F800000)), _mm256_setzero_si256());
  u = _mm256_andnot_si256(_mm256_andnot_si256(_mm256_set1_epi32(static_cast<int>(0x80000000u)), subnormal), u);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}
inline void store(uint16_t* p, Vec v, int64_t left = 16) {
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bfloat16_lanes(v.lo), bfloat16_lanes(v.hi)), 0xD8);
  if (left >= 16) return _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
  alignas(32) uint16_t buffer[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(buffer), packed);
  std::memcpy(p, buffer, left * sizeof(uint16_t));
}

inline Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec sub(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec div(Vec a, Vec b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline Vec abs(Vec a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return {_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi)};
}
inline Vec less_select(Vec a, Vec b, Vec x, Vec y) {
  return {_mm256_blendv_ps(y.lo, x.lo, _mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ)),
          _mm256_blendv_ps(y.hi, x.hi, _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ))};
}
inline Vec round_even(Vec v) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(v.lo, mode), _mm256_round_ps(v.hi, mode)};
}
inline __m256 pow2(__m256 n) {  // 2^n for integral n in -126..127, built in the exponent field
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline Vec times_pow2(Vec p, Vec n) { return {_mm256_mul_ps(p.lo, pow2(n.lo)), _mm256_mul_ps(p.hi, pow2(n.hi))}; }

inline float reduce_add(Vec v) {
  const __m256 half = _mm256_add_ps(v.hi, v.lo);
  const __m128 quarter = _mm_add_ps(_mm256_extractf128_ps(half, 1), _mm256_castps256_ps128(half));
  const __m128 pairs = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}

// Steps one and two of sum16 within each 128-bit lane of four vectors' halves: lane j of 128-bit lane L
// is vector j's (v[4L] + v[4L+2]) + (v[4L+1] + v[4L+3]).
inline __m256 lane_sums(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 x0 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
  const __m256 x1 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
  return _mm256_add_ps(_mm256_shuffle_ps(x0, x1, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(x0, x1, _MM_SHUFFLE(3, 2, 3, 2)));
}
inline Vec sum16(const Vec* a) {
  __m256 lo[4], hi[4];  // groups of four vectors: 128-bit lanes 0-1 in lo, 2-3 in hi
  for (int g = 0; g < 4; ++g) {
    lo[g] = lane_sums(a[4 * g].lo, a[4 * g + 1].lo, a[4 * g + 2].lo, a[4 * g + 3].lo);
    hi[g] = lane_sums(a[4 * g].hi, a[4 * g + 1].hi, a[4 * g + 2].hi, a[4 * g + 3].hi);
  }
  Vec out;
  __m256* halves[2] = {&out.lo, &out.hi};
  for (int h = 0; h < 2; ++h) {  // groups 2h and 2h + 1: (lane 0 + lane 1) + (lane 2 + lane 3)
    const __m256 first = _mm256_add_ps(_mm256_permute2f128_ps(lo[2 * h], lo[2 * h + 1], 0x20),
                                       _mm256_permute2f128_ps(lo[2 * h], lo[2 * h + 1], 0x31));
    const __m256 second = _mm256_add_ps(_mm256_permute2f128_ps(hi[2 * h], hi[2 * h + 1], 0x20),
                                        _mm256_permute2f128_ps(hi[2 * h], hi[2 * h + 1], 0x31));
    *halves[h] = _mm256_add_ps(first, second);
  }
  return out;
}

// The linear's pairs: 16 outputs' weights for the even and for the odd input of a pair, in float32.
struct Pairs {
  __m256 even[2], odd[2];
};
struct XPair {
  __m256 even, odd;
};
constexpr int kRowTile = 4;      // rows per pass over a block (some accumulators spill, yet 3-8 rows ran 15-30% faster than 2)
// int4 tiles of several rows take one 16-output vector per pass over a block's group (8 accumulators): with
// both vectors, 16 registers spill an accumulator and each input pair waits on a store and a reload, which
// made several rows markedly slower; a lone row keeps both vectors and reads its weights at the bandwidth.
constexpr int kInt4RowTile = 4;
constexpr int kInt4PassVectors = 1;

inline XPair broadcast_pair(const uint16_t* p) {  // one 32-bit broadcast, then each half under a zero half
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  const __m256i both = _mm256_set1_epi32(pair);
  return {_mm256_castsi256_ps(_mm256_slli_epi32(both, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(both, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
inline Vec dot(Vec acc, XPair x, const Pairs& w) {
  return {_mm256_fmadd_ps(x.even, w.even[0], _mm256_fmadd_ps(x.odd, w.odd[0], acc.lo)),
          _mm256_fmadd_ps(x.even, w.even[1], _mm256_fmadd_ps(x.odd, w.odd[1], acc.hi))};
}

inline void bfloat16_pairs(const uint16_t* w, Pairs* v) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int j = 0; j < 2; ++j)
    for (int h = 0; h < 2; ++h) {
      const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * 32 + h * 16));
      v[j].even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
      v[j].odd[h] = _mm256_castsi256_ps(_mm256_and_si256(p, high));
    }
}

// int8: per 8 outputs, their 8 even-input bytes then their 8 odd-input bytes, each sign-extended and converted.
inline int int8_slot_of(int position) {
  const int vector = position / 32, half = position % 32 / 16, output = position % 16 / 2, element = position % 2;
  return vector * 32 + half * 16 + element * 8 + output;
}
struct Int8Pairs {
  static __m256 widen8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  void operator()(const int8_t* w, Pairs* v) const {
    for (int j = 0; j < 2; ++j)
      for (int h = 0; h < 2; ++h) {
        v[j].even[h] = widen8(w + j * 32 + h * 16);
        v[j].odd[h] = widen8(w + j * 32 + h * 16 + 8);
      }
  }
};

// int4 against int16 inputs: 16 outputs' pairs of nibbles as int16 (outputs 0-7, then 8-15) and 16 int32
// sums; VPMADDWD adds both products of a pair, exactly, one multiply-add per 8 outputs.
struct IVec {
  __m256i lo, hi;
};
using IPairs = IVec;
using XIPair = __m256i;
inline IVec izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline Vec to_float(IVec v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
inline XIPair broadcast_ipair(const int16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return _mm256_set1_epi32(pair);
}
inline IVec idot(IVec acc, XIPair x, const IPairs& w) {
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(x, w.lo)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(x, w.hi))};
}
inline IPairs int4_ipairs(const uint8_t* w, int vector) {
  const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  const __m256i hi = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)));
  if (vector == 0) {
    const __m256i nibble = _mm256_set1_epi16(0x000F);
    return {_mm256_and_si256(lo, nibble), _mm256_and_si256(hi, nibble)};
  }
  return {_mm256_srli_epi16(lo, 4), _mm256_srli_epi16(hi, 4)};
}

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

}  // namespace simd
