// The CPU kernels as one Python module (see splitllm/model/cpu_kernels.py).
#include <torch/extension.h>

torch::Tensor pack(const torch::Tensor& weight);
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, const c10::optional<torch::Tensor>& bias,
                     const c10::optional<torch::Tensor>& scales);
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const c10::optional<torch::Tensor>& mask, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("pack", &pack, "Lay out an (N, K) bfloat16 or int8 weight in the linear kernel's blocks");
  m.def("linear", &linear, "x W^T (* scales) (+ b) in bfloat16 with a packed weight", release());
  m.def("attention", &attention, "Masked attention of a few query rows over a float32 cache", release());
}
