// A stage's whole step through its decoder layers in one call: norms, projections, rotary, cache
// writes, attention, activation and residuals, with no framework call between them.
//
// Layer by layer in PyTorch, a one-position step spends more time in its ~40 small calls per layer
// (each a dispatch, an allocation and a pass over a few KiB) than in reading the weights. Here the
// projections and attention are the kernels of linear.cpp and attention.cpp, and everything between
// them is a loop over one row at a time into buffers allocated once per step. Every row goes through
// the same operations in the same order whatever the other rows, so the step stays batch-invariant.
//
// The residual stream and the projections' inputs and outputs are bfloat16, as in PyTorch's bfloat16
// layers; norms, rotary, activation and attention compute in float32 and round once.
#include <ATen/ATen.h>
#include <cmath>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "rows.h"

using namespace simd;

namespace {

const float* data_or_null(const c10::optional<at::Tensor>& t) { return t ? t->data_ptr<float>() : nullptr; }

// Each row on its own, several rows per thread task: the row's bits never depend on the grouping.
template <typename F>
void each_row(int64_t rows, F&& f) {
  simd::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) f(r);
  });
}

// x[r] = bf16(x[r] + norm(add[r])), the residual update (no norm unless Gemma's sandwich norms).
void add_rows(uint16_t* x, const uint16_t* add, int64_t rows, int64_t size, const float* w, float eps) {
  each_row(rows, [&](int64_t r) { add_row(x + r * size, add + r * size, size, w, eps); });
}

}  // namespace

void Projection::operator()(const uint16_t* x, int64_t rows, uint16_t* y) const {
  linear_rows(x, rows, packed, outputs, data_or_null(bias), scales, y);
}

Projection::Projection(at::Tensor packed_, int64_t outputs_, c10::optional<at::Tensor> bias_,
                       c10::optional<at::Tensor> scales_)
    : packed(std::move(packed_)), outputs(outputs_), bias(std::move(bias_)), scales(std::move(scales_)) {
  inputs = packed.dim() >= 2 ? packed.size(1) * 2 : 0;
  check_linear(packed, outputs, inputs, bias, scales);
}

namespace {

at::Tensor float_norm(const c10::optional<at::Tensor>& w) {
  return w ? w->to(at::kCPU, at::kFloat).contiguous() : at::Tensor();
}

const float* ptr(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// That a layer's projections and norms have the sizes `shape` gives: it sizes the step's buffers and
// loops, so a layer built for another shape would be run out of bounds.
void check_layer(const Shape& shape, const Layer& layer) {
  const int64_t d = shape.hidden, q = shape.heads * shape.head_dim, kv = shape.kv_heads * shape.head_dim;
  const Projection &qkv = layer.qkv, &o = layer.o, &gate_up = layer.gate_up, &down = layer.down;
  TORCH_CHECK(qkv.inputs == d && qkv.outputs == q + 2 * kv && o.inputs == q && o.outputs == d && gate_up.inputs == d &&
              gate_up.outputs == 2 * shape.intermediate && down.inputs == shape.intermediate && down.outputs == d,
              "decoder: projection shapes do not match the layer's shape (hidden ", d, ", heads ", shape.heads,
              ", kv heads ", shape.kv_heads, ", head size ", shape.head_dim, ", intermediate ", shape.intermediate, ")");
  const struct {
    const at::Tensor& w;
    int64_t size;
    const char* name;
  } norms[] = {{layer.input_norm, d, "input"}, {layer.post_norm, d, "post-attention"},
               {layer.q_norm, shape.head_dim, "query"}, {layer.k_norm, shape.head_dim, "key"},
               {layer.attn_out_norm, d, "attention-output"}, {layer.mlp_out_norm, d, "MLP-output"}};
  for (const auto& norm : norms)
    TORCH_CHECK(!norm.w.defined() || (norm.w.dim() == 1 && norm.w.numel() == norm.size), "decoder: ", norm.name,
                " norm weight must have ", norm.size, " values");
}

}  // namespace

Layer::Layer(const Shape& shape, Projection qkv_, Projection o_, Projection gate_up_, Projection down_,
             const at::Tensor& input_norm_, const at::Tensor& post_norm_, const c10::optional<at::Tensor>& q_norm_,
             const c10::optional<at::Tensor>& k_norm_, const c10::optional<at::Tensor>& attn_out_norm_,
             const c10::optional<at::Tensor>& mlp_out_norm_, int64_t kind_)
    : qkv(std::move(qkv_)), o(std::move(o_)), gate_up(std::move(gate_up_)), down(std::move(down_)), kind(kind_) {
  input_norm = float_norm(input_norm_);
  post_norm = float_norm(post_norm_);
  q_norm = float_norm(q_norm_);
  k_norm = float_norm(k_norm_);
  attn_out_norm = float_norm(attn_out_norm_);
  mlp_out_norm = float_norm(mlp_out_norm_);
  check_layer(shape, *this);
  TORCH_CHECK(input_norm.defined() && post_norm.defined(), "decoder: the input and post-attention norms are required");
  TORCH_CHECK(q_norm.defined() == k_norm.defined(), "decoder: query and key norms come together");
  TORCH_CHECK(kind >= 0, "decoder: a layer's kind indexes the step's rotary tables and masks");
}

namespace {

void check_sequence(const Shape& shape, const Sequence& s, int64_t rows, size_t kinds, int64_t layers) {
  const int64_t dim = shape.head_dim, length = s.offset + s.count;
  TORCH_CHECK(s.row >= 0 && s.count >= 0 && s.row + s.count <= rows && s.offset >= 0, "decoder: sequence rows out of range");
  TORCH_CHECK(is_cpu(s.k, at::kFloat) && is_cpu(s.v, at::kFloat) && s.k.is_contiguous() && s.v.is_contiguous() &&
              s.k.sizes() == s.v.sizes() && s.k.dim() == 5 && s.k.size(0) >= layers && s.k.size(1) == 1 &&
              s.k.size(2) == shape.kv_heads && s.k.size(3) >= length && s.k.size(4) == dim,
              "decoder: key and value caches must be contiguous float32 (layers, 1, kv heads, context, head size) of one "
              "shape with room for the step; got ", s.k.sizes(), " and ", s.v.sizes());
  TORCH_CHECK(s.cos.size() == kinds && s.sin.size() == kinds && s.masks.size() == kinds, "decoder: one rotary table and mask per layer kind");
  for (size_t i = 0; i < kinds; ++i) {
    for (const auto* t : {&s.cos[i], &s.sin[i]})
      TORCH_CHECK(is_cpu(*t, at::kFloat) && t->is_contiguous() && t->numel() == s.count * dim,
                  "decoder: rotary tables must be float32 (count, head size)");
    const auto& m = s.masks[i];
    TORCH_CHECK(!m || (is_cpu(*m, at::kFloat) && m->dim() >= 2 && m->numel() == s.count * length &&
                       m->size(-2) == s.count && m->size(-1) == length && m->stride(-1) == 1),
                "decoder: masks must be float32 (count, context)");
  }
}

// Layer `layer`'s entries of a cache.
float* entries(const at::Tensor& cache, int64_t layer) { return cache.data_ptr<float>() + layer * cache.stride(0); }

// Queries and new keys normed and rotated, new keys and values written to layer `index`'s cache.
void place(const Shape& shape, const Layer& layer, const Sequence& s, int64_t index, const uint16_t* qkv, float* queries) {
  const int64_t dim = shape.head_dim, heads = shape.heads, kv_heads = shape.kv_heads;
  const int64_t width = (heads + 2 * kv_heads) * dim;
  const float* cos = s.cos[layer.kind].data_ptr<float>();
  const float* sin = s.sin[layer.kind].data_ptr<float>();
  const int64_t head_stride = s.k.stride(2), key_stride = s.k.stride(3);
  float* k_layer = entries(s.k, index);
  float* v_layer = entries(s.v, index);
  const float eps = static_cast<float>(shape.eps);
  each_row(s.count, [&](int64_t i) {
    const uint16_t* src = qkv + (s.row + i) * width;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      float* out = h < heads ? queries + (h * s.count + i) * dim
                             : k_layer + (h - heads) * head_stride + (s.offset + i) * key_stride;
      norm_row(src + h * dim, dim, ptr(h < heads ? layer.q_norm : layer.k_norm), eps, out);
      rotate(out, cos + i * dim, sin + i * dim, dim);
    }
    for (int64_t g = 0; g < kv_heads; ++g)
      norm_row(src + (heads + kv_heads + g) * dim, dim, nullptr, eps, v_layer + g * head_stride + (s.offset + i) * key_stride);
  });
}

// One sequence's attention for layer `index`: its rows of `attended`.
void attend_sequence(const Shape& shape, const Layer& layer, const Sequence& s, int64_t index, const uint16_t* qkv,
                     float* queries, float* attended) {
  place(shape, layer, s, index, qkv, queries);
  const auto& mask = s.masks[layer.kind];
  attention_rows(queries, entries(s.k, index), entries(s.v, index), s.k.stride(2), s.k.stride(3), shape.heads,
                 shape.kv_heads, s.count, s.offset + s.count, shape.head_dim, mask ? mask->data_ptr<float>() : nullptr,
                 mask ? mask->stride(-2) : 0, static_cast<float>(shape.scale), attended + s.row * shape.heads * shape.head_dim);
}

}  // namespace

at::Tensor decode(const Shape& shape, const std::vector<Layer>& layers, const at::Tensor& x,
                     const std::vector<Sequence>& sequences) {
  const int64_t d = shape.hidden, dim = shape.head_dim, heads = shape.heads;
  TORCH_CHECK(is_cpu(x, at::kBFloat16) && x.dim() == 2 && x.size(1) == d, "decoder: a bfloat16 (rows, hidden) input on the CPU");
  TORCH_CHECK(dim > 0 && dim % 64 == 0 && shape.kv_heads > 0 && heads % shape.kv_heads == 0,
              "decoder: the head size must be a positive multiple of 64 and the query heads a multiple of the key/value heads");
  for (const auto& layer : layers) check_layer(shape, layer);
  const int64_t rows = x.size(0);
  size_t kinds = 0;
  for (const auto& layer : layers) kinds = std::max(kinds, static_cast<size_t>(layer.kind + 1));
  int64_t covered = 0;
  for (const auto& s : sequences) {
    check_sequence(shape, s, rows, kinds, static_cast<int64_t>(layers.size()));
    TORCH_CHECK(s.row == covered, "decoder: sequences must cover the rows in order");
    covered += s.count;
  }
  TORCH_CHECK(covered == rows, "decoder: sequences must cover every row");

  auto out = x.contiguous().clone();
  auto bf = x.options();
  auto f32 = x.options().dtype(at::kFloat);
  const int64_t q = heads * dim, kv = shape.kv_heads * dim, inter = shape.intermediate;
  auto normed = at::empty({rows, d}, bf), qkv = at::empty({rows, q + 2 * kv}, bf);
  auto attended = at::empty({rows, q}, f32), attended16 = at::empty({rows, q}, bf);
  auto projected = at::empty({rows, d}, bf), gate_up = at::empty({rows, 2 * inter}, bf);
  auto hidden = at::empty({rows, inter}, bf);
  int64_t most = 0;
  for (const auto& s : sequences) most = std::max(most, s.count);
  auto queries = at::empty({heads * most * dim}, f32);

  auto* xp = reinterpret_cast<uint16_t*>(out.data_ptr());
  auto* np = reinterpret_cast<uint16_t*>(normed.data_ptr());
  auto* qkvp = reinterpret_cast<uint16_t*>(qkv.data_ptr());
  auto* ap = attended.data_ptr<float>();
  auto* a16 = reinterpret_cast<uint16_t*>(attended16.data_ptr());
  auto* pp = reinterpret_cast<uint16_t*>(projected.data_ptr());
  auto* gp = reinterpret_cast<uint16_t*>(gate_up.data_ptr());
  auto* hp = reinterpret_cast<uint16_t*>(hidden.data_ptr());
  const float eps = static_cast<float>(shape.eps);

  for (size_t index = 0; index < layers.size(); ++index) {
    const Layer& layer = layers[index];
    each_row(rows, [&](int64_t r) { norm_row(xp + r * d, d, ptr(layer.input_norm), eps, np + r * d); });
    layer.qkv(np, rows, qkvp);
    for (const auto& s : sequences)
      attend_sequence(shape, layer, s, static_cast<int64_t>(index), qkvp, queries.data_ptr<float>(), ap);
    each_row(rows, [&](int64_t r) { norm_row(ap + r * q, q, nullptr, eps, a16 + r * q); });
    layer.o(a16, rows, pp);
    add_rows(xp, pp, rows, d, ptr(layer.attn_out_norm), eps);
    each_row(rows, [&](int64_t r) { norm_row(xp + r * d, d, ptr(layer.post_norm), eps, np + r * d); });
    layer.gate_up(np, rows, gp);
    each_row(rows, [&](int64_t r) { gated_row(gp + r * 2 * inter, gp + r * 2 * inter + inter, inter, shape.gelu, hp + r * inter); });
    layer.down(hp, rows, pp);
    add_rows(xp, pp, rows, d, ptr(layer.mlp_out_norm), eps);
  }
  return out;
}
