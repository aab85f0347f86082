// What decoder.cpp's fused step takes: a layer's shape, its weights, and each sequence's share of a step.
#pragma once
#include <torch/extension.h>
#include <vector>

// The sizes and constants every layer of a stage shares.
struct Shape {
  int64_t hidden, heads, kv_heads, head_dim, intermediate;
  double eps, scale;  // RMSNorm epsilon; attention's score scale
  bool gelu;          // GELU (tanh) instead of SiLU on the gate
};

// A packed linear weight (see linear.cpp) with its int8 or int4 scales: y = x W^T (+ bias), bfloat16 in and out.
struct Projection {
  torch::Tensor packed;
  int64_t outputs, inputs;
  c10::optional<torch::Tensor> bias, scales;
  Projection(torch::Tensor packed, int64_t outputs, c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> scales);
  void operator()(const uint16_t* x, int64_t rows, uint16_t* y) const;
};

// One decoder layer. Norm weights are kept in float32 (undefined: that norm is absent); `kind` picks
// the step's rotary table and mask (layers differ by attention window and rotary base).
struct Layer {
  Projection qkv, o, gate_up, down;
  torch::Tensor input_norm, post_norm, q_norm, k_norm, attn_out_norm, mlp_out_norm;
  int64_t kind;
  Layer(const Shape& shape, Projection qkv, Projection o, Projection gate_up, Projection down,
        const torch::Tensor& input_norm, const torch::Tensor& post_norm, const c10::optional<torch::Tensor>& q_norm,
        const c10::optional<torch::Tensor>& k_norm, const c10::optional<torch::Tensor>& attn_out_norm,
        const c10::optional<torch::Tensor>& mlp_out_norm, int64_t kind);
};

// One sequence's rows [row, row + count) of a step: its cache (float32, (layers, 1, kv heads, context,
// head size)), where the new entries go, and per layer kind its rotary tables (count, head size) and
// additive mask (count, offset + count), or none.
struct Sequence {
  int64_t row, count, offset;
  torch::Tensor k, v;
  std::vector<torch::Tensor> cos, sin;
  std::vector<c10::optional<torch::Tensor>> masks;
};

torch::Tensor decode(const Shape& shape, const std::vector<Layer>& layers, const torch::Tensor& x,
                     const std::vector<Sequence>& sequences);
