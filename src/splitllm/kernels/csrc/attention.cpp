// The attention kernel (attention_core.h) for PyTorch tensors.
#include <ATen/ATen.h>

#include "attention_core.h"
#include "kernels.h"

void attention_rows(const float* qp, const float* kp, const float* vp, int64_t head_stride, int64_t key_stride,
                    int64_t heads, int64_t kv_heads, int64_t n, int64_t length, int64_t dim, const float* mp,
                    int64_t mask_row, float scale, float* op) {
  simd::attend_rows(qp, kp, vp, head_stride, key_stride, heads, kv_heads, n, length, dim, mp, mask_row, scale, op);
}

// q: (1, H, n, D); k, v: (1, KV, L, D) with unit stride along D; mask: additive (1, 1, n, L) or None.
// Returns (1, n, H * D) float32: the heads side by side, as the output projection takes them.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(is_cpu(q, at::kFloat) && is_cpu(k, at::kFloat) && is_cpu(v, at::kFloat),
              "attention: float32 queries, keys and values on the CPU");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == 1 && k.size(0) == 1 && v.size(0) == 1,
              "attention: queries (1, heads, n, head size), keys and values (1, kv heads, length, head size); got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const int64_t heads = q.size(1), n = q.size(2), dim = q.size(3), kv_heads = k.size(1), length = k.size(2);
  TORCH_CHECK(v.sizes() == k.sizes() && k.stride(1) == v.stride(1) && k.stride(2) == v.stride(2) && k.stride(3) == 1 &&
              v.stride(3) == 1, "attention: keys ", k.sizes(), " and values ", v.sizes(),
              " must have one shape and layout, unit stride along the head size");
  TORCH_CHECK(dim > 0 && dim % 64 == 0 && k.size(3) == dim, "attention: the head size (", dim, " for queries, ", k.size(3),
              " for keys) must be one positive multiple of 64");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "attention: ", heads, " query heads are not a multiple of ", kv_heads,
              " key/value heads");
  TORCH_CHECK(!mask || (is_cpu(*mask, at::kFloat) && mask->dim() >= 2 && mask->numel() == n * length &&
                        mask->size(-2) == n && mask->size(-1) == length && mask->stride(-1) == 1),
              "attention: the mask must be float32 (n, length) = (", n, ", ", length, "), unit stride along keys");
  auto qc = q.contiguous();
  auto out = at::empty({1, n, heads * dim}, q.options());
  attention_rows(qc.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), k.stride(1), k.stride(2), heads, kv_heads,
                 n, length, dim, mask ? mask->data_ptr<float>() : nullptr, mask ? mask->stride(-2) : 0,
                 static_cast<float>(scale), out.data_ptr<float>());
  return out;
}
