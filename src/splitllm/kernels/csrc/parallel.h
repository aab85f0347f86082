// parallel_for(begin, end, grain, f): f(b, e) over chunks of [begin, end). In the PyTorch extension it is
// ATen's thread pool; built without PyTorch (kernel_check.cpp) it runs serially. The kernels give a row the
// same bits whatever the chunking, so the two agree.
#pragma once
#include <cstdint>

#ifdef TORCH_EXTENSION_NAME
#include <ATen/Parallel.h>
namespace simd {
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, f);
}
}  // namespace simd
#else
namespace simd {
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t, const F& f) {
  if (begin < end) f(begin, end);
}
}  // namespace simd
#endif
