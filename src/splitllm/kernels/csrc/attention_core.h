// Attention of a few new query rows over a float32 KV cache, with an additive mask and grouped heads, stated
// once over simd.h's layer.
//
// PyTorch's CPU attention spends ~100 us per call on a one-row step over 512 keys, five times the
// arithmetic; this kernel reads each key and value once per tile of query rows that share its head.
// Every query row goes through the same sequence of operations whatever the other rows, and keys are
// summed in cache order where masked ones add exact zeros, so a row gets the same bits alone, inside
// a speculative tree, or after its ancestors were committed (sequential decoding).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace simd {

constexpr int kQueryTile = 4;  // query rows per pass over a head's keys

struct QueryRows {
  const float* q[kQueryTile];     // query vectors
  const float* mask[kQueryTile];  // additive mask rows (nullptr: everything visible)
  float* out[kQueryTile];
};

// Scores, softmax and weighted values for `Count` query rows against one head's L keys (compile-time counts
// keep the accumulators in registers). Scores are computed 16 keys at a time, each key's dot product in
// 16 lanes and the 16 keys' lanes summed by sum16.
template <int Count>
void attend(const QueryRows& rows, const float* k, const float* v, int64_t key_stride, int64_t length, int64_t dim,
            float scale, float* scores) {
  const int64_t chunks = dim / kLanes;
  Vec dots[Count][kLanes];
  for (int64_t j0 = 0; j0 < length; j0 += kLanes) {
    const int keys = static_cast<int>(std::min<int64_t>(kLanes, length - j0));
    for (int jj = 0; jj < kLanes; ++jj) {
      Vec acc[Count];
      for (int r = 0; r < Count; ++r) acc[r] = zero();
      for (int64_t c = 0; jj < keys && c < chunks; ++c) {
        const Vec kc = load(k + (j0 + jj) * key_stride + c * kLanes);
        for (int r = 0; r < Count; ++r) acc[r] = fmadd(load(rows.q[r] + c * kLanes), kc, acc[r]);
      }
      for (int r = 0; r < Count; ++r) dots[r][jj] = acc[r];
    }
    for (int r = 0; r < Count; ++r) {
      Vec s = mul(sum16(dots[r]), set1(scale));
      if (rows.mask[r]) s = add(s, load(rows.mask[r] + j0, keys));
      store(scores + r * length + j0, s, keys);
    }
  }
  float inv[Count];
  for (int r = 0; r < Count; ++r) {
    float* s = scores + r * length;
    float top = -INFINITY;
    for (int64_t j = 0; j < length; ++j) top = std::max(top, s[j]);
    for (int64_t j = 0; j < length; j += kLanes) store(s + j, exp_nonpositive(sub(load(s + j, length - j), set1(top))), length - j);
    // Summed in key order, so masked keys (exact zeros) anywhere in the row leave the bits unchanged.
    float total = 0.0f;
    for (int64_t t = 0; t < length; ++t) total += s[t];
    inv[r] = 1.0f / total;
  }
  // Weighted values, 64 output lanes at a time: each value row is read once for all the tile's rows.
  constexpr int width = 4;
  for (int64_t c0 = 0; c0 < chunks; c0 += width) {
    Vec o[Count][width];
    for (int r = 0; r < Count; ++r)
      for (int c = 0; c < width; ++c) o[r][c] = zero();
    for (int64_t t = 0; t < length; ++t) {
      Vec vc[width];
      for (int c = 0; c < width; ++c) vc[c] = load(v + t * key_stride + (c0 + c) * kLanes);
      for (int r = 0; r < Count; ++r) {
        const Vec p = set1(scores[r * length + t]);
        for (int c = 0; c < width; ++c) o[r][c] = fmadd(p, vc[c], o[r][c]);
      }
    }
    for (int r = 0; r < Count; ++r)
      for (int c = 0; c < width; ++c) store(rows.out[r] + (c0 + c) * kLanes, mul(o[r][c], set1(inv[r])));
  }
}

// On raw pointers, shapes already checked (dim a multiple of 64): queries (heads, n, dim) contiguous; one
// head's keys and values at k + g * head_stride, key j at + j * key_stride; additive mask rows (n, length)
// `mask_row` apart, or none. Writes (n, heads * dim).
inline void attend_rows(const float* qp, const float* kp, const float* vp, int64_t head_stride, int64_t key_stride,
                        int64_t heads, int64_t kv_heads, int64_t n, int64_t length, int64_t dim, const float* mp,
                        int64_t mask_row, float scale, float* op) {
  const int64_t group = heads / kv_heads;
  const int64_t per_head = (group * n + kQueryTile - 1) / kQueryTile;  // row tiles per key/value head
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, length * dim));  // tasks of >= 32K key values
  parallel_for(0, kv_heads * per_head, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kQueryTile * length);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / per_head, first = (task % per_head) * kQueryTile;
      const int count = static_cast<int>(std::min<int64_t>(kQueryTile, group * n - first));
      QueryRows rows{};
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

}  // namespace simd
