// The mixture-of-experts block's own CUDA kernels, free of torch headers (nvcc compiles it
// alone in the tests): the routing, the grouping of the (token, expert) pairs by expert, a GEMV
// over each pair's expert (decode), and the weighted combine. The host (moe_cuda.cu) runs the
// experts' products between them: these GEMVs for a few tokens, cuBLAS or quantized_linear's
// path per expert for more.
//
// A pair is a token's j-th choice, a = t * top_k + j; experts [tokens, top_k] (int32) and
// weights [tokens, top_k] (float32 holding values of x's dtype) are the routing's output.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/cuda_types.cuh"
#include "quantized/block_formats.h"
#include "quantized/quantized_kernels.cuh"

namespace fastllm {
namespace cuda {

constexpr int kMoeRouteWarps = 4;  // tokens per block, a warp each
constexpr int kMoeSortThreads = 256;
constexpr int kMoeCombineThreads = 256;

// Whether probability a of expert i comes before probability b of expert j in the top-k
// order: the larger first, NaN above everything (as torch.topk), ties to the lower expert.
__device__ __forceinline__ bool ranks_before(float a, int i, float b, int j) {
  const bool a_nan = a != a, b_nan = b != b;
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a != b) return a > b;
  return i < j;
}

// HF's routing, a warp per token: the softmax of its logits in float32, its top_k experts by
// probability (ranks_before), their probabilities divided by their sum if renormalize, then
// rounded to scalar_t (x's dtype). Each of the top_k rounds is a warp argmax over the experts
// not yet chosen, so any number of experts fits. Grid: ceil(tokens / kMoeRouteWarps) blocks.
template <typename logit_t, typename scalar_t>
__global__ void __launch_bounds__(kMoeRouteWarps * 32)
    moe_route_kernel(const logit_t* __restrict__ logits, int64_t logits_stride, int64_t tokens,
                     int num_experts, int top_k, bool renormalize, int32_t* __restrict__ experts,
                     float* __restrict__ weights) {
  const int lane = threadIdx.x % 32;
  const int64_t t = int64_t(blockIdx.x) * kMoeRouteWarps + threadIdx.x / 32;
  if (t >= tokens) return;  // the whole warp
  const logit_t* row = logits + t * logits_stride;
  float max = -INFINITY;
  for (int e = lane; e < num_experts; e += 32) max = fmaxf(max, to_float(row[e]));
  for (int offset = 16; offset > 0; offset /= 2)
    max = fmaxf(max, __shfl_xor_sync(0xffffffffu, max, offset));
  float sum = 0.f;
  for (int e = lane; e < num_experts; e += 32) sum += expf(to_float(row[e]) - max);
  for (int offset = 16; offset > 0; offset /= 2)
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  int32_t* chosen = experts + t * top_k;
  float* chosen_weights = weights + t * top_k;
  float total = 0.f;  // the chosen probabilities' sum, largest first
  for (int j = 0; j < top_k; ++j) {
    float best = 0.f;
    int best_e = -1;
    for (int e = lane; e < num_experts; e += 32) {
      bool taken = false;
      for (int i = 0; i < j; ++i) taken |= chosen[i] == e;
      if (taken) continue;
      const float p = expf(to_float(row[e]) - max) / sum;
      if (best_e < 0 || ranks_before(p, e, best, best_e)) {
        best = p;
        best_e = e;
      }
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other = __shfl_xor_sync(0xffffffffu, best, offset);
      const int other_e = __shfl_xor_sync(0xffffffffu, best_e, offset);
      if (other_e >= 0 && (best_e < 0 || ranks_before(other, other_e, best, best_e))) {
        best = other;
        best_e = other_e;
      }
    }
    if (lane == 0) {
      chosen[j] = best_e;
      chosen_weights[j] = best;
    }
    total += best;
    __syncwarp();  // the next round reads chosen[j]
  }
  if (lane == 0)
    for (int j = 0; j < top_k; ++j) {
      const float w = renormalize ? chosen_weights[j] / total : chosen_weights[j];
      chosen_weights[j] = to_float(from_float<scalar_t>(w));
    }
}

// counts[e] = the number of pairs routed to expert e: block e counts them.
__global__ void __launch_bounds__(kMoeSortThreads)
    moe_count_kernel(const int32_t* __restrict__ experts, int64_t pairs,
                     int32_t* __restrict__ counts) {
  __shared__ int32_t partial[kMoeSortThreads];
  const int e = blockIdx.x;
  int32_t n = 0;
  for (int64_t a = threadIdx.x; a < pairs; a += kMoeSortThreads) n += experts[a] == e;
  partial[threadIdx.x] = n;
  __syncthreads();
  for (int half = kMoeSortThreads / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) counts[e] = partial[0];
}

// The pairs sorted by expert, each expert's in pair order (so its tokens in order), without
// atomics (the same order on every run): block e finds its pairs with a block-wide prefix sum
// over the pairs, chunk by chunk, and writes them at rows offsets[e].. of the sorted order:
// rows[r] = the pair at row r, position[a] = pair a's row. offsets [num_experts + 1] is the
// prefix sum of counts; block e writes offsets[e], the last block offsets[num_experts] too.
__global__ void __launch_bounds__(kMoeSortThreads)
    moe_scatter_kernel(const int32_t* __restrict__ experts, int64_t pairs,
                       const int32_t* __restrict__ counts, int num_experts,
                       int32_t* __restrict__ offsets, int32_t* __restrict__ rows,
                       int32_t* __restrict__ position) {
  __shared__ int32_t scan[kMoeSortThreads];
  __shared__ int32_t base;
  const int e = blockIdx.x, tid = threadIdx.x;
  if (tid == 0) {
    int32_t first = 0;
    for (int i = 0; i < e; ++i) first += counts[i];
    base = first;
    offsets[e] = first;
    if (e == num_experts - 1) offsets[num_experts] = first + counts[e];
  }
  __syncthreads();
  for (int64_t chunk = 0; chunk < pairs; chunk += kMoeSortThreads) {
    const int64_t a = chunk + tid;
    const bool mine = a < pairs && experts[a] == e;
    scan[tid] = mine;
    __syncthreads();
    for (int step = 1; step < kMoeSortThreads; step *= 2) {  // inclusive prefix sum
      const int32_t left = tid >= step ? scan[tid - step] : 0;
      __syncthreads();
      scan[tid] += left;
      __syncthreads();
    }
    if (mine) {
      const int32_t r = base + scan[tid] - 1;
      rows[r] = int32_t(a);
      position[a] = r;
    }
    __syncthreads();  // every thread has read base
    if (tid == kMoeSortThreads - 1) base += scan[tid];
    __syncthreads();
  }
}

// The input row of pair a: x's row a / pair_divisor (top_k: its token's row, for the gate|up
// projection; 1: the pair's own row, for down).
template <typename scalar_t>
__device__ __forceinline__ const scalar_t* pair_input(const scalar_t* x, int64_t x_stride,
                                                      int64_t pair_divisor, int64_t a) {
  return x + (a / pair_divisor) * x_stride;
}

// y[a, n] = (pair a's input row) . (row n of pair a's expert's float weight), float32 sums
// rounded to scalar_t: one warp per (pair, weight row), lanes over the row in fixed steps of 32
// and a fixed butterfly. w: expert e's row n at e * expert_stride + n * w_stride. Grid: x =
// ceil(n_out / kGemvWarps), y = pairs pair_begin.. (up to 65535 per launch); y dense
// [pairs, n_out].
template <typename scalar_t, typename w_t>
__global__ void __launch_bounds__(kGemvWarps * 32)
    moe_gemv_kernel(const scalar_t* __restrict__ x, int64_t x_stride, int64_t pair_divisor,
                    const int32_t* __restrict__ experts, const w_t* __restrict__ w,
                    int64_t expert_stride, int64_t w_stride, scalar_t* __restrict__ y,
                    int64_t n_out, int64_t k_len, int64_t pair_begin) {
  const int lane = threadIdx.x % 32;
  const int64_t a = pair_begin + blockIdx.y;
  const int64_t n = int64_t(blockIdx.x) * kGemvWarps + threadIdx.x / 32;
  if (n >= n_out) return;  // the whole warp
  const scalar_t* xs = pair_input(x, x_stride, pair_divisor, a);
  const w_t* row = w + experts[a] * expert_stride + n * w_stride;
  float acc = 0.f;
  for (int64_t k = lane; k < k_len; k += 32) acc = fmaf(to_float(xs[k]), to_float(row[k]), acc);
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  if (lane == 0) y[a * n_out + n] = from_float<scalar_t>(acc);
}

// The same for an expert of ggml blocks (w uint8, its row n at e * expert_stride + n * w_stride
// bytes): quantized_linear's GEMV arithmetic (quantized_row_dots), one row per pair.
template <BlockFormat F, typename scalar_t>
__global__ void __launch_bounds__(kGemvWarps * 32)
    moe_quantized_gemv_kernel(const scalar_t* __restrict__ x, int64_t x_stride,
                              int64_t pair_divisor, const int32_t* __restrict__ experts,
                              const uint8_t* __restrict__ w, int64_t expert_stride,
                              int64_t w_stride, scalar_t* __restrict__ y, int64_t n_out,
                              int64_t k_len, int64_t pair_begin) {
  const int64_t a = pair_begin + blockIdx.y;
  const int64_t n = int64_t(blockIdx.x) * kGemvWarps + threadIdx.x / 32;
  if (n >= n_out) return;
  float acc[1];
  quantized_row_dots<F, 1>(pair_input(x, x_stride, pair_divisor, a), 0,
                           w + experts[a] * expert_stride + n * w_stride, k_len, acc);
  if (threadIdx.x % 32 == 0) y[a * n_out + n] = from_float<scalar_t>(acc[0]);
}

// out[t, h] = the sum over token t's pairs, in increasing expert order, of weight * y[the
// pair's row, h], each product and each partial sum rounded to scalar_t (HF's index_add_ into
// zeros, expert after expert). The pair's row is position[a], or a where position is null.
// Grid: x = ceil(hidden / kMoeCombineThreads), y = tokens token_begin.. (up to 65535).
template <typename scalar_t>
__global__ void __launch_bounds__(kMoeCombineThreads)
    moe_combine_kernel(const scalar_t* __restrict__ y, const int32_t* __restrict__ experts,
                       const float* __restrict__ weights, const int32_t* __restrict__ position,
                       int top_k, int64_t hidden, scalar_t* __restrict__ out,
                       int64_t token_begin) {
  const int64_t t = token_begin + blockIdx.y;
  const int64_t h = int64_t(blockIdx.x) * kMoeCombineThreads + threadIdx.x;
  if (h >= hidden) return;
  const int32_t* chosen = experts + t * top_k;
  float acc = 0.f;
  int previous = -1;  // the expert added last
  for (int i = 0; i < top_k; ++i) {
    int j = -1;  // the token's next expert up (a token's experts are distinct)
    for (int c = 0; c < top_k; ++c)
      if (chosen[c] > previous && (j < 0 || chosen[c] < chosen[j])) j = c;
    previous = chosen[j];
    const int64_t a = t * top_k + j;
    const int64_t row = position != nullptr ? position[a] : a;
    const float term = to_float(from_float<scalar_t>(weights[a] * to_float(y[row * hidden + h])));
    acc = to_float(from_float<scalar_t>(acc + term));
  }
  out[t * hidden + h] = from_float<scalar_t>(acc);
}

}  // namespace cuda
}  // namespace fastllm

#ifdef FASTLLM_KERNEL_COMPILE_CHECK
// Every kernel for every storage dtype (and weight dtype, and block format): taking the
// kernels' addresses instantiates them.
namespace fastllm::cuda {
template <typename T>
void instantiate_moe_kernels_for() {
  (void)&moe_route_kernel<float, T>;
  (void)&moe_route_kernel<__half, T>;
  (void)&moe_route_kernel<__nv_bfloat16, T>;
  (void)&moe_gemv_kernel<T, T>;
  (void)&moe_combine_kernel<T>;
}

void instantiate_moe_kernels(BlockFormat format) {
  instantiate_moe_kernels_for<float>();
  instantiate_moe_kernels_for<__half>();
  instantiate_moe_kernels_for<__nv_bfloat16>();
  (void)&moe_gemv_kernel<float, __half>;
  (void)&moe_gemv_kernel<float, __nv_bfloat16>;
  (void)&moe_count_kernel;
  (void)&moe_scatter_kernel;
  visit_block_format(format, [](auto f) {
    constexpr BlockFormat F = decltype(f)::value;
    (void)&moe_quantized_gemv_kernel<F, float>;
    (void)&moe_quantized_gemv_kernel<F, __half>;
    (void)&moe_quantized_gemv_kernel<F, __nv_bfloat16>;
  });
}
}  // namespace fastllm::cuda
#endif
