// reshape_and_cache on CUDA, free of torch headers (nvcc compiles it alone in the tests): each
// new token's K and V rows copied into its slot of the paged pools.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/cuda_types.cuh"

namespace fastllm {
namespace cuda {

// One thread block per token; its threads stride over the token's heads x head_dim elements.
// The innermost dimension is contiguous in key, value and the caches (the host checks it). A
// cache of another dtype than the rows' gets each value rounded to nearest even.
template <typename scalar_t, typename cache_t>
__global__ void reshape_and_cache_kernel(
    const scalar_t* __restrict__ key, const scalar_t* __restrict__ value,
    cache_t* __restrict__ k_cache, cache_t* __restrict__ v_cache,
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
    const scalar_t k = key[token * key_stride_token + head * key_stride_head + d];
    const scalar_t v = value[token * value_stride_token + head * value_stride_head + d];
    if constexpr (std::is_same_v<scalar_t, cache_t>) {
      k_cache[dst] = k;
      v_cache[dst] = v;
    } else {
      k_cache[dst] = from_float<cache_t>(to_float(k));
      v_cache[dst] = from_float<cache_t>(to_float(v));
    }
  }
}

}  // namespace cuda
}  // namespace fastllm

#ifdef FASTLLM_KERNEL_COMPILE_CHECK
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define FASTLLM_INSTANTIATE(T, C)                                                           \
  template __global__ void fastllm::cuda::reshape_and_cache_kernel<T, C>(                   \
      const T*, const T*, C*, C*, const int64_t*, int64_t, int64_t, int64_t, int64_t,        \
      int64_t, int64_t, int64_t, int, int, int, int64_t);
FASTLLM_INSTANTIATE(float, float)
FASTLLM_INSTANTIATE(__half, __half)
FASTLLM_INSTANTIATE(__nv_bfloat16, __nv_bfloat16)
FASTLLM_INSTANTIATE(float, __half)
FASTLLM_INSTANTIATE(float, __nv_bfloat16)
#undef FASTLLM_INSTANTIATE
#endif
