// Linears on AMX's tile unit (Intel Sapphire Rapids and later), for the AVX-512 build only: where the CPU
// has it and the input width is a multiple of 32, bfloat16, int8 and int4 weights go through the tile unit
// for every row count: one tile instruction multiplies up to 16 rows by a 32-input, 16-output tile in the
// time it takes for one, so a speculative tree's rows cost little beyond the first, where the dot-product
// instruction pays for each row again. A bfloat16 block's packed layout is already the tile unit's (pairs
// as rows, 128 bytes apart), so its tiles load straight from the weight; int8 and int4 pairs are widened
// into a small buffer first, and an int4 step (one group) is read out and corrected before the next.
// The tile unit's rounding differs from the dot-product instruction's, so a weight takes the same path
// whatever the rows, and a row's bits still never depend on the others.
#pragma once
#include <immintrin.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "linear_core.h"

namespace simd {

constexpr int kTileRows = 16;               // rows of an AMX input or result tile
constexpr int kTilePairs = 16;              // input pairs per AMX step (a tile row of 32 bfloat16)
constexpr int kAmxRowTile = 2 * kTileRows;  // rows per pass over a block: two input tiles, four result tiles

// Whether this process uses the tile unit: the CPU has it (CPUID leaf 7), Linux granted the tile state
// (asked once per process; the grant covers every thread) and SPLITLLM_TILES is not 0.
inline bool amx_usable() {
  static const bool usable = [] {
    if (const char* off = std::getenv("SPLITLLM_TILES"); off && std::strcmp(off, "0") == 0) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
}

// The tiles of one pass: results 0-3 (rows 0-15 and 16-31, outputs 0-15 and 16-31 of the block), inputs
// 4-5 (the two row groups' 32 inputs), weights 6-7 (the two output halves' 16 input pairs).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};

  explicit TileConfig(int count) {
    const int first = std::min(count, kTileRows), second = count - first;
    for (int t : {0, 1, 4}) set(t, first);
    if (second > 0)
      for (int t : {2, 3, 5}) set(t, second);
    for (int t : {6, 7}) set(t, kTilePairs);
  }
  void set(int tile, int count) {
    rows[tile] = static_cast<uint8_t>(count);
    bytes_per_row[tile] = 64;
  }
};

// Where a pass's K steps get their weight tiles (6 and 7: 16 input pairs for each half of the block's
// outputs). bfloat16 pairs load in place, 128 bytes apart; int8 pairs are widened into `staged` first.
template <typename Loader>
struct DenseTiles {
  static constexpr bool kGrouped = false;  // one scale per output, applied once at the end
  Loader widen;
  const typename Loader::Weight* w;
  int64_t pairs;

  void load(int64_t b, int64_t step, uint16_t (*staged)[kTilePairs][32]) const {
    const typename Loader::Weight* ws = w + (b * pairs + step * kTilePairs) * kBlock * 2;
    if constexpr (std::is_same_v<Loader, Bfloat16Loader>) {
      _tile_loadd(6, ws, kBlock * 4);
      _tile_loadd(7, ws + 32, kBlock * 4);
    } else {
      for (int p = 0; p < kTilePairs; ++p) {
        Pairs v[kVectors];
        widen(ws + p * kBlock * 2, v);
        for (int j = 0; j < kVectors; ++j) _mm512_store_si512(staged[j][p], (__m512i)v[j]);
      }
      _tile_loadd(6, staged[0], 64);
      _tile_loadd(7, staged[1], 64);
    }
  }
};

// acc + one int4 group's share of 16 outputs on the tiles (bfloat16 inputs times nibbles read as 128 + q): dot is the group's sum of x (128 + q), sum its inputs' sum,
// so sum x q = dot - 128 sum, then scale and minimum apply.
inline Vec add_group(Vec acc, Vec dot_sum, float sum, Vec scale, Vec minimum) {
  const Vec s = set1(sum);
  const Vec centered = fnmadd(set1(128.0f), s, dot_sum);  // 128 from the bfloat16 exponent the nibble sits under
  return fmadd(minimum, s, fmadd(centered, scale, acc));
}

// int4: a K step is one group of 32 inputs, so each step's products are read out and corrected with
// the group's scale, minimum and input sums (as block_int4 does) before the next step.
struct Int4Tiles {
  static_assert(kGroup == 2 * kTilePairs, "a K step of the tile unit is one int4 group");
  static constexpr bool kGrouped = true;
  const uint8_t* w;
  const uint16_t* sz;
  const float* sums;  // (rows, groups)
  int64_t pairs, groups;

  void load(int64_t b, int64_t g, uint16_t (*staged)[kTilePairs][32]) const {
    const __m512i nibble = _mm512_set1_epi16(0x000F), exponent = _mm512_set1_epi16(0x4300);
    const uint8_t* wg = w + (b * pairs + g * kTilePairs) * kBlock;
    for (int p = 0; p < kTilePairs; ++p) {
      const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + p * kBlock)));
      _mm512_store_si512(staged[0][p], _mm512_ternarylogic_epi32(bytes, nibble, exponent, 0xEA));  // a & b | c
      _mm512_store_si512(staged[1][p], _mm512_or_si512(_mm512_srli_epi16(bytes, 4), exponent));
    }
    _tile_loadd(6, staged[0], 64);
    _tile_loadd(7, staged[1], 64);
  }

  void correct(int64_t b, int64_t g, int64_t r0, int count, const float (*dots)[kBlock], float (*acc)[kBlock]) const {
    const uint16_t* szb = sz + (b * groups + g) * 2 * kBlock;
    for (int j = 0; j < kVectors; ++j) {
      const Vec scale = simd::load_half(szb + j * 16), minimum = simd::load_half(szb + kBlock + j * 16);
      for (int r = 0; r < count; ++r)
        _mm512_store_ps(acc[r] + j * 16, add_group(_mm512_load_ps(acc[r] + j * 16), _mm512_load_ps(dots[r] + j * 16),
                                                   sums[(r0 + r) * groups + g], scale, minimum));
    }
  }
};

// The linear on the tile unit: each block's rows kAmxRowTile at a time, over K in 32-input steps.
template <typename Weights>
void run_tiles(const Weights& shared, const uint16_t* x, int64_t rows, int64_t n, int64_t blocks, int64_t pairs,
               const float* scales, const float* bias, uint16_t* y) {
  const int64_t k = 2 * pairs, steps = pairs / kTilePairs;
  parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const Weights weights = shared;
    alignas(64) uint16_t staged[kVectors][kTilePairs][32];
    alignas(64) float dots[kAmxRowTile][kBlock], acc[kAmxRowTile][kBlock];
    const auto zero = [](bool second) {
      _tile_zero(0);
      _tile_zero(1);
      if (second) {
        _tile_zero(2);
        _tile_zero(3);
      }
    };
    const auto read = [](bool second, float (*into)[kBlock]) {
      _tile_stored(0, into[0], kBlock * 4);
      _tile_stored(1, into[0] + 16, kBlock * 4);
      if (second) {
        _tile_stored(2, into[kTileRows], kBlock * 4);
        _tile_stored(3, into[kTileRows] + 16, kBlock * 4);
      }
    };
    int configured = 0;
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t r0 = 0; r0 < rows; r0 += kAmxRowTile) {
        const int count = static_cast<int>(std::min<int64_t>(kAmxRowTile, rows - r0));
        const bool second = count > kTileRows;
        if (count != configured) {
          const TileConfig config(count);
          _tile_loadconfig(&config);
          configured = count;
        }
        if constexpr (Weights::kGrouped) std::memset(acc, 0, sizeof acc);
        else zero(second);
        const uint16_t* xr = x + r0 * k;
        for (int64_t step = 0; step < steps; ++step) {
          if constexpr (Weights::kGrouped) zero(second);
          weights.load(b, step, staged);
          _tile_loadd(4, xr + step * 2 * kTilePairs, k * 2);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (second) {
            _tile_loadd(5, xr + kTileRows * k + step * 2 * kTilePairs, k * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
          if constexpr (Weights::kGrouped) {
            read(second, dots);
            weights.correct(b, step, r0, count, dots, acc);
          }
        }
        if constexpr (!Weights::kGrouped) read(second, acc);
        for (int r = 0; r < count; ++r)
          for (int j = 0; j < kVectors && b * kBlock + j * 16 < n; ++j)
            emit(_mm512_load_ps(acc[r] + j * 16), b * kBlock + j * 16, n, scales, bias, y + (r0 + r) * n);
      }
    }
    if (configured) _tile_release();
  });
}

}  // namespace simd
