// The simulator's csrc/common/cuda_launch.cuh: the grid runs on the CPU before the call returns.
#pragma once

#include <cstddef>
#include <tuple>
#include <utility>

#include "cuda_sim.h"

namespace fastllm {

template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                   Args&&... args) {
  // The arguments are converted to the kernel's parameter types once, as a launch does.
  const std::tuple<Params...> params(std::forward<Args>(args)...);
  ::cuda_sim::launch(reinterpret_cast<const void*>(kernel), grid, block, smem_bytes,
                     [&] { std::apply(kernel, params); });
}

}  // namespace fastllm
