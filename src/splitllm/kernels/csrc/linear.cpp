// The linear kernel (linear_core.h) for PyTorch tensors: packing at load, checks, and y = x W^T (+ b).
#include <ATen/ATen.h>

#include "kernels.h"
#include "linear_core.h"
#ifdef SPLITLLM_SIMD_AVX512
#include "tiles_amx.h"
#endif

using namespace simd;

bool tiles_available() {
#ifdef SPLITLLM_SIMD_AVX512
  return amx_usable();
#else
  return false;
#endif
}

namespace {

template <typename Loader>
void run_dense(const Loader& load, const uint16_t* x, const typename Loader::Weight* w, int64_t rows, int64_t n,
               int64_t blocks, int64_t pairs, const float* scales, const float* bias, uint16_t* y) {
#ifdef SPLITLLM_SIMD_AVX512
  if (pairs % kTilePairs == 0 && amx_usable())
    return run_tiles(DenseTiles<Loader>{load, w, pairs}, x, rows, n, blocks, pairs, scales, bias, y);
#endif
  dense_rows(load, x, w, rows, n, blocks, pairs, scales, bias, y);
}

void run_int4(const uint16_t* x, const uint8_t* w, const uint16_t* sz, int64_t rows, int64_t n, int64_t blocks,
              int64_t pairs, const float* bias, uint16_t* y) {
#ifdef SPLITLLM_SIMD_AVX512
  if (amx_usable()) {  // an int4 width is a multiple of 32: always whole tile steps
    const std::vector<float> sums = group_sums(x, rows, 2 * pairs);
    return run_tiles(Int4Tiles{w, sz, sums.data(), pairs, 2 * pairs / kGroup}, x, rows, n, blocks, pairs, nullptr, bias, y);
  }
#endif
  int4_rows(int16_inputs(x, rows, 2 * pairs), w, sz, rows, n, blocks, pairs, bias, y);
}

bool is_int4(const at::Tensor& packed) { return packed.scalar_type() == at::kByte; }

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

}  // namespace

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kChar),
              "pack: a 2-D bfloat16 or int8 weight");
  TORCH_CHECK(weight.size(1) % 2 == 0, "pack: the input width must be even");
  const int64_t n = weight.size(0), k = weight.size(1), blocks = (n + kBlock - 1) / kBlock;
  TORCH_CHECK(weight.scalar_type() != at::kChar || weight.numel() == 0 || weight.min().item<int>() > -128,
              "pack: int8 weights must lie in -127..127");
  const auto w = weight.contiguous();
  auto packed = at::empty({blocks, k / 2, kBlock, 2}, weight.options());
  if (weight.scalar_type() == at::kChar)
    pack_dense(w.data_ptr<int8_t>(), n, k, packed.data_ptr<int8_t>());
  else
    pack_dense(bits(w), n, k, reinterpret_cast<uint16_t*>(packed.data_ptr()));
  return packed;
}

std::tuple<at::Tensor, at::Tensor> pack_int4(const at::Tensor& q, const at::Tensor& scales_mins) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "pack_int4: a 2-D uint8 weight of values 0..15");
  const int64_t n = q.size(0), k = q.size(1), blocks = (n + kBlock - 1) / kBlock;
  TORCH_CHECK(k % kGroup == 0, "pack_int4: the input width must be a multiple of ", kGroup);
  TORCH_CHECK(q.numel() == 0 || q.max().item<int>() < 16, "pack_int4: values must lie in 0..15");
  TORCH_CHECK(scales_mins.sizes() == at::IntArrayRef({n, k / kGroup, 2}) && scales_mins.scalar_type() == at::kHalf,
              "pack_int4: float16 scales and minimums of shape (outputs, inputs / ", kGroup, ", 2)");
  const auto values = q.contiguous(), sz = scales_mins.contiguous();
  auto packed = at::empty({blocks, k / 2, kBlock}, q.options());
  auto sz_packed = at::empty({blocks, k / kGroup, 2, kBlock}, scales_mins.options());
  simd::pack_int4(values.data_ptr<uint8_t>(), bits(sz), n, k, packed.data_ptr<uint8_t>(),
                  reinterpret_cast<uint16_t*>(sz_packed.data_ptr()));
  return std::make_tuple(packed, sz_packed);
}

void linear_rows(const uint16_t* x, int64_t rows, const at::Tensor& packed, int64_t n, const float* bias,
                 const c10::optional<at::Tensor>& scales, uint16_t* y) {
  const int64_t blocks = packed.size(0), pairs = packed.size(1);
  if (is_int4(packed)) {
    run_int4(x, packed.data_ptr<uint8_t>(), bits(*scales), rows, n, blocks, pairs, bias, y);
  } else if (packed.scalar_type() == at::kChar) {
    static const Int8Loader int8{};
    run_dense(int8, x, packed.data_ptr<int8_t>(), rows, n, blocks, pairs, scales->data_ptr<float>(), bias, y);
  } else {
    run_dense(Bfloat16Loader{}, x, bits(packed), rows, n, blocks, pairs, nullptr, bias, y);
  }
}

void check_linear(const at::Tensor& packed, int64_t n, int64_t k, const c10::optional<at::Tensor>& bias,
                  const c10::optional<at::Tensor>& scales) {
  TORCH_CHECK(!bias || (is_cpu(*bias, at::kFloat) && bias->is_contiguous() && bias->numel() == n),
              "linear: the bias must be float32 with one value per output");
  TORCH_CHECK(packed.device().is_cpu() && packed.is_contiguous() && packed.dim() >= 2 && packed.size(1) * 2 == k &&
              n >= 0 && packed.size(0) * kBlock >= n,
              "linear: input width ", k, " and ", n, " outputs do not match the packed weight");
  if (is_int4(packed)) {
    TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlock && k % kGroup == 0, "linear: int4 weight not packed");
    TORCH_CHECK(scales && is_cpu(*scales, at::kHalf) && scales->is_contiguous() &&
                scales->sizes() == at::IntArrayRef({packed.size(0), k / kGroup, 2, kBlock}),
                "linear: int4 weights need packed float16 scales and minimums (pack_int4)");
    return;
  }
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kBlock && packed.size(3) == 2, "linear: weight not packed");
  const bool int8 = packed.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || packed.scalar_type() == at::kBFloat16, "linear: bfloat16, int8 or int4 weights");
  TORCH_CHECK(int8 == scales.has_value(), "linear: int8 weights need scales, bfloat16 weights none");
  TORCH_CHECK(!scales || (is_cpu(*scales, at::kFloat) && scales->is_contiguous() && scales->numel() == n),
              "linear: int8 scales must be float32 with one value per output");
}

at::Tensor unpack(const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& scales) {
  const int64_t blocks = packed.size(0), k = packed.size(1) * 2;
  check_linear(packed, n, k, c10::nullopt, scales);
  if (is_int4(packed)) {
    auto q = at::empty({n, k}, packed.options());
    unpack_int4(packed.data_ptr<uint8_t>(), n, k, q.data_ptr<uint8_t>());
    auto sz = scales->permute({0, 3, 1, 2}).reshape({blocks * kBlock, k / kGroup, 2}).narrow(0, 0, n).to(at::kFloat);
    auto groups = q.to(at::kFloat).view({n, k / kGroup, kGroup});
    return (groups * sz.narrow(2, 0, 1) + sz.narrow(2, 1, 1)).view({n, k}).to(at::kBFloat16);
  }
  auto dense = at::empty({n, k}, packed.options());
  if (packed.scalar_type() == at::kChar)
    unpack_dense(packed.data_ptr<int8_t>(), n, k, dense.data_ptr<int8_t>());
  else
    unpack_dense(bits(packed), n, k, reinterpret_cast<uint16_t*>(dense.data_ptr()));
  return scales ? (dense.to(at::kFloat) * scales->unsqueeze(1)).to(at::kBFloat16) : dense;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                     const c10::optional<at::Tensor>& scales) {
  TORCH_CHECK(is_cpu(x, at::kBFloat16) && x.is_contiguous() && x.dim() >= 1, "linear: a contiguous bfloat16 input on the CPU");
  const int64_t k = x.size(-1), rows = k ? x.numel() / k : 0;
  check_linear(packed, n, k, bias, scales);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = at::empty(sizes, x.options());
  linear_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), rows, packed, n, bias ? bias->data_ptr<float>() : nullptr,
              scales, reinterpret_cast<uint16_t*>(y.data_ptr()));
  return y;
}
