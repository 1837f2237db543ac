// SwiGLU's gate on CUDA, free of torch headers (nvcc compiles it alone in the tests):
// silu(gate) * up over the two halves of a fused gate|up row, with the eager form's roundings
// (silu rounded to the dtype, then the product), as the CPU kernel.
#pragma once

#include <cstdint>

#include "common/cuda_types.cuh"

namespace fastllm {
namespace cuda {

constexpr int kActivationThreads = 256;

// Grid: x = chunks of kActivationThreads outputs of a row, y = rows (up to 65535 per launch,
// offset by row_begin). x [rows, 2 * d] with rows x_stride apart, out [rows, d] contiguous.
template <typename scalar_t>
__global__ void __launch_bounds__(kActivationThreads) silu_and_mul_kernel(
    const scalar_t* __restrict__ x, scalar_t* __restrict__ out, int64_t x_stride, int64_t d,
    int64_t row_begin) {
  const int64_t row = row_begin + blockIdx.y;
  const int64_t j = int64_t(blockIdx.x) * kActivationThreads + threadIdx.x;
  if (j >= d) return;
  const float gate = to_float(x[row * x_stride + j]);
  const float silu = to_float(from_float<scalar_t>(gate / (1.f + expf(-gate))));
  out[row * d + j] = from_float<scalar_t>(silu * to_float(x[row * x_stride + d + j]));
}

}  // namespace cuda
}  // namespace fastllm

#ifdef FASTLLM_KERNEL_COMPILE_CHECK
#define FASTLLM_INSTANTIATE(T)                                                               \
  template __global__ void fastllm::cuda::silu_and_mul_kernel<T>(const T*, T*, int64_t, int64_t, \
                                                                  int64_t);
FASTLLM_INSTANTIATE(float)
FASTLLM_INSTANTIATE(__half)
FASTLLM_INSTANTIATE(__nv_bfloat16)
#undef FASTLLM_INSTANTIATE
#endif
