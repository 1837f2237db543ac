// Batched LoRA on CUDA, free of torch headers (nvcc compiles it alone in the tests): for each
// token t of slot s, y[t] += lora_b[s] @ (lora_a[s] @ x[t]) (Punica's BGMV), in two kernels.
// The shrink sums each of the rank dot products over in_features in float32 and stores it
// rounded to the dtype (as the CPU kernel and peft's lora_B(lora_A(x)) round it); the expand
// sums over the rank in float32 and adds into y with one rounding. Tokens whose slot is -1, or
// outside [0, num_slots) under trusted inputs, are skipped.
#pragma once

#include <cstdint>

#include "common/cuda_types.cuh"

namespace fastllm {
namespace cuda {

constexpr int kLoraThreads = 256;
constexpr int kLoraWarps = kLoraThreads / 32;
// The largest rank: the expand keeps a token's shrink result in shared memory (lora/lora.h's
// kMaxLoraRank, which the host checks).
constexpr int kLoraMaxRank = 1024;

template <typename scalar_t>
struct LoraParams {
  const scalar_t* x;             // [tokens, in], rows x_stride apart
  const scalar_t* lora_a;        // [num_slots, rank, in] contiguous
  const scalar_t* lora_b;        // [num_slots, out, rank] contiguous
  const int32_t* token_slots;    // [tokens]
  scalar_t* h;                   // [tokens, rank] contiguous: the shrink's results
  scalar_t* y;                   // [tokens, out], rows y_stride apart
  int64_t x_stride, y_stride;
  int64_t in, out;
  int rank, num_slots;
  int lanes_per_row;  // the expand's lanes per output row: a power of two <= 32, >= rank if < 32
};

__device__ __forceinline__ bool lora_slot_is_valid(int slot, int num_slots) {
  return slot >= 0 && slot < num_slots;
}

// Grid: x = tokens, y = blocks of kLoraWarps rank rows; a warp per rank row, its lanes strided
// over in_features, then reduced across the warp.
template <typename scalar_t>
__global__ void __launch_bounds__(kLoraThreads) lora_shrink_kernel(LoraParams<scalar_t> p) {
  const int64_t token = blockIdx.x;
  const int slot = p.token_slots[token];
  const int r = int(blockIdx.y) * kLoraWarps + int(threadIdx.x) / 32;
  // Whole warps leave: the reduction below meets only full warps.
  if (!lora_slot_is_valid(slot, p.num_slots) || r >= p.rank) return;
  const int lane = int(threadIdx.x) % 32;
  const scalar_t* x = p.x + token * p.x_stride;
  const scalar_t* a = p.lora_a + (int64_t(slot) * p.rank + r) * p.in;
  float sum = 0.f;
  for (int64_t k = lane; k < p.in; k += 32) sum += to_float(x[k]) * to_float(a[k]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) p.h[token * p.rank + r] = from_float<scalar_t>(sum);
}

// Grid: x = tokens, y = blocks of output rows (striding over all of them when there are more
// than the grid's y). The token's shrink result is staged in shared memory; each output row
// takes lanes_per_row lanes strided over the rank, reduced within their aligned group of lanes.
template <typename scalar_t>
__global__ void __launch_bounds__(kLoraThreads) lora_expand_kernel(LoraParams<scalar_t> p) {
  __shared__ float h[kLoraMaxRank];
  const int64_t token = blockIdx.x;
  const int slot = p.token_slots[token];
  if (!lora_slot_is_valid(slot, p.num_slots)) return;  // the whole block
  for (int r = int(threadIdx.x); r < p.rank; r += kLoraThreads)
    h[r] = to_float(p.h[token * p.rank + r]);
  __syncthreads();
  const int lanes = p.lanes_per_row;
  const int rows_per_pass = kLoraThreads / lanes;
  const int lane = int(threadIdx.x) % lanes;
  const scalar_t* b = p.lora_b + int64_t(slot) * p.out * p.rank;
  scalar_t* y = p.y + token * p.y_stride;
  // The block's rows step together, so every lane of a warp meets each shuffle.
  for (int64_t base = int64_t(blockIdx.y) * rows_per_pass; base < p.out;
       base += int64_t(gridDim.y) * rows_per_pass) {
    const int64_t row = base + int(threadIdx.x) / lanes;
    float sum = 0.f;
    if (row < p.out)
      for (int r = lane; r < p.rank; r += lanes) sum += h[r] * to_float(b[row * p.rank + r]);
    for (int offset = lanes / 2; offset > 0; offset /= 2)
      sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (row < p.out && lane == 0) y[row] = from_float<scalar_t>(to_float(y[row]) + sum);
  }
}

}  // namespace cuda
}  // namespace fastllm

#ifdef FASTLLM_KERNEL_COMPILE_CHECK
#define FASTLLM_INSTANTIATE(T)                                                              \
  template __global__ void fastllm::cuda::lora_shrink_kernel<T>(fastllm::cuda::LoraParams<T>); \
  template __global__ void fastllm::cuda::lora_expand_kernel<T>(fastllm::cuda::LoraParams<T>);
FASTLLM_INSTANTIATE(float)
FASTLLM_INSTANTIATE(__half)
FASTLLM_INSTANTIATE(__nv_bfloat16)
#undef FASTLLM_INSTANTIATE
#endif
