// y = x W^T (+ b) in bfloat16 for the few rows of a decoding step, at the speed of reading W once.
// W is bfloat16, or int8 with one scale per output (y = scale * x q^T + b).
//
// W is packed at load as (N/32, K/2, 32, 2): for each block of 32 outputs, each pair of inputs is one
// run of 32 pairs (128 bytes in bfloat16, 64 in int8), so a block is one contiguous stream and the
// hardware prefetcher sees a single sequential read. int8 pairs are widened to bfloat16 in registers
// (exactly: every int8 value is a bfloat16). AVX-512 BF16's dot-product instruction multiplies a
// broadcast input pair by the pairs of 16 outputs at once, so accumulators hold outputs directly (no
// horizontal sums). Up to 12 rows share each weight load. Every output is accumulated over the input pairs in the same order whatever the number
// of rows, the row's place in the batch or the thread count, so results are batch-invariant.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int kVectors = 2;                 // 16-output vectors per block
constexpr int kBlock = 16 * kVectors;       // outputs per block
constexpr int kRowTile = 12;                // rows per pass over a block (24 accumulators)

// 16 outputs' pairs of inputs as 32 bfloat16 values.
inline __m512bh load_pairs(const uint16_t* w) { return (__m512bh)_mm512_loadu_si512(w); }
inline __m512bh load_pairs(const int8_t* w) {
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
  const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16))));
  return _mm512_cvtne2ps_pbh(high, low);
}

template <int Rows, typename W>
void block(const W* w, const uint16_t* x, int64_t ldx, int64_t pairs, __m512* acc) {
  for (int i = 0; i < Rows * kVectors; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[kVectors];
    for (int j = 0; j < kVectors; ++j) wv[j] = load_pairs(w + (p * kVectors + j) * 32);
    for (int r = 0; r < Rows; ++r) {
      __m512bh xv = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * ldx + 2 * p));
      for (int j = 0; j < kVectors; ++j) acc[r * kVectors + j] = _mm512_dpbf16_ps(acc[r * kVectors + j], xv, wv[j]);
    }
  }
}

template <int Rows, typename W>
void rows_tile(const W* w, const uint16_t* x, int64_t ldx, int64_t pairs, __m512* acc, int rows) {
  if constexpr (Rows > 1) {
    if (rows < Rows) return rows_tile<Rows - 1>(w, x, ldx, pairs, acc, rows);
  }
  block<Rows>(w, x, ldx, pairs, acc);
}

// Every block of outputs for every row: y[r, col] = round_bf16(acc * scale[col] + bias[col]).
template <typename W>
void run(const uint16_t* xp, const W* wp, uint16_t* yp, const float* scales, const float* bp, int64_t rows,
         int64_t k, int64_t n, int64_t blocks, int64_t pairs) {
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    __m512 acc[kRowTile * kVectors];
    for (int64_t b = begin; b < end; ++b) {
      const W* w = wp + b * pairs * kBlock * 2;
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
        int tile = static_cast<int>(std::min<int64_t>(kRowTile, rows - r0));
        rows_tile<kRowTile>(w, xp + r0 * k, k, pairs, acc, tile);
        for (int r = 0; r < tile; ++r) {
          for (int j = 0; j < kVectors; ++j) {
            int64_t col = b * kBlock + j * 16;
            if (col >= n) break;
            auto mask = static_cast<__mmask16>(n - col >= 16 ? 0xFFFF : (1u << (n - col)) - 1);
            __m512 v = acc[r * kVectors + j];
            if (scales) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, scales + col));
            if (bp) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bp + col));
            _mm256_mask_storeu_epi16(yp + (r0 + r) * n + col, mask, (__m256i)_mm512_cvtneps_pbh(v));
          }
        }
      }
    }
  });
}

}  // namespace

torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == torch::kBFloat16 || weight.scalar_type() == torch::kChar),
              "pack: a 2-D bfloat16 or int8 weight");
  TORCH_CHECK(weight.size(1) % 2 == 0, "pack: the input width must be even");
  int64_t n = weight.size(0), k = weight.size(1), blocks = (n + kBlock - 1) / kBlock;
  auto padded = torch::zeros({blocks * kBlock, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({blocks, kBlock, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

void linear_rows(const uint16_t* x, int64_t rows, const torch::Tensor& packed, int64_t n, const float* bias,
                 const float* scales, uint16_t* y) {
  const int64_t blocks = packed.size(0), pairs = packed.size(1), k = 2 * pairs;
  if (packed.scalar_type() == torch::kChar)
    run(x, packed.data_ptr<int8_t>(), y, scales, bias, rows, k, n, blocks, pairs);
  else
    run(x, reinterpret_cast<const uint16_t*>(packed.data_ptr()), y, nullptr, bias, rows, k, n, blocks, pairs);
}

void check_linear(const torch::Tensor& packed, int64_t n, int64_t k, const c10::optional<torch::Tensor>& bias,
                  const c10::optional<torch::Tensor>& scales) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kBlock && packed.size(3) == 2 && packed.is_contiguous(),
              "linear: weight not packed");
  const bool int8 = packed.scalar_type() == torch::kChar;
  TORCH_CHECK(int8 || packed.scalar_type() == torch::kBFloat16, "linear: bfloat16 or int8 weights");
  TORCH_CHECK(int8 == scales.has_value(), "linear: int8 weights need scales, bfloat16 weights none");
  TORCH_CHECK(packed.size(1) * 2 == k && packed.size(0) * kBlock >= n, "linear: input width ", k, " does not match the weight");
  for (const auto* t : {&bias, &scales})
    TORCH_CHECK(!*t || ((*t)->scalar_type() == torch::kFloat && (*t)->is_contiguous() && (*t)->numel() == n),
                "linear: bias and scales must be float32 with one value per output");
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, const c10::optional<torch::Tensor>& bias,
                     const c10::optional<torch::Tensor>& scales) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "linear: contiguous bfloat16 input");
  const int64_t k = x.size(-1), rows = k ? x.numel() / k : 0;
  check_linear(packed, n, k, bias, scales);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = torch::empty(sizes, x.options());
  linear_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), rows, packed, n, bias ? bias->data_ptr<float>() : nullptr,
              scales ? scales->data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(y.data_ptr()));
  return y;
}
