// The one place the host files launch kernels: on the current stream, launch checked. (tests/cuda/
// sim has its own version that runs the grid on the CPU.)
#pragma once

#include <cstddef>
#include <utility>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

namespace fastllm {

// kernel<<<grid, block, smem_bytes, current stream>>>(args...), then the launch's error check.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                   Args&&... args) {
  kernel<<<grid, block, smem_bytes, c10::cuda::getCurrentCUDAStream()>>>(
      std::forward<Args>(args)...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fastllm
