// Rotary embedding on CUDA, free of torch headers (nvcc compiles it alone in the tests): q and k
// rotated in place by their tokens' positions, the same pairs and table as the CPU kernel.
#pragma once

#include <cstdint>

#include "common/cuda_types.cuh"

namespace fastllm {
namespace cuda {

// One thread block per token; its threads stride over (head, rotated pair) of q's heads, then
// k's. A table row is [cos of rot/2 frequencies | their sin]; neox pairs channel j with
// j + rot/2, the interleaved layout 2j with 2j + 1; channels past rot are left alone.
template <typename scalar_t, typename cache_t, typename pos_t>
__global__ void rotary_embedding_kernel(
    const pos_t* __restrict__ positions, scalar_t* __restrict__ q, scalar_t* __restrict__ k,
    const cache_t* __restrict__ cos_sin_cache, int rot_dim, int64_t q_stride_token,
    int64_t q_stride_head, int64_t k_stride_token, int64_t k_stride_head, int num_q_heads,
    int num_k_heads, bool is_neox, int64_t max_position) {
  const int64_t token = blockIdx.x;
  const int64_t position = positions[token];
  // Outside the table: rejected on the host unless it could not look (graph capture); the
  // token is left unrotated rather than read out of bounds.
  if (position < 0 || position >= max_position) return;
  const cache_t* row = cos_sin_cache + position * rot_dim;
  const int half = rot_dim / 2;
  const int heads = num_q_heads + (k != nullptr ? num_k_heads : 0);
  for (int i = threadIdx.x; i < heads * half; i += blockDim.x) {
    const int head = i / half, j = i % half;
    scalar_t* x = head < num_q_heads
                      ? q + token * q_stride_token + head * q_stride_head
                      : k + token * k_stride_token + (head - num_q_heads) * k_stride_head;
    const int first = is_neox ? j : 2 * j, second = is_neox ? j + half : 2 * j + 1;
    const float cos = to_float(row[j]), sin = to_float(row[half + j]);
    const float x1 = to_float(x[first]), x2 = to_float(x[second]);
    x[first] = from_float<scalar_t>(x1 * cos - x2 * sin);
    x[second] = from_float<scalar_t>(x2 * cos + x1 * sin);
  }
}

}  // namespace cuda
}  // namespace fastllm

#ifdef FASTLLM_KERNEL_COMPILE_CHECK
#define FASTLLM_INSTANTIATE(T, P)                                                           \
  template __global__ void fastllm::cuda::rotary_embedding_kernel<T, float, P>(             \
      const P*, T*, T*, const float*, int, int64_t, int64_t, int64_t, int64_t, int, int, bool, int64_t);
FASTLLM_INSTANTIATE(float, int64_t)
FASTLLM_INSTANTIATE(__half, int64_t)
FASTLLM_INSTANTIATE(__nv_bfloat16, int64_t)
FASTLLM_INSTANTIATE(float, int32_t)
FASTLLM_INSTANTIATE(__half, int32_t)
FASTLLM_INSTANTIATE(__nv_bfloat16, int32_t)
#undef FASTLLM_INSTANTIATE
#endif
