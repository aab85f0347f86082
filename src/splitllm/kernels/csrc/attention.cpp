// Attention of a few new query rows over a float32 KV cache, with an additive mask and grouped heads.
//
// PyTorch's CPU attention spends ~100 us per call on a one-row step over 512 keys, five times the
// arithmetic; this kernel reads each key and value once per tile of query rows that share its head.
// Every query row goes through the same sequence of operations whatever the other rows, and keys are
// summed in cache order where masked ones add exact zeros, so a row gets the same bits alone, inside
// a speculative tree, or after its ancestors were committed (sequential decoding).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr int kTile = 4;  // query rows per pass over a head's keys

struct Rows {
  const float* q[kTile];     // query vectors
  const float* mask[kTile];  // additive mask rows (nullptr: everything visible)
  float* out[kTile];
};

// The horizontal sums of 16 vectors as one vector (lane j: the sum of a[j]'s lanes), by a fixed tree of
// shuffles and adds: a third of the instructions of 16 separate reductions, and each sum's bits depend
// on its own vector only.
inline __m512 sum16(const __m512* a) {
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

// Scores, softmax and weighted values for `Count` query rows against one head's L keys (compile-time
// counts keep the accumulators in registers). Scores are computed 16 keys at a time.
template <int Count>
void attend(const Rows& rows, const float* k, const float* v, int64_t key_stride, int64_t length,
            int64_t dim, float scale, float* scores) {
  const int64_t chunks = dim / 16;
  __m512 dots[Count][16];
  for (int64_t j0 = 0; j0 < length; j0 += 16) {
    const int keys = static_cast<int>(std::min<int64_t>(16, length - j0));
    for (int jj = 0; jj < 16; ++jj) {
      __m512 acc[Count];
      for (int r = 0; r < Count; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t c = 0; jj < keys && c < chunks; ++c) {
        const __m512 kc = _mm512_loadu_ps(k + (j0 + jj) * key_stride + c * 16);
        for (int r = 0; r < Count; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(rows.q[r] + c * 16), kc, acc[r]);
      }
      for (int r = 0; r < Count; ++r) dots[r][jj] = acc[r];
    }
    const __mmask16 m = lanes(keys);
    for (int r = 0; r < Count; ++r) {
      __m512 s = _mm512_mul_ps(sum16(dots[r]), _mm512_set1_ps(scale));
      if (rows.mask[r]) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(m, rows.mask[r] + j0));
      _mm512_mask_storeu_ps(scores + r * length + j0, m, s);
    }
  }
  float inv[Count];
  for (int r = 0; r < Count; ++r) {
    float* s = scores + r * length;
    float top = -INFINITY;
    for (int64_t j = 0; j < length; ++j) top = std::max(top, s[j]);
    int64_t j = 0;
    for (; j + 16 <= length; j += 16)
      _mm512_storeu_ps(s + j, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(top))));
    if (j < length) {
      const auto tail = static_cast<__mmask16>((1u << (length - j)) - 1);
      _mm512_mask_storeu_ps(s + j, tail, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), _mm512_set1_ps(top))));
    }
    // Summed in key order, so masked keys (exact zeros) anywhere in the row leave the bits unchanged.
    float total = 0.0f;
    for (int64_t t = 0; t < length; ++t) total += s[t];
    inv[r] = 1.0f / total;
  }
  // Weighted values, 64 output lanes at a time: each value row is read once for all the tile's rows.
  for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
    constexpr int width = 4;
    __m512 o[Count][4];
    for (int r = 0; r < Count; ++r)
      for (int c = 0; c < 4; ++c) o[r][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < length; ++t) {
      __m512 vc[4];
      for (int c = 0; c < width; ++c) vc[c] = _mm512_loadu_ps(v + t * key_stride + (c0 + c) * 16);
      for (int r = 0; r < Count; ++r) {
        const __m512 p = _mm512_set1_ps(scores[r * length + t]);
        for (int c = 0; c < width; ++c) o[r][c] = _mm512_fmadd_ps(p, vc[c], o[r][c]);
      }
    }
    for (int r = 0; r < Count; ++r)
      for (int c = 0; c < width; ++c)
        _mm512_storeu_ps(rows.out[r] + (c0 + c) * 16, _mm512_mul_ps(o[r][c], _mm512_set1_ps(inv[r])));
  }
}

}  // namespace

void attention_rows(const float* qp, const float* kp, const float* vp, int64_t head_stride, int64_t key_stride,
                    int64_t heads, int64_t kv_heads, int64_t n, int64_t length, int64_t dim, const float* mp,
                    int64_t mask_row, float scale, float* op) {
  const int64_t group = heads / kv_heads;
  const int64_t per_head = (group * n + kTile - 1) / kTile;  // row tiles per key/value head
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, length * dim));  // tasks of >= 32K key values
  at::parallel_for(0, kv_heads * per_head, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kTile * length);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / per_head, first = (task % per_head) * kTile;
      const int count = static_cast<int>(std::min<int64_t>(kTile, group * n - first));
      Rows rows{};
      for (int r = 0; r < count; ++r) {
        const int64_t h = g * group + (first + r) / n, i = (first + r) % n;
        rows.q[r] = qp + (h * n + i) * dim;
        rows.mask[r] = mp ? mp + i * mask_row : nullptr;
        rows.out[r] = op + i * heads * dim + h * dim;
      }
      const float* kg = kp + g * head_stride;
      const float* vg = vp + g * head_stride;
      switch (count) {
        case 4: attend<4>(rows, kg, vg, key_stride, length, dim, scale, scores.data()); break;
        case 3: attend<3>(rows, kg, vg, key_stride, length, dim, scale, scores.data()); break;
        case 2: attend<2>(rows, kg, vg, key_stride, length, dim, scale, scores.data()); break;
        default: attend<1>(rows, kg, vg, key_stride, length, dim, scale, scores.data()); break;
      }
    }
  });
}

// q: (1, H, n, D); k, v: (1, KV, L, D) with unit stride along D; mask: additive (1, 1, n, L) or None.
// Returns (1, n, H * D) float32: the heads side by side, as the output projection takes them.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const c10::optional<torch::Tensor>& mask, double scale) {
  TORCH_CHECK(is_cpu(q, torch::kFloat) && is_cpu(k, torch::kFloat) && is_cpu(v, torch::kFloat),
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
  TORCH_CHECK(!mask || (is_cpu(*mask, torch::kFloat) && mask->dim() >= 2 && mask->numel() == n * length &&
                        mask->size(-2) == n && mask->size(-1) == length && mask->stride(-1) == 1),
              "attention: the mask must be float32 (n, length) = (", n, ", ", length, "), unit stride along keys");
  auto qc = q.contiguous();
  auto out = torch::empty({1, n, heads * dim}, q.options());
  attention_rows(qc.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), k.stride(1), k.stride(2), heads, kv_heads,
                 n, length, dim, mask ? mask->data_ptr<float>() : nullptr, mask ? mask->stride(-2) : 0,
                 static_cast<float>(scale), out.data_ptr<float>());
  return out;
}
