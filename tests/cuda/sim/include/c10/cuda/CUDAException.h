// The simulator's c10/cuda/CUDAException.h: C10_CUDA_CHECK over the simulator's runtime calls.
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#define C10_CUDA_CHECK(EXPR)                                                          \
  do {                                                                                \
    const cudaError_t cuda_sim_error = (EXPR);                                        \
    TORCH_CHECK(cuda_sim_error == cudaSuccess, "CUDA error ", int(cuda_sim_error), \
                " (cuda sim) from ", #EXPR);                                          \
  } while (0)
