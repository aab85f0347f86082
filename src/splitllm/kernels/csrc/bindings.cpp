// The CPU kernels as one Python module (see splitllm/kernels/cpu_kernels.py). Its classes are local to the
// module, so two variants (avx512 and avx2, say) load side by side in one process.
#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("pack", &pack, "Lay out an (N, K) bfloat16 or int8 weight in the linear kernel's blocks");
  m.def("pack_int4", &pack_int4, "Lay out (N, K) 4-bit values and (N, K / 32, 2) float16 scales and minimums for the linear kernel");
  m.def("unpack", &unpack, "The dense (N, K) bfloat16 weight a packed one stands for (scales applied)");
  m.def("tiles_available", &tiles_available, "Whether the linears run on AMX's tile unit here");
  m.def("linear", &linear, "x W^T (+ b) in bfloat16 with a packed weight (and its scales)", release());
  m.def("attention", &attention, "Masked attention of a few query rows over a float32 cache", release());
  py::class_<Shape>(m, "Shape", py::module_local())
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, bool>(), py::arg("hidden"),
           py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"),
           py::arg("scale"), py::arg("gelu"));
  py::class_<Projection>(m, "Projection", py::module_local())
      .def(py::init<torch::Tensor, int64_t, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>(),
           py::arg("packed"), py::arg("outputs"), py::arg("bias"), py::arg("scales"));
  py::class_<Layer>(m, "Layer", py::module_local())
      .def(py::init<const Shape&, Projection, Projection, Projection, Projection, const torch::Tensor&, const torch::Tensor&,
                    const c10::optional<torch::Tensor>&, const c10::optional<torch::Tensor>&,
                    const c10::optional<torch::Tensor>&, const c10::optional<torch::Tensor>&, int64_t>(),
           py::arg("shape"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("input_norm"),
           py::arg("post_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("attn_out_norm"), py::arg("mlp_out_norm"),
           py::arg("kind"));
  py::class_<Sequence>(m, "Sequence", py::module_local())
      .def(py::init([](int64_t row, int64_t count, int64_t offset, torch::Tensor k, torch::Tensor v,
                       std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin,
                       std::vector<c10::optional<torch::Tensor>> masks) {
             return Sequence{row, count, offset, std::move(k), std::move(v), std::move(cos), std::move(sin), std::move(masks)};
           }),
           py::arg("row"), py::arg("count"), py::arg("offset"), py::arg("k"), py::arg("v"), py::arg("cos"), py::arg("sin"),
           py::arg("masks"));
  m.def("decode", &decode, "A stage's step through all its layers (see decoder.cpp)", release());
}
