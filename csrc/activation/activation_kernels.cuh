// Gated activations on CUDA, free of torch headers (nvcc compiles it alone in the tests):
// act(gate) * up over the two halves of a fused gate|up row (SwiGLU's silu, GeGLU's
// tanh-approximated gelu), with the eager form's roundings (the activation rounded to the
// dtype, then the product), as the CPU kernel.
#pragma once

#include <cstdint>

#include "common/cuda_types.cuh"

namespace fastllm {
namespace cuda {

constexpr int kActivationThreads = 256;

// silu(g) = g / (1 + exp(-g)).
struct Silu {
  __device__ __forceinline__ static float apply(float g) { return g / (1.f + expf(-g)); }
};

// gelu(g, approximate="tanh") = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), PyTorch's
// expression.
struct GeluTanh {
  __device__ __forceinline__ static float apply(float g) {
    const float inner = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
    return 0.5f * g * (1.f + tanhf(inner));
  }
};

// Grid: x = chunks of kActivationThreads outputs of a row, y = rows (up to 65535 per launch,
// offset by row_begin). x [rows, 2 * d] with rows x_stride apart, out [rows, d] contiguous.
template <typename Act, typename scalar_t>
__global__ void __launch_bounds__(kActivationThreads) gated_activation_kernel(
    const scalar_t* __restrict__ x, scalar_t* __restrict__ out, int64_t x_stride, int64_t d,
    int64_t row_begin) {
  const int64_t row = row_begin + blockIdx.y;
  const int64_t j = int64_t(blockIdx.x) * kActivationThreads + threadIdx.x;
  if (j >= d) return;
  const float gate = to_float(x[row * x_stride + j]);
  const float act = to_float(from_float<scalar_t>(Act::apply(gate)));
  out[row * d + j] = from_float<scalar_t>(act * to_float(x[row * x_stride + d + j]));
}

}  // namespace cuda
}  // namespace fastllm

#ifdef FASTLLM_KERNEL_COMPILE_CHECK
#define FASTLLM_INSTANTIATE(A, T)                                                          \
  template __global__ void fastllm::cuda::gated_activation_kernel<fastllm::cuda::A, T>(   \
      const T*, T*, int64_t, int64_t, int64_t);
#define FASTLLM_INSTANTIATE_DTYPES(A) \
  FASTLLM_INSTANTIATE(A, float)       \
  FASTLLM_INSTANTIATE(A, __half)      \
  FASTLLM_INSTANTIATE(A, __nv_bfloat16)
FASTLLM_INSTANTIATE_DTYPES(Silu)
FASTLLM_INSTANTIATE_DTYPES(GeluTanh)
#undef FASTLLM_INSTANTIATE_DTYPES
#undef FASTLLM_INSTANTIATE
#endif
