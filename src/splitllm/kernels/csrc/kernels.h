// Every function one of the kernels' sources defines for another or for bindings.cpp, and the fused
// step's structures. Each source includes this header and is compiled with -Werror=missing-declarations
// (see cpu_kernels.py), so a definition whose signature drifts from its declaration here fails the
// build instead of leaving an undefined symbol that only shows up as a module that will not load.
#pragma once
// ATen alone: only bindings.cpp needs torch/extension.h (pybind11 and the C++ frontend), whose headers
// would dominate each source's compile time, and the kernels compile at install.
#include <ATen/ATen.h>
#include <tuple>
#include <vector>

// Whether t can be read through a raw pointer as `type`: defined, in CPU memory, of that dtype.
inline bool is_cpu(const at::Tensor& t, at::ScalarType type) {
  return t.defined() && t.device().is_cpu() && t.scalar_type() == type;
}

// linear.cpp: weights packed in blocks of 32 outputs, and y = x W^T (+ b) with them.
// Whether this process uses AMX's bfloat16 tiles (tiles_amx.h): an AVX-512 build, the CPU has them (CPUID
// leaf 7), Linux granted the tile state (asked once per process; the grant covers every thread) and
// SPLITLLM_TILES is not 0 (which runs the dot-product path, as on CPUs without tiles).
bool tiles_available();
at::Tensor pack(const at::Tensor& weight);
std::tuple<at::Tensor, at::Tensor> pack_int4(const at::Tensor& q, const at::Tensor& scales_mins);
at::Tensor unpack(const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& scales);
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                     const c10::optional<at::Tensor>& scales);
// That a packed weight, its bias and scales make a linear of n outputs over k inputs (throws if not).
void check_linear(const at::Tensor& packed, int64_t n, int64_t k, const c10::optional<at::Tensor>& bias,
                  const c10::optional<at::Tensor>& scales);
// y (rows, n) = x (rows, k) W^T (+ bias) on raw rows, for a weight check_linear accepted.
void linear_rows(const uint16_t* x, int64_t rows, const at::Tensor& packed, int64_t n, const float* bias,
                 const c10::optional<at::Tensor>& scales, uint16_t* y);

// attention.cpp: a few query rows over a float32 cache.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const c10::optional<at::Tensor>& mask, double scale);
// On raw pointers, shapes already checked: queries (heads, n, dim) contiguous; one head's keys and
// values at k + g * head_stride, key j at + j * key_stride; additive mask rows (n, length) `mask_row`
// apart, or none. Writes (n, heads * dim).
void attention_rows(const float* qp, const float* kp, const float* vp, int64_t head_stride, int64_t key_stride,
                    int64_t heads, int64_t kv_heads, int64_t n, int64_t length, int64_t dim, const float* mp,
                    int64_t mask_row, float scale, float* op);

// decoder.cpp: a stage's step, given each layer's shape and weights and each sequence's share of the step.

// The sizes and constants every layer of a stage shares.
struct Shape {
  int64_t hidden, heads, kv_heads, head_dim, intermediate;
  double eps, scale;  // RMSNorm epsilon; attention's score scale
  bool gelu;          // GELU (tanh) instead of SiLU on the gate
};

// A packed linear weight (see linear.cpp) with its int8 or int4 scales: y = x W^T (+ bias), bfloat16 in and out.
struct Projection {
  at::Tensor packed;
  int64_t outputs, inputs;
  c10::optional<at::Tensor> bias, scales;
  Projection(at::Tensor packed, int64_t outputs, c10::optional<at::Tensor> bias, c10::optional<at::Tensor> scales);
  void operator()(const uint16_t* x, int64_t rows, uint16_t* y) const;
};

// One decoder layer. Norm weights are kept in float32 (undefined: that norm is absent); `kind` picks
// the step's rotary table and mask (layers differ by attention window and rotary base).
struct Layer {
  Projection qkv, o, gate_up, down;
  at::Tensor input_norm, post_norm, q_norm, k_norm, attn_out_norm, mlp_out_norm;
  int64_t kind;
  Layer(const Shape& shape, Projection qkv, Projection o, Projection gate_up, Projection down,
        const at::Tensor& input_norm, const at::Tensor& post_norm, const c10::optional<at::Tensor>& q_norm,
        const c10::optional<at::Tensor>& k_norm, const c10::optional<at::Tensor>& attn_out_norm,
        const c10::optional<at::Tensor>& mlp_out_norm, int64_t kind);
};

// One sequence's rows [row, row + count) of a step: its cache (float32, (layers, 1, kv heads, context,
// head size)), where the new entries go, and per layer kind its rotary tables (count, head size) and
// additive mask (count, offset + count), or none.
struct Sequence {
  int64_t row, count, offset;
  at::Tensor k, v;
  std::vector<at::Tensor> cos, sin;
  std::vector<c10::optional<at::Tensor>> masks;
};

at::Tensor decode(const Shape& shape, const std::vector<Layer>& layers, const at::Tensor& x,
                     const std::vector<Sequence>& sequences);
