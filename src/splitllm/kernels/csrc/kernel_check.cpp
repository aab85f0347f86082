// A check of the kernels without PyTorch, for whichever SIMD backend it is compiled with (simd.h): every
// primitive of the SIMD layer against simd.h's statement of it, bit for bit; the linear kernel in bfloat16,
// int8 and int4, attention, and the row operations of rows.h against float64 references computed here
// naively, each row computed alone against the same row inside a batch. Inputs come from a fixed generator
// (splitmix64, integer arithmetic and exact float conversions only), so they are the same bits on every CPU
// and standard library.
//
//   g++ -O2 -ffp-contract=off -std=c++20 -I csrc [-DSPLITLLM_SIMD_AVX512 -mavx512f ... | -DSPLITLLM_SIMD_AVX2
//       -mavx2 -mfma -mf16c | -DSPLITLLM_SIMD_NEON (aarch64)] kernel_check.cpp -o kernel_check
//   kernel_check [--dump PATH]
//
// Prints "kernel_check: N checks passed" and exits 0, or prints each failure and exits 1. --dump PATH writes
// every output buffer's bytes, in a fixed order, to PATH: the backends' dumps must be byte-identical
// (tests/test_kernels.py compares each with the scalar reference's).
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "attention_core.h"
#include "linear_core.h"
#include "rows.h"

namespace {

// splitmix64: the inputs' only source, the same sequence everywhere.
struct Random {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform() { return static_cast<float>(next() >> 40) * 0x1p-24f; }  // [0, 1), exact
  float symmetric() { return 2.0f * uniform() - 1.0f; }                      // [-1, 1), exact
  // About N(0, 1): a centred sum of four uniforms scaled to unit variance (IEEE + and * only).
  float normal() { return ((uniform() + uniform()) + (uniform() + uniform()) - 2.0f) * 1.7320508f; }
  int below(int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); }
};

struct Checks {
  int passed = 0, failed = 0;
  std::vector<unsigned char> dump;

  void expect(bool ok, const std::string& what) {
    if (ok) {
      ++passed;
    } else {
      ++failed;
      std::printf("FAILED: %s\n", what.c_str());
    }
  }
  template <typename T>
  void record(const std::vector<T>& buffer) {
    const auto* bytes = reinterpret_cast<const unsigned char*>(buffer.data());
    dump.insert(dump.end(), bytes, bytes + buffer.size() * sizeof(T));
  }
};

float bf16(uint16_t b) { return simd::bfloat16_value(b); }
double value(uint16_t b) { return bf16(b); }
double value(float f) { return f; }

std::vector<uint16_t> bf16_normal(Random& rng, size_t count, float scale) {
  std::vector<uint16_t> out(count);
  for (auto& b : out) b = simd::bfloat16_bits(rng.normal() * scale);
  return out;
}
std::vector<float> float_normal(Random& rng, size_t count, float scale) {
  std::vector<float> out(count);
  for (auto& f : out) f = rng.normal() * scale;
  return out;
}

// The largest |out - ref| (less an allowance `slack`, if any) relative to max(|ref|, the reference's root
// mean square): a relative error that does not blow up where an output happens to lie near zero.
// rsqrt(mean(x^2) + eps) in float64: the reference of rows.h's norms.
template <typename T>
double reference_inverse_rms(const T* x, int64_t size, double eps) {
  double squares = 0;
  for (int64_t i = 0; i < size; ++i) squares += value(x[i]) * value(x[i]);
  return 1.0 / std::sqrt(squares / static_cast<double>(size) + eps);
}

template <typename T>
double error(const T* out, const std::vector<double>& ref, const std::vector<double>& slack = {}) {
  double squares = 0;
  for (double r : ref) squares += r * r;
  const double rms = ref.empty() ? 0.0 : std::sqrt(squares / static_cast<double>(ref.size()));
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double o = value(out[i]), allowed = slack.empty() ? 0.0 : slack[i];
    if (!std::isfinite(o)) return INFINITY;
    worst = std::max(worst, (std::fabs(o - ref[i]) - allowed) / std::max({std::fabs(ref[i]), rms, 1e-30}));
  }
  return worst;
}

template <typename T>
bool same_bits(const T* a, const T* b, size_t count) {
  return std::memcmp(a, b, count * sizeof(T)) == 0;
}

std::string name(const char* what, int64_t a, int64_t b, int64_t c = -1) {
  std::string out = std::string(what) + " " + std::to_string(a) + "x" + std::to_string(b);
  return c < 0 ? out : out + ", " + std::to_string(c) + " rows";
}

// ---- the SIMD layer -----------------------------------------------------------------------------------------

// About N(0, 1) times 2^e for e uniform in -spread..spread (an exact power of two).
float wide(Random& rng, int spread) {
  return rng.normal() * std::ldexp(1.0f, rng.below(2 * spread + 1) - spread);
}

using Lanes = std::array<float, simd::kLanes>;

Lanes lanes_of(simd::Vec v) {
  Lanes out;
  simd::store(out.data(), v);
  return out;
}

Lanes wide_lanes(Random& rng, int spread) {
  Lanes out;
  for (auto& f : out) f = wide(rng, spread);
  return out;
}

// simd.h's statement of reduce_add and sum16, in plain float32 arithmetic.
float spec_reduce_add(const Lanes& v) {
  float quarter[4];
  for (int i = 0; i < 4; ++i) quarter[i] = (v[i] + v[i + 8]) + (v[i + 4] + v[i + 12]);
  return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}
float spec_sum(const Lanes& v) {
  float group[4];
  for (int l = 0; l < 4; ++l) group[l] = (v[4 * l] + v[4 * l + 2]) + (v[4 * l + 1] + v[4 * l + 3]);
  return (group[0] + group[1]) + (group[2] + group[3]);
}

bool same_float(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Compares a backend's lanes with the spec's, lane by lane, bit for bit; prints the first difference.
struct LaneCheck {
  Checks& c;
  std::string what;
  bool ok = true;
  void operator()(const Lanes& got, const Lanes& want) {
    c.record(std::vector<float>(got.begin(), got.end()));
    for (int i = 0; i < simd::kLanes && ok; ++i)
      if (!same_float(got[i], want[i])) {
        std::printf("  %s: lane %d is %.9g (0x%08x), the spec's %.9g (0x%08x)\n", what.c_str(), i, got[i],
                    std::bit_cast<uint32_t>(got[i]), want[i], std::bit_cast<uint32_t>(want[i]));
        ok = false;
      }
  }
  ~LaneCheck() { c.expect(ok, what + ": not the spec's bits (simd.h)"); }
};

void check_layer(Checks& c, Random& rng) {
  constexpr int trials = 64;
  using namespace simd;
  {
    LaneCheck add_{c, "add"}, sub_{c, "sub"}, mul_{c, "mul"}, div_{c, "div"}, fma_{c, "fmadd"}, fnma_{c, "fnmadd"},
        abs_{c, "abs"}, select_{c, "less_select"};  // (max: only AVX-512 has it, and no kernel uses it)
    for (int t = 0; t < trials; ++t) {
      const Lanes a = wide_lanes(rng, 20), b = wide_lanes(rng, 20), d = wide_lanes(rng, 40);
      const Vec va = load(a.data()), vb = load(b.data()), vd = load(d.data());
      Lanes want;
      for (int i = 0; i < kLanes; ++i) want[i] = a[i] + b[i];
      add_(lanes_of(simd::add(va, vb)), want);
      for (int i = 0; i < kLanes; ++i) want[i] = a[i] - b[i];
      sub_(lanes_of(simd::sub(va, vb)), want);
      for (int i = 0; i < kLanes; ++i) want[i] = a[i] * b[i];
      mul_(lanes_of(simd::mul(va, vb)), want);
      for (int i = 0; i < kLanes; ++i) want[i] = a[i] / b[i];
      div_(lanes_of(simd::div(va, vb)), want);
      for (int i = 0; i < kLanes; ++i) want[i] = std::fma(a[i], b[i], d[i]);
      fma_(lanes_of(simd::fmadd(va, vb, vd)), want);
      for (int i = 0; i < kLanes; ++i) want[i] = std::fma(-a[i], b[i], d[i]);
      fnma_(lanes_of(simd::fnmadd(va, vb, vd)), want);
      for (int i = 0; i < kLanes; ++i) want[i] = std::fabs(a[i]);
      abs_(lanes_of(simd::abs(va)), want);
      for (int i = 0; i < kLanes; ++i) want[i] = a[i] < b[i] ? d[i] : b[i];
      select_(lanes_of(less_select(va, vb, vd, vb)), want);
    }
  }
  {
    LaneCheck round_{c, "round_even"};
    Lanes ties;  // halfway cases both ways, then a spread
    for (int i = 0; i < kLanes; ++i) ties[i] = static_cast<float>(i - 8) + 0.5f;
    Lanes want;
    for (int i = 0; i < kLanes; ++i) {  // the even neighbour, with the input's sign (-0.5 gives -0)
      const int below = i - 8;
      want[i] = std::copysign(static_cast<float>(below % 2 == 0 ? below : below + 1), ties[i]);
    }
    round_(lanes_of(round_even(load(ties.data()))), want);
    for (int t = 0; t < trials; ++t) {
      const Lanes a = wide_lanes(rng, 10);
      for (int i = 0; i < kLanes; ++i) want[i] = std::nearbyint(a[i]);
      round_(lanes_of(round_even(load(a.data()))), want);
    }
  }
  {
    LaneCheck pow2_{c, "times_pow2"};  // p in [0.5, 2), n in -126..126: some products subnormal
    for (int t = 0; t < trials; ++t) {
      Lanes p, n, want;
      for (int i = 0; i < kLanes; ++i) {
        p[i] = 0.5f + 1.5f * rng.uniform();
        n[i] = static_cast<float>(t < 8 ? -126 + rng.below(4) : rng.below(253) - 126);
        want[i] = std::ldexp(p[i], static_cast<int>(n[i]));
      }
      pow2_(lanes_of(times_pow2(load(p.data()), load(n.data()))), want);
    }
  }
  {
    LaneCheck reduce_{c, "reduce_add"}, sum_{c, "sum16"};
    for (int t = 0; t < trials; ++t) {
      Lanes a[kLanes], got, want;
      Vec v[kLanes];
      for (int j = 0; j < kLanes; ++j) {
        a[j] = wide_lanes(rng, 12);
        v[j] = load(a[j].data());
        got[j] = reduce_add(v[j]);
        want[j] = spec_reduce_add(a[j]);
      }
      reduce_(got, want);
      for (int j = 0; j < kLanes; ++j) want[j] = spec_sum(a[j]);
      sum_(lanes_of(sum16(v)), want);
    }
  }
  {
    // Partial loads read `left` lanes and zero the rest; partial stores write `left` lanes and nothing past.
    LaneCheck loads_{c, "load (float32, bfloat16) of a part"}, stores_{c, "store (float32, bfloat16) of a part"};
    for (int left = 1; left <= kLanes; ++left) {
      const Lanes a = wide_lanes(rng, 10);
      std::array<uint16_t, kLanes> b;
      for (int i = 0; i < kLanes; ++i) b[i] = bfloat16_bits(a[i]);
      Lanes want, got;
      for (int i = 0; i < kLanes; ++i) want[i] = i < left ? a[i] : 0.0f;
      loads_(lanes_of(load(a.data(), left)), want);
      for (int i = 0; i < kLanes; ++i) want[i] = i < left ? bfloat16_value(b[i]) : 0.0f;
      loads_(lanes_of(load(b.data(), left)), want);
      got.fill(-7.0f);
      store(got.data(), load(a.data()), left);
      for (int i = 0; i < kLanes; ++i) want[i] = i < left ? a[i] : -7.0f;
      stores_(got, want);
      std::array<uint16_t, kLanes> halves;
      halves.fill(0xABCD);
      store(halves.data(), load(a.data()), left);
      for (int i = 0; i < kLanes; ++i) {
        got[i] = static_cast<float>(halves[i]);
        want[i] = static_cast<float>(i < left ? b[i] : 0xABCD);
      }
      stores_(got, want);
    }
  }
  {
    // bfloat16 stores: round to nearest even (ties both ways), subnormals to signed zero, NaNs quiet,
    // the largest floats up to infinity.
    LaneCheck round_{c, "store to bfloat16"};
    const uint32_t special[] = {0x3F808000u, 0x3F818000u, 0xBF808000u, 0xBF818000u, 0x3F807FFFu, 0x3F808001u,
                                0x00000001u, 0x807FFFFFu, 0x00400000u, 0x00800000u, 0x80800000u, 0x7F7FFFFFu,
                                0xFF7FFFFFu, 0x7F7F7FFFu, 0x7F800000u, 0xFF800000u, 0x7FC00000u, 0x7F800001u,
                                0xFF812345u, 0x00000000u, 0x80000000u, 0x3F800000u, 0x477FFFFFu, 0x33800000u};
    std::vector<float> values;
    for (uint32_t u : special) values.push_back(std::bit_cast<float>(u));
    while (values.size() < 8 * kLanes) values.push_back(wide(rng, 40));
    for (size_t i = 0; i < values.size(); i += kLanes) {
      std::array<uint16_t, kLanes> bits;
      store(bits.data(), load(values.data() + i));
      Lanes got, want;
      for (int j = 0; j < kLanes; ++j) {
        got[j] = static_cast<float>(bits[j]);
        want[j] = static_cast<float>(bfloat16_bits(values[i + j]));
      }
      round_(got, want);
    }
  }
  {
    // The linear's dot products: 32 outputs' pairs from bfloat16 and int8 (in int8_slot order) bytes, times a
    // broadcast pair, into an accumulator: acc + x1 w1, then + x0 w0, each fused. Magnitudes stay within
    // 2^+-20 (no subnormals, which VDPBF16PS would flush). int4: two int16 pairs times two runs of nibbles,
    // summed exactly in int32.
    LaneCheck bf16_{c, "dot of bfloat16 pairs"}, int8_{c, "dot of int8 pairs"}, int4_{c, "dot of int4 pairs"};
    const Int8Pairs widen;
    for (int t = 0; t < trials; ++t) {
      std::array<uint16_t, 2> x = {bfloat16_bits(wide(rng, 10)), bfloat16_bits(wide(rng, 10))};
      const float x0 = bfloat16_value(x[0]), x1 = bfloat16_value(x[1]);
      Lanes acc[2] = {wide_lanes(rng, 10), wide_lanes(rng, 10)};
      std::array<uint16_t, 64> w;
      for (auto& b : w) b = bfloat16_bits(wide(rng, 10));
      std::array<int8_t, 64> q, slots;
      for (int o = 0; o < 32; ++o)
        for (int e = 0; e < 2; ++e) {
          q[2 * o + e] = static_cast<int8_t>(rng.below(255) - 127);
          slots[int8_slot(o, e)] = q[2 * o + e];
        }
      std::array<std::array<uint8_t, 32>, 2> nibbles;
      std::array<std::array<int16_t, 2>, 2> xi;
      for (int s = 0; s < 2; ++s) {
        for (auto& b : nibbles[s]) b = static_cast<uint8_t>(rng.below(256));
        for (auto& v : xi[s]) v = static_cast<int16_t>(static_cast<int>(rng.below(65281)) - 32640);
      }
      Pairs bf16_pairs[2], int8_pairs[2];
      bfloat16_pairs(w.data(), bf16_pairs);
      widen(slots.data(), int8_pairs);
      IVec sums[2] = {izero(), izero()};
      for (int s = 0; s < 2; ++s) {
        for (int j = 0; j < 2; ++j)
          sums[j] = idot(sums[j], broadcast_ipair(xi[s].data()), int4_ipairs(nibbles[s].data(), j));
      }
      const XPair xv = broadcast_pair(x.data());
      for (int j = 0; j < 2; ++j) {
        const Vec a = load(acc[j].data());
        Lanes want;
        for (int i = 0; i < kLanes; ++i) {
          const int o = 16 * j + i;
          want[i] = std::fma(x0, bfloat16_value(w[2 * o]), std::fma(x1, bfloat16_value(w[2 * o + 1]), acc[j][i]));
        }
        bf16_(lanes_of(dot(a, xv, bf16_pairs[j])), want);
        for (int i = 0; i < kLanes; ++i) {
          const int o = 16 * j + i;
          want[i] = std::fma(x0, static_cast<float>(q[2 * o]), std::fma(x1, static_cast<float>(q[2 * o + 1]), acc[j][i]));
        }
        int8_(lanes_of(dot(a, xv, int8_pairs[j])), want);
        for (int i = 0; i < kLanes; ++i) {  // output 16 j + i: byte 2 i + e, low nibble for j = 0, high for 1
          int32_t sum = 0;
          for (int s = 0; s < 2; ++s)
            for (int e = 0; e < 2; ++e) sum += xi[s][e] * ((nibbles[s][2 * i + e] >> (4 * j)) & 15);
          want[i] = static_cast<float>(sum);
        }
        int4_(lanes_of(to_float(sums[j])), want);
      }
    }
  }
}

// ---- linear ------------------------------------------------------------------------------------------------

// y (rows, n) = x (rows, k) W^T (+ b) for one packed weight.
using Linear = std::function<void(const uint16_t* x, int64_t rows, uint16_t* y)>;

// One packed weight (its float64 values w, (n, k)) over batches of 1..7 and 16 rows: close to the reference,
// and every row (and the batch less its first row) the same bits as computed inside the batch. `size` (n, k)
// bounds the magnitude of each weight as the kernel multiplies it; `seen` gives a row's inputs as the kernel
// multiplies them (int4: as int16 per group), by default the bfloat16 values.
// Odd rows add +-kBig at inputs 0 and 2, whose weights are equal: the two terms cancel, but only after the
// kernel's even and odd sums have each carried one of them, so these rows' outputs show the order and the
// roundings of the float32 accumulation (which the bfloat16 rounding of well-conditioned outputs hides), and
// any two backends that sum differently give different bits.
constexpr float kBig = 4096.0f;

using Seen = std::function<std::vector<double>(const uint16_t* row, int64_t k)>;

std::vector<double> bfloat16_inputs(const uint16_t* row, int64_t k) {
  std::vector<double> out(k);
  for (int64_t i = 0; i < k; ++i) out[i] = value(row[i]);
  return out;
}

void check_linear(Checks& c, Random& rng, const char* form, int64_t n, int64_t k, const std::vector<double>& w,
                  const std::vector<double>& size, const float* bias, const Linear& linear,
                  const Seen& seen = bfloat16_inputs) {
  for (int64_t rows : {1, 2, 3, 4, 5, 6, 7, 16}) {
    const std::string what = name(form, n, k, rows);
    std::vector<uint16_t> x = bf16_normal(rng, rows * k, 1.0f);
    for (int64_t r = 1; r < rows; r += 2) {
      x[r * k] = simd::bfloat16_bits(kBig);
      x[r * k + 2] = simd::bfloat16_bits(-kBig);
    }
    std::vector<uint16_t> y(rows * n);
    linear(x.data(), rows, y.data());
    c.record(y);
    // float64 reference; the allowance for float32 accumulation: a few k ulp of sum |x| |w|
    std::vector<double> ref(rows * n), slack(rows * n);
    for (int64_t r = 0; r < rows; ++r) {
      const std::vector<double> inputs = seen(x.data() + r * k, k);
      for (int64_t o = 0; o < n; ++o) {
        double sum = bias ? bias[o] : 0.0, magnitude = 0.0;
        for (int64_t i = 0; i < k; ++i) {
          sum += inputs[i] * w[o * k + i];
          magnitude += std::fabs(inputs[i]) * size[o * k + i];
        }
        ref[r * n + o] = sum;
        slack[r * n + o] = 4.0 * static_cast<double>(k) * 0x1p-24 * magnitude;
      }
    }
    const double err = error(y.data(), ref, slack);
    c.expect(err < 1e-2, what + ": relative error " + std::to_string(err) + " from float64");
    bool alone = true;
    std::vector<uint16_t> one(n);
    for (int64_t r = 0; r < rows; ++r) {
      linear(x.data() + r * k, 1, one.data());
      alone = alone && same_bits(one.data(), y.data() + r * n, n);
    }
    c.expect(alone, what + ": a row alone differs from the same row in the batch");
    if (rows > 2) {  // the rows fall into other tiles: the same bits
      std::vector<uint16_t> rest((rows - 1) * n);
      linear(x.data() + k, rows - 1, rest.data());
      c.expect(same_bits(rest.data(), y.data() + n, rest.size()), what + ": rows 1.. as a batch differ");
    }
  }
}

std::vector<double> magnitudes(const std::vector<double>& w) {
  std::vector<double> out(w.size());
  for (size_t i = 0; i < w.size(); ++i) out[i] = std::fabs(w[i]);
  return out;
}

int64_t blocks_of(int64_t n) { return (n + simd::kBlock - 1) / simd::kBlock; }

// An (n, k) bfloat16 or int8 weight packed, checked to unpack to itself.
template <typename T>
std::vector<T> packed_checked(Checks& c, const std::vector<T>& weight, int64_t n, int64_t k, const char* form) {
  std::vector<T> packed(blocks_of(n) * simd::kBlock * k), back(n * k);
  simd::pack_dense(weight.data(), n, k, packed.data());
  simd::unpack_dense(packed.data(), n, k, back.data());
  c.expect(back == weight, std::string(form) + " " + name("pack", n, k) + ": unpacking does not give the weight back");
  return packed;
}

void check_bfloat16_linear(Checks& c, Random& rng, int64_t n, int64_t k, bool with_bias) {
  std::vector<uint16_t> weight = bf16_normal(rng, n * k, 0.1f);
  for (int64_t o = 0; o < n; ++o) weight[o * k + 2] = weight[o * k];  // see kBig
  const std::vector<float> bias = float_normal(rng, n, 0.5f);
  const std::vector<uint16_t> packed = packed_checked(c, weight, n, k, "bfloat16");
  std::vector<double> w(n * k);
  for (int64_t i = 0; i < n * k; ++i) w[i] = value(weight[i]);
  const float* b = with_bias ? bias.data() : nullptr;
  check_linear(c, rng, "bfloat16", n, k, w, magnitudes(w), b, [&](const uint16_t* x, int64_t rows, uint16_t* y) {
    simd::dense_rows(simd::Bfloat16Loader{}, x, packed.data(), rows, n, blocks_of(n), k / 2, nullptr, b, y);
  });
}

void check_int8_linear(Checks& c, Random& rng, int64_t n, int64_t k, bool with_bias) {
  std::vector<int8_t> q(n * k);
  for (auto& v : q) v = static_cast<int8_t>(rng.below(255) - 127);  // -127..127, as pack accepts
  for (int64_t o = 0; o < n; ++o) q[o * k + 2] = q[o * k];           // see kBig
  std::vector<float> scales(n);
  for (auto& s : scales) s = (0.5f + rng.uniform()) * (0.1f / 127.0f);
  const std::vector<float> bias = float_normal(rng, n, 0.5f);
  const std::vector<int8_t> packed = packed_checked(c, q, n, k, "int8");
  std::vector<double> w(n * k);
  for (int64_t o = 0; o < n; ++o)
    for (int64_t i = 0; i < k; ++i) w[o * k + i] = static_cast<double>(q[o * k + i]) * scales[o];
  const float* b = with_bias ? bias.data() : nullptr;
  const simd::Int8Loader loader{};
  check_linear(c, rng, "int8", n, k, w, magnitudes(w), b, [&](const uint16_t* x, int64_t rows, uint16_t* y) {
    simd::dense_rows(loader, x, packed.data(), rows, n, blocks_of(n), k / 2, scales.data(), b, y);
  });
}

void check_int4_linear(Checks& c, Random& rng, int64_t n, int64_t k, bool with_bias) {
  const int64_t groups = k / simd::kGroup, blocks = blocks_of(n);
  std::vector<uint8_t> q(n * k);
  for (auto& v : q) v = static_cast<uint8_t>(rng.below(16));
  for (int64_t o = 0; o < n; ++o) q[o * k + 2] = q[o * k];  // see kBig
  std::vector<uint16_t> sz(n * groups * 2);  // (n, groups, 2): float16 scale (2^-8..2^-5) and minimum (+-2^-7..2^-4)
  for (int64_t i = 0; i < n * groups; ++i) {
    sz[2 * i] = static_cast<uint16_t>((7 + rng.below(3)) << 10 | rng.below(1024));
    sz[2 * i + 1] = static_cast<uint16_t>(rng.below(2) << 15 | (8 + rng.below(3)) << 10 | rng.below(1024));
  }
  const std::vector<float> bias = float_normal(rng, n, 0.5f);
  std::vector<uint8_t> packed(blocks * simd::kBlock * k / 2), back(n * k);
  std::vector<uint16_t> sz_packed(blocks * groups * 2 * simd::kBlock);
  simd::pack_int4(q.data(), sz.data(), n, k, packed.data(), sz_packed.data());
  simd::unpack_int4(packed.data(), n, k, back.data());
  c.expect(back == q, name("int4 pack", n, k) + ": unpacking does not give the nibbles back");
  std::vector<double> w(n * k), size(n * k);
  for (int64_t o = 0; o < n; ++o)
    for (int64_t i = 0; i < k; ++i) {
      const uint16_t* g = sz.data() + (o * groups + i / simd::kGroup) * 2;
      const double scale = simd::half_value(g[0]), minimum = simd::half_value(g[1]);
      w[o * k + i] = static_cast<double>(q[o * k + i]) * scale + minimum;
      size[o * k + i] = q[o * k + i] * scale + std::fabs(minimum);
    }
  const float* b = with_bias ? bias.data() : nullptr;
  const auto linear = [&](const uint16_t* x, int64_t rows, uint16_t* y) {
    simd::int4_rows(simd::int16_inputs(x, rows, k), packed.data(), sz_packed.data(), rows, n, blocks, k / 2, b, y);
  };
  const auto as_int16 = [](const uint16_t* row, int64_t width) {  // the inputs the kernel multiplies, exactly
    const simd::Int16Inputs in = simd::int16_inputs(row, 1, width);
    std::vector<double> out(width);
    for (int64_t i = 0; i < width; ++i) out[i] = in.values[i] * static_cast<double>(in.units[i / simd::kGroup]);
    return out;
  };
  check_linear(c, rng, "int4", n, k, w, size, b, linear, as_int16);
}

// ---- attention ---------------------------------------------------------------------------------------------

// Queries (heads, n, dim), a padded cache (kv_heads heads of `length` keys, key_stride apart), a mask with a
// causal block over the last n keys, a masked window edge, a few scattered -inf and some finite entries.
void check_attention(Checks& c, Random& rng, int64_t heads, int64_t kv_heads, int64_t dim, int64_t n, int64_t length) {
  const std::string what = "attention " + std::to_string(heads) + "/" + std::to_string(kv_heads) + " heads of " +
                           std::to_string(dim) + ", " + std::to_string(n) + " rows over " + std::to_string(length);
  const int64_t key_stride = dim + 16, head_stride = (length + 3) * key_stride, mask_row = length + 5;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  const std::vector<float> q = float_normal(rng, heads * n * dim, 1.0f);
  const std::vector<float> k = float_normal(rng, kv_heads * head_stride, 1.0f);
  const std::vector<float> v = float_normal(rng, kv_heads * head_stride, 1.0f);
  std::vector<float> mask(n * mask_row, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t own = length - n + i;  // the row's own key: always visible
    for (int64_t j = own + 1; j < length; ++j) mask[i * mask_row + j] = -INFINITY;
    for (int64_t j = 0; j < own; ++j) {
      const int pick = rng.below(10);
      if (pick == 0) mask[i * mask_row + j] = -INFINITY;
      if (pick == 1) mask[i * mask_row + j] = -1.5f;
    }
  }
  for (int64_t j = 0; j < 3; ++j) mask[j] = -INFINITY;  // row 0's window edge
  std::vector<float> out(n * heads * dim);
  simd::attend_rows(q.data(), k.data(), v.data(), head_stride, key_stride, heads, kv_heads, n, length, dim, mask.data(),
                    mask_row, scale, out.data());
  c.record(out);

  std::vector<double> ref(out.size()), p(length);
  const int64_t group = heads / kv_heads;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < n; ++i) {
      const float* qi = q.data() + (h * n + i) * dim;
      const float* kh = k.data() + h / group * head_stride;
      const float* vh = v.data() + h / group * head_stride;
      double top = -INFINITY, total = 0;
      for (int64_t j = 0; j < length; ++j) {
        double dot = 0;
        for (int64_t d = 0; d < dim; ++d) dot += static_cast<double>(qi[d]) * kh[j * key_stride + d];
        p[j] = dot * scale + mask[i * mask_row + j];
        top = std::max(top, p[j]);
      }
      for (int64_t j = 0; j < length; ++j) total += p[j] = std::exp(p[j] - top);
      for (int64_t d = 0; d < dim; ++d) {
        double sum = 0;
        for (int64_t j = 0; j < length; ++j) sum += p[j] * vh[j * key_stride + d];
        ref[i * heads * dim + h * dim + d] = sum / total;
      }
    }
  const double err = error(out.data(), ref);
  c.expect(err < 1e-4, what + ": relative error " + std::to_string(err) + " from float64");

  // Each query row alone (its queries of every head, its mask row) gives the bits it got among the others.
  bool alone = true;
  std::vector<float> qi(heads * dim), one(heads * dim);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h = 0; h < heads; ++h) std::memcpy(qi.data() + h * dim, q.data() + (h * n + i) * dim, dim * sizeof(float));
    simd::attend_rows(qi.data(), k.data(), v.data(), head_stride, key_stride, heads, kv_heads, 1, length, dim,
                      mask.data() + i * mask_row, mask_row, scale, one.data());
    alone = alone && same_bits(one.data(), out.data() + i * heads * dim, one.size());
  }
  c.expect(alone, what + ": a query row alone differs from the same row among the others");

  // Row 0 sees no key past its own: over the cache cut after that key it gets the same bits (masked keys
  // add exact zeros), as a tree's node does once its ancestors are committed.
  for (int64_t h = 0; h < heads; ++h) std::memcpy(qi.data() + h * dim, q.data() + h * n * dim, dim * sizeof(float));
  simd::attend_rows(qi.data(), k.data(), v.data(), head_stride, key_stride, heads, kv_heads, 1, length - n + 1, dim,
                    mask.data(), mask_row, scale, one.data());
  c.expect(same_bits(one.data(), out.data(), one.size()), what + ": row 0 over the cut cache differs");
}

// ---- rows.h ------------------------------------------------------------------------------------------------

template <typename In, typename Out>
void check_norm(Checks& c, Random& rng, int64_t size, bool with_weight, const char* what) {
  const float eps = 1e-5f;
  std::vector<In> x(size);
  for (auto& e : x) {
    const float f = wide(rng, 6);  // squares over 24 binades: their sum rounds, so its order shows
    if constexpr (std::is_same_v<In, uint16_t>) e = simd::bfloat16_bits(f); else e = f;
  }
  const std::vector<float> w = float_normal(rng, size, 1.0f);
  std::vector<Out> y(size);
  simd::norm_row(x.data(), size, with_weight ? w.data() : nullptr, eps, y.data());
  c.record(y);
  const std::string label = std::string("norm_row ") + what + " of " + std::to_string(size) + (with_weight ? "" : " without weights");
  if (!with_weight) {  // the row as it is, rounded on store
    bool same = true;
    for (int64_t i = 0; i < size; ++i) {
      const float f = static_cast<float>(value(x[i]));
      if constexpr (std::is_same_v<Out, uint16_t>) same = same && y[i] == simd::bfloat16_bits(f); else same = same && y[i] == f;
    }
    c.expect(same, label + ": not the input");
    return;
  }
  const double inv = reference_inverse_rms(x.data(), size, eps);
  std::vector<double> ref(size);
  for (int64_t i = 0; i < size; ++i) ref[i] = value(x[i]) * inv * w[i];
  const double err = error(y.data(), ref), tolerance = std::is_same_v<Out, uint16_t> ? 1e-2 : 1e-5;
  c.expect(err < tolerance, label + ": relative error " + std::to_string(err) + " from float64");
}

void check_rotate(Checks& c, Random& rng, int64_t dim) {
  const std::vector<float> x = float_normal(rng, dim, 1.0f), cos = float_normal(rng, dim, 0.7f), sin = float_normal(rng, dim, 0.7f);
  std::vector<float> y = x;
  simd::rotate(y.data(), cos.data(), sin.data(), dim);
  c.record(y);
  const int64_t half = dim / 2;
  std::vector<double> ref(dim);
  for (int64_t i = 0; i < dim; ++i)
    ref[i] = static_cast<double>(x[i]) * cos[i] + static_cast<double>(x[i < half ? i + half : i - half]) * sin[i];
  const double err = error(y.data(), ref);
  c.expect(err < 1e-5, "rotate " + std::to_string(dim) + ": relative error " + std::to_string(err) + " from float64");
}

double silu(double x) { return x / (1.0 + std::exp(-x)); }
double gelu(double x) { return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }

// Inputs for the activations: exact zeros, tiny and huge magnitudes of both signs, then a spread.
std::vector<float> activation_inputs(Random& rng) {
  std::vector<float> x = {0.0f, -0.0f, 1e-8f, -1e-8f, 0.5f, -0.5f, 1.0f, -1.0f, 3.0f, -3.0f, 5.0f, -5.0f,
                          10.0f, -10.0f, 20.0f, -20.0f, 50.0f, -50.0f, 87.5f, -87.5f, 100.0f, -100.0f, 1e4f, -1e4f};
  while (x.size() < 128) x.push_back(rng.normal() * 4.0f);
  return x;
}

void check_activate(Checks& c, Random& rng, bool use_gelu) {
  const std::vector<float> x = activation_inputs(rng);
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); i += simd::kLanes)
    simd::store(y.data() + i, simd::activate(simd::load(x.data() + i), use_gelu));
  c.record(y);
  const char* what = use_gelu ? "activate gelu" : "activate silu";
  bool close = true;
  for (size_t i = 0; i < x.size(); ++i) {
    const double ref = use_gelu ? gelu(x[i]) : silu(x[i]), err = std::fabs(y[i] - ref);
    // float32 rounding, plus tanh's or the sigmoid's absolute error near +-1 scaled by |x|
    const bool ok = std::isfinite(y[i]) && err <= 1e-5 * std::fabs(ref) + 1e-6 * std::fabs(x[i]);
    if (!ok) std::printf("  %s(%.9g) = %.9g, float64 %.9g\n", what, x[i], y[i], ref);
    close = close && ok;
  }
  c.expect(close, std::string(what) + ": not within float32 accuracy of float64");
  c.expect(y[0] == 0.0f && y[1] == 0.0f, std::string(what) + "(0) is not 0");
}

void check_gated(Checks& c, Random& rng, int64_t size, bool use_gelu) {
  const std::vector<uint16_t> gate = bf16_normal(rng, size, 2.0f), up = bf16_normal(rng, size, 1.0f);
  std::vector<uint16_t> out(size);
  simd::gated_row(gate.data(), up.data(), size, use_gelu, out.data());
  c.record(out);
  std::vector<double> ref(size);
  for (int64_t i = 0; i < size; ++i) ref[i] = (use_gelu ? gelu(value(gate[i])) : silu(value(gate[i]))) * value(up[i]);
  const double err = error(out.data(), ref);
  c.expect(err < 1e-2, std::string("gated_row ") + (use_gelu ? "gelu " : "silu ") + std::to_string(size) +
                           ": relative error " + std::to_string(err) + " from float64");
}

void check_add(Checks& c, Random& rng, int64_t size, bool with_weight) {
  const float eps = 1e-6f;
  const std::vector<uint16_t> x = bf16_normal(rng, size, 1.0f), a = bf16_normal(rng, size, 3.0f);
  const std::vector<float> w = float_normal(rng, size, 0.5f);
  std::vector<uint16_t> y = x;
  simd::add_row(y.data(), a.data(), size, with_weight ? w.data() : nullptr, eps);
  c.record(y);
  const std::string what = "add_row " + std::to_string(size) + (with_weight ? " normed" : "");
  if (!with_weight) {  // one float32 addition, rounded once
    bool same = true;
    for (int64_t i = 0; i < size; ++i) same = same && y[i] == simd::bfloat16_bits(bf16(x[i]) + bf16(a[i]));
    c.expect(same, what + ": not bf16(x + a)");
    return;
  }
  const double inv = reference_inverse_rms(a.data(), size, eps);
  std::vector<double> ref(size);
  for (int64_t i = 0; i < size; ++i) ref[i] = value(x[i]) + value(a[i]) * inv * w[i];
  const double err = error(y.data(), ref);
  c.expect(err < 1e-2, what + ": relative error " + std::to_string(err) + " from float64");
}

void check_exp(Checks& c, Random& rng) {
  std::vector<float> x = {0.0f, -0.0f, -1e-8f, -1e-30f, -0.5f, -0.693359375f, -1.0f, -2.5f, -10.0f, -50.0f,
                          -86.9f, -87.0f, -87.33f, -87.5f, -100.0f, -1e30f, -INFINITY};
  while (x.size() < 256) x.push_back(-90.0f * rng.uniform());
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); i += simd::kLanes)
    simd::store(y.data() + i, simd::exp_nonpositive(simd::load(x.data() + i)));
  c.record(y);
  bool close = true;
  for (size_t i = 0; i < x.size(); ++i) {
    // below -87 (and -inf): exactly 0; elsewhere within a few float32 ulp of exp
    const double ref = x[i] < -87.0f ? 0.0 : std::exp(static_cast<double>(x[i]));
    const bool ok = x[i] < -87.0f ? y[i] == 0.0f : std::fabs(y[i] - ref) <= 5e-7 * ref;
    if (!ok) std::printf("  exp_nonpositive(%.9g) = %.9g, float64 %.9g\n", x[i], y[i], ref);
    close = close && ok;
  }
  c.expect(close, "exp_nonpositive: not within a few ulp of exp, or not 0 below -87");
  c.expect(y[0] == 1.0f && y[1] == 1.0f, "exp_nonpositive(0) is not exactly 1");
}

}  // namespace

int main(int argc, char** argv) {
  const char* dump = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--dump") == 0 && i + 1 < argc) {
      dump = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--dump PATH]\n", argv[0]);
      return 2;
    }
  }
  Checks c;
  Random rng{0x5EED5EED5EEDull};
  check_layer(c, rng);
  // A ragged last block and an odd pair count; whole blocks; fewer outputs than one block.
  for (const auto& [n, k, bias] : {std::tuple{100, 130, true}, std::tuple{64, 96, false}, std::tuple{7, 38, true}}) {
    check_bfloat16_linear(c, rng, n, k, bias);
    check_int8_linear(c, rng, n, k, bias);
    check_int8_linear(c, rng, n, k, !bias);
  }
  for (const auto& [n, k, bias] : {std::tuple{96, 64, false}, std::tuple{70, 128, true}}) check_int4_linear(c, rng, n, k, bias);
  check_attention(c, rng, 8, 2, 64, 5, 37);
  check_attention(c, rng, 8, 2, 128, 3, 53);
  check_attention(c, rng, 8, 2, 64, 1, 20);
  check_attention(c, rng, 4, 4, 64, 6, 70);
  check_norm<uint16_t, uint16_t>(c, rng, 100, true, "bfloat16 to bfloat16");
  check_norm<uint16_t, float>(c, rng, 64, true, "bfloat16 to float32");
  check_norm<uint16_t, float>(c, rng, 64, false, "bfloat16 to float32");
  check_norm<float, uint16_t>(c, rng, 130, true, "float32 to bfloat16");
  check_norm<float, uint16_t>(c, rng, 130, false, "float32 to bfloat16");
  check_rotate(c, rng, 64);
  check_rotate(c, rng, 128);
  check_activate(c, rng, false);
  check_activate(c, rng, true);
  check_gated(c, rng, 100, false);
  check_gated(c, rng, 100, true);
  check_add(c, rng, 100, true);
  check_add(c, rng, 100, false);
  check_exp(c, rng);

  if (dump) {
    std::FILE* f = std::fopen(dump, "wb");
    if (!f || std::fwrite(c.dump.data(), 1, c.dump.size(), f) != c.dump.size() || std::fclose(f) != 0) {
      std::printf("kernel_check: cannot write %s\n", dump);
      return 1;
    }
  }
  if (c.failed) {
    std::printf("kernel_check: %d of %d checks failed\n", c.failed, c.passed + c.failed);
    return 1;
  }
  std::printf("kernel_check: %d checks passed\n", c.passed);
  return 0;
}
