// Rotary embedding on CUDA, free of torch headers (nvcc compiles it alone in the tests): q and k
// rotated in place by their tokens' positions, the same pairs and table as the CPU kernel; and
// rotary_and_cache's kernel, the q/k norms, the rotation and the cache write in one launch.
#pragma once

#include <cstdint>

#include "common/cuda_ptx.cuh"
#include "common/cuda_types.cuh"
#include "norm/norm_kernels.cuh"

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

constexpr int kRotaryCacheThreads = 256;  // a warp per head row

template <typename scalar_t, typename cache_t, typename table_t, typename pos_t>
struct RotaryAndCacheParams {
  const pos_t* positions;
  scalar_t* q;                 // [tokens, n_heads, head_dim], updated in place
  scalar_t* k;                 // [tokens, n_kv_heads, head_dim], updated in place
  const scalar_t* v;           // [tokens, n_kv_heads, head_dim]
  cache_t* k_cache;            // [num_blocks, block_size, n_kv_heads, head_dim], dense head_dim
  cache_t* v_cache;            // the same strides as k_cache
  const int64_t* slot_mapping;
  const table_t* cos_sin;      // [max_position, rot_dim] or null (no RoPE)
  const scalar_t* q_norm;      // [head_dim] or null (no q/k norm)
  const scalar_t* k_norm;
  int64_t q_stride[3], k_stride[3], v_stride[3];  // token, head, dim
  int64_t cache_stride_block, cache_stride_slot, cache_stride_head;
  int64_t num_slots, max_position;
  int num_q_heads, num_kv_heads, head_dim, rot_dim, block_size;
  float eps;
  bool is_neox, rotate_keys;
};

// One block per token, a warp per head row: q's heads, then k's (each normalized, rounded as
// rms_norm stores it, then rotated with the same pairs and roundings as rotary_embedding_kernel,
// k's rows then written to the token's cache slot), then v's rows copied to the slot. A row is
// staged in shared memory as float32 (head_dim floats per warp) between the norm and the
// rotation, whose pairs cross lanes.
template <typename scalar_t, typename cache_t, typename table_t, typename pos_t>
__global__ void __launch_bounds__(kRotaryCacheThreads) rotary_and_cache_kernel(
    const RotaryAndCacheParams<scalar_t, cache_t, table_t, pos_t> p) {
  constexpr int kWarps = kRotaryCacheThreads / 32;
  const int64_t token = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* row = reinterpret_cast<float*>(dynamic_shared_memory()) + warp * p.head_dim;
  const int64_t slot = p.slot_mapping[token];
  // Negative: padding. Past the pool: rejected on the host unless it could not look.
  const bool cached = slot >= 0 && slot < p.num_slots;
  const int64_t cache_row = cached ? (slot / p.block_size) * p.cache_stride_block +
                                         (slot % p.block_size) * p.cache_stride_slot
                                   : 0;
  const int64_t position = p.cos_sin != nullptr ? int64_t(p.positions[token]) : -1;
  // Outside the table: left unrotated rather than read out of bounds.
  const bool in_table = position >= 0 && position < p.max_position;
  const int half = p.rot_dim / 2;
  for (int head = warp; head < p.num_q_heads + 2 * p.num_kv_heads; head += kWarps) {
    if (head >= p.num_q_heads + p.num_kv_heads) {  // a value row: to the cache as it is
      const int h = head - p.num_q_heads - p.num_kv_heads;
      if (!cached) continue;
      const scalar_t* src = p.v + token * p.v_stride[0] + h * p.v_stride[1];
      cache_t* dst = p.v_cache + cache_row + h * p.cache_stride_head;
      for (int j = lane; j < p.head_dim; j += 32)
        dst[j] = from_float<cache_t>(to_float(src[j * p.v_stride[2]]));
      continue;
    }
    const bool is_q = head < p.num_q_heads;
    const int h = is_q ? head : head - p.num_q_heads;
    const int64_t* stride = is_q ? p.q_stride : p.k_stride;
    scalar_t* x = (is_q ? p.q : p.k) + token * stride[0] + h * stride[1];
    const scalar_t* weight = is_q ? p.q_norm : p.k_norm;
    const bool rotate = in_table && (is_q || p.rotate_keys);
    float sum = 0.f;
    for (int j = lane; j < p.head_dim; j += 32) {
      const float v = to_float(x[j * stride[2]]);
      row[j] = v;
      sum += v * v;
    }
    if (weight != nullptr) {  // rms_norm_kernel's warp-wide row, the same sums and roundings
      const float inverse = rms_inverse(row_sum<32>(sum, nullptr), p.head_dim, p.eps);
      for (int j = lane; j < p.head_dim; j += 32)
        row[j] = to_float(rms_normalized(row[j], inverse, weight[j]));
    }
    __syncwarp();
    if (rotate) {
      const table_t* angles = p.cos_sin + position * p.rot_dim;
      for (int i = lane; i < half; i += 32) {
        const int first = p.is_neox ? i : 2 * i, second = p.is_neox ? i + half : 2 * i + 1;
        const float cos = to_float(angles[i]), sin = to_float(angles[half + i]);
        const float x1 = row[first], x2 = row[second];
        row[first] = to_float(from_float<scalar_t>(x1 * cos - x2 * sin));
        row[second] = to_float(from_float<scalar_t>(x2 * cos + x1 * sin));
      }
      __syncwarp();
    }
    // Every value in `row` is one of scalar_t's: stored back exactly.
    if (weight != nullptr || rotate)
      for (int j = lane; j < p.head_dim; j += 32) x[j * stride[2]] = from_float<scalar_t>(row[j]);
    if (!is_q && cached) {
      cache_t* dst = p.k_cache + cache_row + h * p.cache_stride_head;
      for (int j = lane; j < p.head_dim; j += 32) dst[j] = from_float<cache_t>(row[j]);
    }
    __syncwarp();  // the row's reads are done before the warp's next head overwrites it
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
#define FASTLLM_INSTANTIATE(T, C, P)                                                        \
  template __global__ void fastllm::cuda::rotary_and_cache_kernel<T, C, float, P>(          \
      const fastllm::cuda::RotaryAndCacheParams<T, C, float, P>);
FASTLLM_INSTANTIATE(float, float, int64_t)
FASTLLM_INSTANTIATE(__half, __half, int64_t)
FASTLLM_INSTANTIATE(__nv_bfloat16, __nv_bfloat16, int64_t)
FASTLLM_INSTANTIATE(float, __nv_bfloat16, int64_t)
FASTLLM_INSTANTIATE(float, __half, int32_t)
#undef FASTLLM_INSTANTIATE
#endif
