// y = x W^T (+ b) in bfloat16 for the few rows of a decoding step, at the speed of reading W once.
// W is bfloat16; or int8 with one scale per output (y = scale * x q^T + b); or int4 with a scale and a
// zero per output and group of 32 inputs (w = (q - 8) * scale + zero, q in 0..15).
//
// W is packed at load as (N/32, K/2, 32, 2): for each block of 32 outputs, each pair of inputs is one
// run of 32 pairs (128 bytes in bfloat16; 64 in int8, in the byte order its unpacking needs; 32 in
// int4, the first 16 outputs' nibbles low and the other 16's high), so a block is one contiguous
// stream and the hardware prefetcher sees a single sequential read (a block also asks for its bytes
// 16 KiB ahead). int8 pairs are widened to bfloat16 in registers by byte-table lookups (exactly: every
// int8 value is a bfloat16); an int4 nibble q becomes the bfloat16 128 + q with one bitwise OR (its
// bits are 0x4300 | q), and each group's sum is corrected by 136 times the group's input sum before
// its scale and zero apply.
// AVX-512 BF16's dot-product instruction multiplies a broadcast input pair by the pairs of 16 outputs
// at once, so accumulators hold outputs directly (no horizontal sums). Several rows share each weight
// load, and each output sums even and odd pairs in two chains, so a lone row does not wait on the
// instruction's latency. Every output is accumulated over the input pairs in the same order
// whatever the number of rows, the row's place in the batch or the thread count, so results are
// batch-invariant.
//
// Where the CPU has AMX (Intel Sapphire Rapids and later) and the input width is a multiple of 32,
// bfloat16, int8 and int4 weights go through its tile unit instead, for every row count: one tile
// instruction multiplies up to 16 rows by a 32-input, 16-output tile in the time it takes for one, so
// a speculative tree's rows cost little beyond the first, where the dot-product instruction pays for
// each row again. A bfloat16 block's packed layout is already the tile unit's (pairs as rows, 128
// bytes apart), so its tiles load straight from the weight; int8 and int4 pairs are widened as above
// into a small buffer first, and an int4 step (one group) is read out and corrected before the next.
// The tile unit's rounding differs from the dot-product instruction's, so a weight takes the same path
// whatever the rows, and a row's bits still never depend on the others.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr int kVectors = 2;                 // 16-output vectors per block
constexpr int kBlock = 16 * kVectors;       // outputs per block
constexpr int kChains = 2;                  // independent sums per output (see block)
constexpr int kRowTile = 6;                 // rows per pass over a block (24 accumulators)
constexpr int kGroup = 32;                  // int4 inputs per scale and zero
constexpr int kGroupPairs = kGroup / 2;
constexpr int kInt4RowTile = 4;             // 8 accumulators and 16 group sums
constexpr int kPrefetchBytes = 16384;       // how far ahead of its reads a block asks for its weights
constexpr int kTileRows = 16;               // rows of an AMX input or result tile
constexpr int kTilePairs = 16;              // input pairs per AMX step (a tile row of 32 bfloat16)
constexpr int kAmxRowTile = 2 * kTileRows;  // rows per pass over a block: two input tiles, four result tiles

// The bfloat16 bits of 0..127 as two 128-entry byte tables (low and high bytes), two registers each.
struct Int8Tables {
  __m512i low[2], high[2];
  Int8Tables() {
    alignas(64) uint8_t bytes[2][128];
    for (int a = 0; a < 128; ++a) {
      const float f = static_cast<float>(a);
      uint32_t bits;
      std::memcpy(&bits, &f, sizeof bits);  // exact in bfloat16: the low 16 bits are zero
      bytes[0][a] = static_cast<uint8_t>(bits >> 16);
      bytes[1][a] = static_cast<uint8_t>(bits >> 24);
    }
    for (int h = 0; h < 2; ++h) {
      low[h] = _mm512_load_si512(bytes[0] + 64 * h);
      high[h] = _mm512_load_si512(bytes[1] + 64 * h);
    }
  }
};

// Pair loaders: one pair of inputs for the block's 32 outputs as two vectors of 16 outputs' pairs in
// bfloat16. A block copies its loader once, so the int8 tables sit in registers while it streams.
struct Bfloat16Pairs {
  using Weight = uint16_t;
  void operator()(const uint16_t* w, __m512bh* v) const {
    for (int j = 0; j < kVectors; ++j) v[j] = (__m512bh)_mm512_loadu_si512(w + j * 32);
  }
};
// int8 (64 bytes, in the order `pack` gives them): |q|'s bfloat16 bytes looked up, q's sign put back,
// low and high bytes interleaved into 16-bit lanes; six instructions for 64 weights, all exact.
struct Int8Pairs {
  using Weight = int8_t;
  Int8Tables tables;
  void operator()(const int8_t* w, __m512bh* v) const {
    const __m512i q = _mm512_loadu_si512(w), magnitude = _mm512_abs_epi8(q);
    const __m512i low = _mm512_permutex2var_epi8(tables.low[0], magnitude, tables.low[1]);
    const __m512i high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(tables.high[0], magnitude, tables.high[1]), q,
                                                   _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // a | b & c
    v[0] = (__m512bh)_mm512_unpacklo_epi8(low, high);
    v[1] = (__m512bh)_mm512_unpackhi_epi8(low, high);
  }
};

// Asks for the weight bytes [p, p + bytes) kPrefetchBytes ahead, one cache line at a time: a core's
// stream of weights reaches the memory bandwidth only with more reads in flight than the hardware
// prefetcher starts on its own.
inline void prefetch(const void* p, int bytes) {
  for (int line = 0; line < bytes; line += 64) _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes + line, _MM_HINT_T0);
}

// A row's pair of bfloat16 inputs at p in every 32-bit lane (copied out as one int32: reading uint16
// data through an int32 pointer would break strict aliasing; the copy compiles to the same broadcast).
inline __m512bh broadcast_pair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(pair);
}

}  // namespace

bool tiles_available() {
  static const bool usable = [] {
    if (const char* off = std::getenv("SPLITLLM_TILES"); off && std::strcmp(off, "0") == 0) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
}

namespace {

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
// separate sums (kChains), added at the end: with one row, a single chain of dot products per output
// would wait on each instruction's latency and read the weights at a fraction of the bandwidth.
template <int Rows, typename Pairs>
void block(const Pairs& shared, const typename Pairs::Weight* w, const uint16_t* x, int64_t ldx, int64_t pairs,
           __m512* acc) {
  static_assert(kChains == 2, "two sums per output");
  const Pairs load = shared;
  __m512 odd[Rows * kVectors];
  for (int i = 0; i < Rows * kVectors; ++i) acc[i] = odd[i] = _mm512_setzero_ps();
  const auto add = [&](int64_t p, __m512* sums) {
    prefetch(w + p * kVectors * 32, kBlock * 2 * sizeof(*w));
    __m512bh wv[kVectors];
    load(w + p * kVectors * 32, wv);
    for (int r = 0; r < Rows; ++r) {
      const __m512bh xv = broadcast_pair(x + r * ldx + 2 * p);
      for (int j = 0; j < kVectors; ++j) sums[r * kVectors + j] = _mm512_dpbf16_ps(sums[r * kVectors + j], xv, wv[j]);
    }
  };
  for (int64_t p = 0; p < pairs; p += kChains) {
    add(p, acc);
    if (p + 1 < pairs) add(p + 1, odd);
  }
  for (int i = 0; i < Rows * kVectors; ++i) acc[i] = _mm512_add_ps(acc[i], odd[i]);
}

// acc + one int4 group's share of 16 outputs: dot is the group's sum of x (128 + q) (the nibbles as
// bfloat16), sum its inputs' sum, so sum x (q - 8) = dot - 136 sum, then scale and zero apply.
inline __m512 add_group(__m512 acc, __m512 dot, float sum, __m512 scale, __m512 zero) {
  const __m512 s = _mm512_set1_ps(sum);
  const __m512 centered = _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), s, dot);  // 128 from the OR, 8 from q - 8
  return _mm512_fmadd_ps(zero, s, _mm512_fmadd_ps(centered, scale, acc));
}

// One block of int4 weights: w holds (pairs, 32) bytes, sz (groups, 2, 32) bfloat16 scales and zeros,
// sums (Rows, groups) each row's input sum per group. Within a group, even and odd pairs add into
// separate sums (kChains, as in block), added at the group's end.
template <int Rows>
void block_int4(const uint8_t* w, const uint16_t* sz, const uint16_t* x, int64_t ldx, const float* sums,
                int64_t groups, __m512* acc) {
  static_assert(kChains == 2 && kGroupPairs % kChains == 0, "a group's pairs split evenly over two sums");
  const __m512i nibble = _mm512_set1_epi16(0x000F), exponent = _mm512_set1_epi16(0x4300);
  for (int i = 0; i < Rows * kVectors; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    prefetch(w + g * kGroupPairs * kBlock, kGroupPairs * kBlock);
    __m512 even[Rows * kVectors], odd[Rows * kVectors];
    for (int i = 0; i < Rows * kVectors; ++i) even[i] = odd[i] = _mm512_setzero_ps();
    const auto add = [&](int64_t p, __m512* dots) {
      const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * kBlock)));
      const __m512bh wv[kVectors] = {(__m512bh)_mm512_ternarylogic_epi32(bytes, nibble, exponent, 0xEA),  // a & b | c
                                     (__m512bh)_mm512_or_si512(_mm512_srli_epi16(bytes, 4), exponent)};
      for (int r = 0; r < Rows; ++r) {
        const __m512bh xv = broadcast_pair(x + r * ldx + 2 * p);
        for (int j = 0; j < kVectors; ++j) dots[r * kVectors + j] = _mm512_dpbf16_ps(dots[r * kVectors + j], xv, wv[j]);
      }
    };
    for (int64_t p = g * kGroupPairs; p < (g + 1) * kGroupPairs; p += kChains) {
      add(p, even);
      add(p + 1, odd);
    }
    for (int j = 0; j < kVectors; ++j) {
      const __m512 scale = load(sz + (g * 2) * kBlock + j * 16, 0xFFFF);
      const __m512 zero = load(sz + (g * 2 + 1) * kBlock + j * 16, 0xFFFF);
      for (int r = 0; r < Rows; ++r) {
        const int i = r * kVectors + j;
        acc[i] = add_group(acc[i], _mm512_add_ps(even[i], odd[i]), sums[r * groups + g], scale, zero);
      }
    }
  }
}

// y[col..col + 16) of one row (masked to the n outputs) = round_bf16(v * scale[col] + bias[col]).
inline void emit(__m512 v, int64_t col, int64_t n, const float* scales, const float* bias, uint16_t* y) {
  const __mmask16 mask = lanes(n - col);
  if (scales) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, scales + col));
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + col));
  store(y + col, v, mask);
}

// Every block of outputs for every row, `RowTile` rows at a time: tile(b, r0, rows, acc) sums block b
// for rows [r0, r0 + rows) into acc, then y[r, col] = round_bf16(acc * scale[col] + bias[col]).
template <int RowTile, typename Tile>
void run(int64_t rows, int64_t n, int64_t blocks, const float* scales, const float* bias, uint16_t* y, Tile&& tile) {
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    __m512 acc[RowTile * kVectors];
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

// Where a pass's K steps get their weight tiles (6 and 7: 16 input pairs for each half of the block's
// outputs). bfloat16 pairs load in place, 128 bytes apart; int8 pairs are widened into `staged` first.
template <typename Pairs>
struct DenseTiles {
  static constexpr bool kGrouped = false;  // one scale per output, applied once at the end
  Pairs widen;
  const typename Pairs::Weight* w;
  int64_t pairs;

  void load(int64_t b, int64_t step, uint16_t (*staged)[kTilePairs][32]) const {
    const typename Pairs::Weight* ws = w + (b * pairs + step * kTilePairs) * kBlock * 2;
    if constexpr (std::is_same_v<Pairs, Bfloat16Pairs>) {
      _tile_loadd(6, ws, kBlock * 4);
      _tile_loadd(7, ws + 32, kBlock * 4);
    } else {
      for (int p = 0; p < kTilePairs; ++p) {
        __m512bh v[kVectors];
        widen(ws + p * kBlock * 2, v);
        for (int j = 0; j < kVectors; ++j) _mm512_store_si512(staged[j][p], (__m512i)v[j]);
      }
      _tile_loadd(6, staged[0], 64);
      _tile_loadd(7, staged[1], 64);
    }
  }
};

// int4: a K step is one group of 32 inputs, so each step's products are read out and corrected with
// the group's scale, zero and input sums (as block_int4 does) before the next step.
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
      const __m512 scale = ::load(szb + j * 16, 0xFFFF), zero = ::load(szb + kBlock + j * 16, 0xFFFF);
      for (int r = 0; r < count; ++r)
        _mm512_store_ps(acc[r] + j * 16, add_group(_mm512_load_ps(acc[r] + j * 16), _mm512_load_ps(dots[r] + j * 16),
                                                   sums[(r0 + r) * groups + g], scale, zero));
    }
  }
};

// The linear on the tile unit: each block's rows kAmxRowTile at a time, over K in 32-input steps.
template <typename Weights>
void run_tiles(const Weights& shared, const uint16_t* x, int64_t rows, int64_t n, int64_t blocks, int64_t pairs,
               const float* scales, const float* bias, uint16_t* y) {
  const int64_t k = 2 * pairs, steps = pairs / kTilePairs;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
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

template <typename Pairs>
void run_dense(const Pairs& load, const uint16_t* x, const typename Pairs::Weight* w, int64_t rows, int64_t n,
               int64_t blocks, int64_t pairs, const float* scales, const float* bias, uint16_t* y) {
  if (pairs % kTilePairs == 0 && tiles_available())
    return run_tiles(DenseTiles<Pairs>{load, w, pairs}, x, rows, n, blocks, pairs, scales, bias, y);
  run<kRowTile>(rows, n, blocks, scales, bias, y, [&](int64_t b, int64_t r0, int count, __m512* acc) {
    with_rows<kRowTile>(count, [&](auto tile) {
      block<decltype(tile)::value>(load, w + b * pairs * kBlock * 2, x + r0 * 2 * pairs, 2 * pairs, pairs, acc);
    });
  });
}

void run_int4(const uint16_t* x, const uint8_t* w, const uint16_t* sz, int64_t rows, int64_t n, int64_t blocks,
              int64_t pairs, const float* bias, uint16_t* y) {
  const int64_t k = 2 * pairs, groups = k / kGroup;
  std::vector<float> sums(rows * groups);  // each row's inputs summed per group, in a fixed order
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* xg = x + r * k + g * kGroup;
      sums[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(load(xg, 0xFFFF), load(xg + 16, 0xFFFF)));
    }
  if (tiles_available())  // an int4 width is a multiple of 32: always whole tile steps
    return run_tiles(Int4Tiles{w, sz, sums.data(), pairs, groups}, x, rows, n, blocks, pairs, nullptr, bias, y);
  run<kInt4RowTile>(rows, n, blocks, nullptr, bias, y, [&](int64_t b, int64_t r0, int count, __m512* acc) {
    with_rows<kInt4RowTile>(count, [&](auto tile) {
      block_int4<decltype(tile)::value>(w + b * pairs * kBlock, sz + b * groups * 2 * kBlock, x + r0 * k, k,
                                        sums.data() + r0 * groups, groups, acc);
    });
  });
}

bool is_int4(const torch::Tensor& packed) { return packed.scalar_type() == torch::kByte; }

}  // namespace

torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == torch::kBFloat16 || weight.scalar_type() == torch::kChar),
              "pack: a 2-D bfloat16 or int8 weight");
  TORCH_CHECK(weight.size(1) % 2 == 0, "pack: the input width must be even");
  int64_t n = weight.size(0), k = weight.size(1), blocks = (n + kBlock - 1) / kBlock;
  TORCH_CHECK(weight.scalar_type() != torch::kChar || weight.numel() == 0 || weight.min().item<int>() > -128,
              "pack: int8 weights must lie in -127..127");
  auto padded = torch::zeros({blocks * kBlock, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  auto packed = padded.view({blocks, kBlock, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  if (weight.scalar_type() != torch::kChar) return packed;
  // Each pair's 64 bytes (vector, 128-bit lane, byte) -> (128-bit lane, vector, byte): the order in which
  // unpacking low and high bytes gives the two vectors back (see Int8Pairs).
  return packed.view({blocks, k / 2, kVectors, 4, 8}).permute({0, 1, 3, 2, 4}).contiguous().view({blocks, k / 2, kBlock, 2});
}

std::tuple<torch::Tensor, torch::Tensor> pack_int4(const torch::Tensor& q, const torch::Tensor& scales_zeros) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kByte, "pack_int4: a 2-D uint8 weight of values 0..15");
  const int64_t n = q.size(0), k = q.size(1), blocks = (n + kBlock - 1) / kBlock;
  TORCH_CHECK(k % kGroup == 0, "pack_int4: the input width must be a multiple of ", kGroup);
  TORCH_CHECK(q.numel() == 0 || q.max().item<int>() < 16, "pack_int4: values must lie in 0..15");
  TORCH_CHECK(scales_zeros.sizes() == torch::IntArrayRef({n, k / kGroup, 2}) && scales_zeros.scalar_type() == torch::kBFloat16,
              "pack_int4: bfloat16 scales and zeros of shape (outputs, inputs / ", kGroup, ", 2)");
  auto padded = torch::zeros({blocks * kBlock, k}, q.options());
  padded.narrow(0, 0, n).copy_(q);
  // (block, half, output, pair, element) -> (block, pair, half, output * 2 + element)
  auto lanes = padded.view({blocks, kVectors, 16, k / 2, 2}).permute({0, 3, 1, 2, 4}).reshape({blocks, k / 2, kVectors, 32});
  auto packed = lanes.select(2, 0).bitwise_or(lanes.select(2, 1).bitwise_left_shift(4)).contiguous();
  auto sz = torch::zeros({blocks * kBlock, k / kGroup, 2}, scales_zeros.options());
  sz.narrow(0, 0, n).copy_(scales_zeros);
  return std::make_tuple(packed, sz.view({blocks, kBlock, k / kGroup, 2}).permute({0, 2, 3, 1}).contiguous());
}

void linear_rows(const uint16_t* x, int64_t rows, const torch::Tensor& packed, int64_t n, const float* bias,
                 const c10::optional<torch::Tensor>& scales, uint16_t* y) {
  const int64_t blocks = packed.size(0), pairs = packed.size(1);
  if (is_int4(packed))
    run_int4(x, packed.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales->data_ptr()), rows, n, blocks,
             pairs, bias, y);
  else if (packed.scalar_type() == torch::kChar) {
    static const Int8Pairs int8;
    run_dense(int8, x, packed.data_ptr<int8_t>(), rows, n, blocks, pairs, scales->data_ptr<float>(), bias, y);
  } else {
    run_dense(Bfloat16Pairs{}, x, reinterpret_cast<const uint16_t*>(packed.data_ptr()), rows, n, blocks, pairs, nullptr,
              bias, y);
  }
}

void check_linear(const torch::Tensor& packed, int64_t n, int64_t k, const c10::optional<torch::Tensor>& bias,
                  const c10::optional<torch::Tensor>& scales) {
  TORCH_CHECK(!bias || (is_cpu(*bias, torch::kFloat) && bias->is_contiguous() && bias->numel() == n),
              "linear: the bias must be float32 with one value per output");
  TORCH_CHECK(packed.device().is_cpu() && packed.is_contiguous() && packed.dim() >= 2 && packed.size(1) * 2 == k &&
              n >= 0 && packed.size(0) * kBlock >= n,
              "linear: input width ", k, " and ", n, " outputs do not match the packed weight");
  if (is_int4(packed)) {
    TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlock && k % kGroup == 0, "linear: int4 weight not packed");
    TORCH_CHECK(scales && is_cpu(*scales, torch::kBFloat16) && scales->is_contiguous() &&
                scales->sizes() == torch::IntArrayRef({packed.size(0), k / kGroup, 2, kBlock}),
                "linear: int4 weights need packed bfloat16 scales and zeros (pack_int4)");
    return;
  }
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kBlock && packed.size(3) == 2, "linear: weight not packed");
  const bool int8 = packed.scalar_type() == torch::kChar;
  TORCH_CHECK(int8 || packed.scalar_type() == torch::kBFloat16, "linear: bfloat16, int8 or int4 weights");
  TORCH_CHECK(int8 == scales.has_value(), "linear: int8 weights need scales, bfloat16 weights none");
  TORCH_CHECK(!scales || (is_cpu(*scales, torch::kFloat) && scales->is_contiguous() && scales->numel() == n),
              "linear: int8 scales must be float32 with one value per output");
}

torch::Tensor unpack(const torch::Tensor& packed, int64_t n, const c10::optional<torch::Tensor>& scales) {
  const int64_t blocks = packed.size(0), k = packed.size(1) * 2;
  check_linear(packed, n, k, c10::nullopt, scales);
  if (is_int4(packed)) {  // (block, pair, 32 lanes): low nibbles the block's first 16 outputs
    auto halves = torch::stack({packed.bitwise_and(15), packed.bitwise_right_shift(4)}, 2).view({blocks, k / 2, kVectors, 16, 2});
    auto q = halves.permute({0, 2, 3, 1, 4}).reshape({blocks * kBlock, k}).narrow(0, 0, n).to(torch::kFloat);
    auto sz = scales->permute({0, 3, 1, 2}).reshape({blocks * kBlock, k / kGroup, 2}).narrow(0, 0, n).to(torch::kFloat);
    auto groups = q.view({n, k / kGroup, kGroup});
    return ((groups - 8) * sz.narrow(2, 0, 1) + sz.narrow(2, 1, 1)).view({n, k}).to(torch::kBFloat16);
  }
  auto pairs = packed;
  if (packed.scalar_type() == torch::kChar)  // undo pack's byte order: (128-bit lane, vector, byte) -> (vector, lane, byte)
    pairs = packed.view({blocks, k / 2, 4, kVectors, 8}).permute({0, 1, 3, 2, 4}).reshape({blocks, k / 2, kBlock, 2});
  auto dense = pairs.permute({0, 2, 1, 3}).reshape({blocks * kBlock, k}).narrow(0, 0, n);
  return scales ? (dense.to(torch::kFloat) * scales->unsqueeze(1)).to(torch::kBFloat16) : dense;
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, const c10::optional<torch::Tensor>& bias,
                     const c10::optional<torch::Tensor>& scales) {
  TORCH_CHECK(is_cpu(x, torch::kBFloat16) && x.is_contiguous() && x.dim() >= 1, "linear: a contiguous bfloat16 input on the CPU");
  const int64_t k = x.size(-1), rows = k ? x.numel() / k : 0;
  check_linear(packed, n, k, bias, scales);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = torch::empty(sizes, x.options());
  linear_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), rows, packed, n, bias ? bias->data_ptr<float>() : nullptr,
              scales, reinterpret_cast<uint16_t*>(y.data_ptr()));
  return y;
}
