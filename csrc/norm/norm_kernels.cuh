// RMSNorm on CUDA, free of torch headers (nvcc compiles it alone in the tests), with HF's
// arithmetic as the CPU kernel: the row normalized in float32, rounded to its dtype, then scaled
// by the weight in that dtype. add_rms_norm's form first adds x into the residual stream (rounded
// to the dtype, as `residual += x` stores it) and normalizes that.
#pragma once

#include <cstdint>

#include "common/cuda_types.cuh"

namespace fastllm {
namespace cuda {

constexpr int kNormThreads = 256;

template <typename scalar_t>
struct RmsNormParams {
  const scalar_t* x;   // rows of [outer, inner, hidden]: row r at (r / inner, r % inner)
  scalar_t* residual;  // add_rms_norm: [rows, hidden] contiguous, updated in place; else null
  const scalar_t* weight;  // [hidden]
  scalar_t* out;           // [rows, hidden] contiguous (add_rms_norm: x itself)
  int64_t stride_outer, stride_inner;
  int64_t rows;
  int inner, hidden;
  float eps;
};

// Sum over the kRowThreads threads of a row (a warp's lanes, or a whole block): every thread of
// the row gets it. `scratch` holds one float per warp (unused for a warp-wide row).
template <int kRowThreads>
__device__ __forceinline__ float row_sum(float v, float* scratch) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if constexpr (kRowThreads > 32) {
    constexpr int kWarps = kRowThreads / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += scratch[w];  // the same order in every thread
    __syncthreads();  // scratch is free again for the next row
  }
  return v;
}

// The inverse root mean square of a row of n values from their sum of squares.
__device__ __forceinline__ float rms_inverse(float sum_of_squares, int n, float eps) {
  return 1.f / sqrtf(sum_of_squares / float(n) + eps);
}

// One output of the norm: x normalized in float32, rounded to scalar_t, then scaled by the
// weight in scalar_t.
template <typename scalar_t>
__device__ __forceinline__ scalar_t rms_normalized(float x, float inverse, scalar_t weight) {
  const float normed = to_float(from_float<scalar_t>(x * inverse));
  return from_float<scalar_t>(to_float(weight) * normed);
}

// kNormThreads threads per block, kRowThreads (32 or kNormThreads) of them per row: short rows
// (q/k heads) take a warp each, model-wide rows a block. A row's threads stride over its
// elements, and its sum of squares is taken in a fixed order whatever the batch.
template <typename scalar_t, int kRowThreads, bool kAddResidual>
__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(RmsNormParams<scalar_t> p) {
  constexpr int kRowsPerBlock = kNormThreads / kRowThreads;
  __shared__ float scratch[kNormThreads / 32];
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kRowThreads;
  const int lane = threadIdx.x % kRowThreads;
  // Only a warp-wide row's warp can be past the last row (a block-wide row has a block each),
  // and it meets no block barrier.
  if (row >= p.rows) return;
  scalar_t* out = p.out + row * p.hidden;
  const scalar_t* src;
  if constexpr (kAddResidual) {
    src = p.residual + row * p.hidden;
  } else {
    src = p.x + (row / p.inner) * p.stride_outer + (row % p.inner) * p.stride_inner;
  }
  float sum = 0.f;
  for (int j = lane; j < p.hidden; j += kRowThreads) {
    float v;
    if constexpr (kAddResidual) {
      // The same thread reads this element back below: no barrier needed.
      const scalar_t updated =
          from_float<scalar_t>(to_float(src[j]) + to_float(p.x[row * p.hidden + j]));
      p.residual[row * p.hidden + j] = updated;
      v = to_float(updated);
    } else {
      v = to_float(src[j]);
    }
    sum += v * v;
  }
  sum = row_sum<kRowThreads>(sum, scratch);
  const float inverse = rms_inverse(sum, p.hidden, p.eps);
  for (int j = lane; j < p.hidden; j += kRowThreads)
    out[j] = rms_normalized(to_float(src[j]), inverse, p.weight[j]);
}

}  // namespace cuda
}  // namespace fastllm

#ifdef FASTLLM_KERNEL_COMPILE_CHECK
#define FASTLLM_INSTANTIATE(T, R, A) \
  template __global__ void fastllm::cuda::rms_norm_kernel<T, R, A>(fastllm::cuda::RmsNormParams<T>);
#define FASTLLM_INSTANTIATE_ALL(T)     \
  FASTLLM_INSTANTIATE(T, 32, false)    \
  FASTLLM_INSTANTIATE(T, 32, true)     \
  FASTLLM_INSTANTIATE(T, 256, false)   \
  FASTLLM_INSTANTIATE(T, 256, true)
FASTLLM_INSTANTIATE_ALL(float)
FASTLLM_INSTANTIATE_ALL(__half)
FASTLLM_INSTANTIATE_ALL(__nv_bfloat16)
#undef FASTLLM_INSTANTIATE_ALL
#undef FASTLLM_INSTANTIATE
#endif
