// reshape_and_cache on CUDA, free of torch headers (nvcc compiles it alone in the tests): each
// new token's K and V rows copied into its slot of the paged pools.
#pragma once

#include <cstdint>

namespace fastllm {
namespace cuda {

// One thread block per token; its threads stride over the token's heads x head_dim elements.
// The innermost dimension is contiguous in key, value and the caches (the host checks it).
template <typename scalar_t>
__global__ void reshape_and_cache_kernel(
    const scalar_t* __restrict__ key, const scalar_t* __restrict__ value,
    scalar_t* __restrict__ k_cache, scalar_t* __restrict__ v_cache,
    const int64_t* __restrict__ slot_mapping, int64_t key_stride_token, int64_t key_stride_head,
    int64_t value_stride_token, int64_t value_stride_head, int64_t cache_stride_block,
    int64_t cache_stride_slot, int64_t cache_stride_head, int num_heads, int head_dim,
    int block_size, int64_t num_slots) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  // Negative: padding, no slot. Past the pool: rejected on the host unless the host could not
  // look (graph capture); never written out of bounds.
  if (slot < 0 || slot >= num_slots) return;
  const int64_t row = (slot / block_size) * cache_stride_block + (slot % block_size) * cache_stride_slot;
  for (int i = threadIdx.x; i < num_heads * head_dim; i += blockDim.x) {
    const int head = i / head_dim, d = i % head_dim;
    const int64_t dst = row + head * cache_stride_head + d;
    k_cache[dst] = key[token * key_stride_token + head * key_stride_head + d];
    v_cache[dst] = value[token * value_stride_token + head * value_stride_head + d];
  }
}

}  // namespace cuda
}  // namespace fastllm

#ifdef FASTLLM_KERNEL_COMPILE_CHECK
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define FASTLLM_INSTANTIATE(T)                                                              \
  template __global__ void fastllm::cuda::reshape_and_cache_kernel<T>(                      \
      const T*, const T*, T*, T*, const int64_t*, int64_t, int64_t, int64_t, int64_t,        \
      int64_t, int64_t, int64_t, int, int, int, int64_t);
FASTLLM_INSTANTIATE(float)
FASTLLM_INSTANTIATE(__half)
FASTLLM_INSTANTIATE(__nv_bfloat16)
#undef FASTLLM_INSTANTIATE
#endif
