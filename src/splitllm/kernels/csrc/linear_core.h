// y = x W^T (+ b) in bfloat16 for the few rows of a decoding step, at the speed of reading W once, stated
// once over simd.h's layer. W is bfloat16; or int8 with one scale per output (y = scale * x q^T + b); or
// int4 with a float16 scale and minimum per output and group of 32 inputs (w = q * scale + min, q in 0..15:
// the form of GGUF's 4-bit blocks, so a model shipped in Q4_0, Q4_1 or Q4_K keeps its exact weights).
//
// W is packed at load (pack_dense, pack_int4) as (N/32, K/2, 32, 2): for each block of 32 outputs, each pair
// of inputs is one run of 32 pairs (128 bytes in bfloat16; 64 in int8, in the order the backend's loader
// reads, simd::int8_slot; 32 in int4, the first 16 outputs' nibbles low and the other 16's high), so a block
// is one contiguous stream and the hardware prefetcher sees a single sequential read (a block also asks for
// its bytes 16 KiB ahead). int4 multiplies the nibbles by the inputs held as int16 (int16_inputs), exactly,
// and scales each group's integer sums once.
// simd::dot (simd::idot for int4) multiplies a broadcast input pair by the pairs of 16 outputs at once, so accumulators hold
// outputs directly (no horizontal sums). Several rows share each weight load, and each output sums even
// and odd pairs in two chains, so a lone row does not wait on the multiply-add's latency. Every output is
// accumulated over the input pairs in the same order whatever the number of rows, the row's place in the
// batch, the thread count or the backend, so results are batch-invariant and the same on every CPU.
#pragma once
#include <algorithm>
#include <cstring>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace simd {

constexpr int kVectors = 2;            // 16-output vectors per block
constexpr int kBlock = 16 * kVectors;  // outputs per block
constexpr int kGroup = 32;             // int4 inputs per scale and minimum
constexpr int kGroupPairs = kGroup / 2;
constexpr int kPrefetchBytes = 16384;  // how far ahead of its reads a block asks for its weights

// Pair loaders: one pair of inputs for the block's 32 outputs as two Pairs of 16 outputs each.
struct Bfloat16Loader {
  using Weight = uint16_t;
  void operator()(const uint16_t* w, Pairs* v) const { bfloat16_pairs(w, v); }
};
struct Int8Loader {
  using Weight = int8_t;
  Int8Pairs widen;
  void operator()(const int8_t* w, Pairs* v) const { widen(w, v); }
};

// Asks for the weight bytes [p, p + bytes) kPrefetchBytes ahead, one cache line at a time: a core's stream
// of weights reaches the memory bandwidth only with more reads in flight than the hardware prefetcher starts.
inline void prefetch_ahead(const void* p, int bytes) {
  for (int line = 0; line < bytes; line += 64) prefetch(static_cast<const char*>(p) + kPrefetchBytes + line);
}

// f(std::integral_constant<int, R>{}) with R = rows (1 <= rows <= Max): the tile's row count as a
// compile-time constant, so its accumulators stay in registers.
template <int Max, typename F>
void with_rows(int rows, F&& f) {
  if constexpr (Max > 1) {
    if (rows < Max) return with_rows<Max - 1>(rows, f);
  }
  f(std::integral_constant<int, Max>{});
}

// One block of bfloat16 or int8 weights (pairs, 32 outputs) for Rows rows. Even and odd pairs add into
// separate sums, added at the end.
template <int Rows, typename Loader>
void block(const Loader& shared, const typename Loader::Weight* w, const uint16_t* x, int64_t ldx, int64_t pairs, Vec* acc) {
  const Loader load = shared;
  Vec odd[Rows * kVectors];
  for (int i = 0; i < Rows * kVectors; ++i) acc[i] = odd[i] = zero();
  const auto add_pair = [&](int64_t p, Vec* sums) {
    prefetch_ahead(w + p * kBlock * 2, kBlock * 2 * sizeof(*w));
    Pairs wv[kVectors];
    load(w + p * kBlock * 2, wv);
    for (int r = 0; r < Rows; ++r) {
      const XPair xv = broadcast_pair(x + r * ldx + 2 * p);
      for (int j = 0; j < kVectors; ++j) sums[r * kVectors + j] = dot(sums[r * kVectors + j], xv, wv[j]);
    }
  };
  for (int64_t p = 0; p < pairs; p += 2) {
    add_pair(p, acc);
    if (p + 1 < pairs) add_pair(p + 1, odd);
  }
  for (int i = 0; i < Rows * kVectors; ++i) acc[i] = add(acc[i], odd[i]);
}

// int4's inputs as the dot-product path multiplies them: each row's groups of 32 bfloat16 inputs as int16,
// x * 2^shift rounded to nearest even, with the largest shift that keeps the group's largest |x| under 2^15
// (so every input within 2^7 of it is exact: a bfloat16 has 8 significant bits); per group the unit
// 2^-shift and the sum of the group's int16 inputs times it (exact). A group's dot products are then integer
// sums, exact in any order, so their bits cannot depend on the backend or on the other rows.
struct Int16Inputs {
  std::vector<int16_t> values;     // (rows, k)
  std::vector<float> units, sums;  // (rows, groups)
};

// 2^e for -126 <= e <= 127, from its bits.
inline float power_of_two(int e) {
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline Int16Inputs int16_inputs(const uint16_t* x, int64_t rows, int64_t k) {
  const int64_t groups = k / kGroup;
  Int16Inputs in{std::vector<int16_t>(rows * k), std::vector<float>(rows * groups), std::vector<float>(rows * groups)};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* xg = x + r * k + g * kGroup;
      int16_t* out = in.values.data() + r * k + g * kGroup;
      int top = 0;  // the largest biased exponent: |x| < 2^(top - 126)
      for (int i = 0; i < kGroup; ++i) top = std::max(top, (xg[i] >> 7) & 0xFF);
      if (top == 0xFF) {  // an infinity or NaN: the outputs become NaN
        in.units[r * groups + g] = in.sums[r * groups + g] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const int shift = 141 - std::max(top, 15);  // |x| 2^shift < 2^15, and 2^-shift stays a normal float
      const float up = power_of_two(shift), unit = power_of_two(-shift);
      int32_t total = 0;
      for (int i = 0; i < kGroup; ++i) {
        // to nearest even: adding and taking away 1.5 * 2^23 leaves an integer (exact for |v| < 2^22), in
        // plain float32 adds the compiler can vectorize, where a call to nearbyint would not be
        const float v = bfloat16_value(xg[i]) * up, rounded = (v + 12582912.0f) - 12582912.0f;
        out[i] = static_cast<int16_t>(rounded);
        total += out[i];
      }
      in.units[r * groups + g] = unit;
      in.sums[r * groups + g] = static_cast<float>(total) * unit;
    }
  return in;
}

// One block of int4 weights: w holds (pairs, 32) bytes, sz (groups, 2, 32) float16 scales and minimums, x the
// rows' int16 inputs (ldx apart) and units, sums their (Rows, groups) units and sums. Per group, the nibbles'
// integer dot products (at most 32 x 15 x 32640, under 2^24: exact in float32), then
// acc = (dot * (scale * unit) + acc) + min * sum, each fused. A pass over a group sums `Vectors` of the
// block's 16-output vectors from `first` on (the backend's kInt4PassVectors when several rows share it): an
// integer sum is exact in any order, and each output still adds its groups in order, so a row's bits do not
// depend on the passes.
template <int Rows, int Vectors>
void group_int4(const uint8_t* w, const uint16_t* sz, const int16_t* x, int64_t ldx, const float* units,
                const float* sums, int64_t groups, int64_t g, int first, Vec* acc) {
  IVec dots[Rows * Vectors];
  for (int i = 0; i < Rows * Vectors; ++i) dots[i] = izero();
  for (int64_t p = g * kGroupPairs; p < (g + 1) * kGroupPairs; ++p) {
    IPairs wv[Vectors];
    for (int j = 0; j < Vectors; ++j) wv[j] = int4_ipairs(w + p * kBlock, first + j);
    for (int r = 0; r < Rows; ++r) {
      const XIPair xv = broadcast_ipair(x + r * ldx + 2 * p);
      for (int j = 0; j < Vectors; ++j) dots[r * Vectors + j] = idot(dots[r * Vectors + j], xv, wv[j]);
    }
  }
  for (int j = 0; j < Vectors; ++j) {
    const int o = (first + j) * 16;
    const Vec scale = load_half(sz + (g * 2) * kBlock + o), minimum = load_half(sz + (g * 2 + 1) * kBlock + o);
    for (int r = 0; r < Rows; ++r) {
      const int i = r * kVectors + first + j;
      const Vec step = mul(scale, set1(units[r * groups + g]));
      acc[i] = fmadd(minimum, set1(sums[r * groups + g]), fmadd(to_float(dots[r * Vectors + j]), step, acc[i]));
    }
  }
}

template <int Rows>
void block_int4(const uint8_t* w, const uint16_t* sz, const int16_t* x, int64_t ldx, const float* units,
                const float* sums, int64_t groups, Vec* acc) {
  constexpr int pass = Rows == 1 ? kVectors : kInt4PassVectors;
  static_assert(kVectors % pass == 0, "passes take the block's vectors in equal parts");
  for (int i = 0; i < Rows * kVectors; ++i) acc[i] = zero();
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_ahead(w + g * kGroupPairs * kBlock, kGroupPairs * kBlock);
    for (int first = 0; first < kVectors; first += pass)
      group_int4<Rows, pass>(w, sz, x, ldx, units, sums, groups, g, first, acc);
  }
}

// y[col..col + 16) of one row (up to the n outputs) = round_bf16(v * scale[col] + bias[col]).
inline void emit(Vec v, int64_t col, int64_t n, const float* scales, const float* bias, uint16_t* y) {
  const int64_t left = n - col;
  if (scales) v = mul(v, load(scales + col, left));
  if (bias) v = add(v, load(bias + col, left));
  store(y + col, v, left);
}

// Every block of outputs for every row, `RowTile` rows at a time: tile(b, r0, rows, acc) sums block b for
// rows [r0, r0 + rows) into acc, then y[r, col] = round_bf16(acc * scale[col] + bias[col]).
template <int RowTile, typename Tile>
void run(int64_t rows, int64_t n, int64_t blocks, const float* scales, const float* bias, uint16_t* y, Tile&& tile) {
  parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    Vec acc[RowTile * kVectors];
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t r0 = 0; r0 < rows; r0 += RowTile) {
        const int count = static_cast<int>(std::min<int64_t>(RowTile, rows - r0));
        tile(b, r0, count, acc);
        for (int r = 0; r < count; ++r)
          for (int j = 0; j < kVectors && b * kBlock + j * 16 < n; ++j)
            emit(acc[r * kVectors + j], b * kBlock + j * 16, n, scales, bias, y + (r0 + r) * n);
      }
    }
  });
}

// y (rows, n) = x (rows, 2 pairs) W^T for bfloat16 or int8 weights packed by pack_dense.
template <typename Loader>
void dense_rows(const Loader& load, const uint16_t* x, const typename Loader::Weight* w, int64_t rows, int64_t n,
                int64_t blocks, int64_t pairs, const float* scales, const float* bias, uint16_t* y) {
  run<kRowTile>(rows, n, blocks, scales, bias, y, [&](int64_t b, int64_t r0, int count, Vec* acc) {
    with_rows<kRowTile>(count, [&](auto tile) {
      block<decltype(tile)::value>(load, w + b * pairs * kBlock * 2, x + r0 * 2 * pairs, 2 * pairs, pairs, acc);
    });
  });
}

// Each row's inputs summed per int4 group, in a fixed order: (rows, k / kGroup) (AMX's tiles, which multiply
// the bfloat16 inputs by 128 + q).
inline std::vector<float> group_sums(const uint16_t* x, int64_t rows, int64_t k) {
  const int64_t groups = k / kGroup;
  std::vector<float> sums(rows * groups);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* xg = x + r * k + g * kGroup;
      sums[r * groups + g] = reduce_add(add(load(xg), load(xg + 16)));
    }
  return sums;
}

// y (rows, n) = x (rows, k) W^T for int4 weights and scales packed by pack_int4, the inputs from int16_inputs.
inline void int4_rows(const Int16Inputs& in, const uint8_t* w, const uint16_t* sz, int64_t rows, int64_t n,
                      int64_t blocks, int64_t pairs, const float* bias, uint16_t* y) {
  const int64_t k = 2 * pairs, groups = k / kGroup;
  run<kInt4RowTile>(rows, n, blocks, nullptr, bias, y, [&](int64_t b, int64_t r0, int count, Vec* acc) {
    with_rows<kInt4RowTile>(count, [&](auto tile) {
      block_int4<decltype(tile)::value>(w + b * pairs * kBlock, sz + b * groups * 2 * kBlock, in.values.data() + r0 * k,
                                        k, in.units.data() + r0 * groups, in.sums.data() + r0 * groups, groups, acc);
    });
  });
}

// Where weight (o, i) of an (n, k) matrix lies in its packed form (bfloat16: in uint16 units; int8: bytes).
inline int64_t dense_offset(int64_t o, int64_t i, int64_t k, bool int8) {
  const int64_t run = (o / kBlock * (k / 2) + i / 2) * kBlock * 2;
  const int position = static_cast<int>(o % kBlock) * 2 + static_cast<int>(i % 2);
  return run + (int8 ? int8_slot_of(position) : position);
}

// Lays out an (n, k) weight (k even) in blocks of 32 outputs: out holds ceil(n / 32) * 32 * k values (the
// rows past n zero). int8 weights follow the backend's loader order.
template <typename T>
void pack_dense(const T* w, int64_t n, int64_t k, T* out) {
  constexpr bool int8 = std::is_same_v<T, int8_t>;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t o = b * kBlock; o < (b + 1) * kBlock; ++o)
        for (int64_t i = 0; i < k; ++i) out[dense_offset(o, i, k, int8)] = o < n ? w[o * k + i] : T{};
  });
}

// pack_dense's inverse: the (n, k) weight back.
template <typename T>
void unpack_dense(const T* packed, int64_t n, int64_t k, T* out) {
  constexpr bool int8 = std::is_same_v<T, int8_t>;
  for (int64_t o = 0; o < n; ++o)
    for (int64_t i = 0; i < k; ++i) out[o * k + i] = packed[dense_offset(o, i, k, int8)];
}

// Lays out (n, k) 4-bit values (k a multiple of kGroup) and (n, k / kGroup, 2) float16 scales and minimums:
// out (blocks, k / 2, 32) bytes, a pair's 32 bytes as (output % 16, element) with the block's first 16
// outputs in the low nibbles; sz_out (blocks, groups, 2, 32).
inline void pack_int4(const uint8_t* q, const uint16_t* sz, int64_t n, int64_t k, uint8_t* out, uint16_t* sz_out) {
  const int64_t blocks = (n + kBlock - 1) / kBlock, groups = k / kGroup;
  parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t p = 0; p < k / 2; ++p)
        for (int j = 0; j < 16; ++j)
          for (int e = 0; e < 2; ++e) {
            const int64_t low = b * kBlock + j, high = low + 16, i = 2 * p + e;
            const uint8_t lo = low < n ? q[low * k + i] : 0, hi = high < n ? q[high * k + i] : 0;
            out[(b * (k / 2) + p) * kBlock + 2 * j + e] = static_cast<uint8_t>(lo | hi << 4);
          }
      for (int64_t g = 0; g < groups; ++g)
        for (int s = 0; s < 2; ++s)
          for (int o = 0; o < kBlock; ++o) {
            const int64_t row = b * kBlock + o;
            sz_out[((b * groups + g) * 2 + s) * kBlock + o] = row < n ? sz[(row * groups + g) * 2 + s] : 0;
          }
    }
  });
}

// pack_int4's inverse for the values: (n, k) nibbles back.
inline void unpack_int4(const uint8_t* packed, int64_t n, int64_t k, uint8_t* q) {
  for (int64_t o = 0; o < n; ++o)
    for (int64_t i = 0; i < k; ++i) {
      const int64_t b = o / kBlock, j = o % 16, p = i / 2, e = i % 2;
      const uint8_t byte = packed[(b * (k / 2) + p) * kBlock + 2 * j + e];
      q[o * k + i] = static_cast<uint8_t>(o % kBlock < 16 ? byte & 15 : byte >> 4);
    }
}

}  // namespace simd
