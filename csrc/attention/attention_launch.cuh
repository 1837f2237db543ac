// Host-side launch of the varlen attention kernels (attention_kernels.cuh), shared by
// attention_cuda.cu (packed K/V) and paged_attention_cuda.cu (its chunked prefill on tensor
// cores, K/V read through the block tables).
#pragma once

#include <cstdint>

#include <ATen/ATen.h>

#include "attention/attention.h"
#include "attention/attention_kernels.cuh"
#include "common/cuda_host.h"
#include "common/cuda_launch.cuh"

namespace fastllm {

// Whether t's [tokens, heads, head_dim] rows can move in 16-byte chunks.
inline bool has_16_byte_rows(const at::Tensor& t) {
  const int64_t per_chunk = 16 / t.element_size();
  return t.stride(2) == 1 && t.size(2) % per_chunk == 0 && t.stride(0) % per_chunk == 0 &&
         t.stride(1) % per_chunk == 0 &&
         reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

inline int max_shared_memory_per_block() {
  int device = 0, bytes = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return bytes;
}

// The parameters of the queries, the output and the softmax; the caller sets K and V's (and
// window_left).
template <typename T>
cuda::VarlenAttentionParams<T> query_params(const at::Tensor& q_rows, const at::Tensor& out,
                                            const at::Tensor& cu_seqlens_q, int64_t batch,
                                            int64_t n_heads, int64_t n_kv_heads, bool causal,
                                            double softmax_scale, double softcap) {
  cuda::VarlenAttentionParams<T> params{};
  params.q = reinterpret_cast<const T*>(q_rows.const_data_ptr());
  params.out = reinterpret_cast<T*>(out.mutable_data_ptr());
  params.cu_seqlens_q = cu_seqlens_q.const_data_ptr<int32_t>();
  params.q_stride_token = q_rows.stride(0);
  params.q_stride_head = q_rows.stride(1);
  params.out_stride_token = out.stride(0);
  params.out_stride_head = out.stride(1);
  params.out_stride_dim = out.stride(2);
  params.total_q = int(q_rows.size(0));
  params.batch = int(batch);
  params.n_heads = int(n_heads);
  params.group = int(n_heads / n_kv_heads);
  params.head_dim = int(q_rows.size(2));
  params.causal = causal;
  params.vector_stores = has_16_byte_rows(out);
  params.scale_log2 = float(softmax_scale * kLog2e);
  params.softcap = float(softcap);
  params.softcap_inv_log2 = softcap > 0.0 ? float(1.0 / (softcap * kLog2e)) : 0.f;
  return params;
}

// Launches one thread block per (query tile of block_m rows, sequence, head).
template <typename Params>
void launch_attention_grid(void (*kernel)(Params), Params params, int block_m, int smem_bytes,
                           int64_t query_rows) {
  const int64_t query_tiles = ceil_div(query_rows, block_m);
  const int64_t blocks = query_tiles * params.batch * params.n_heads;
  TORCH_CHECK_VALUE(blocks <= INT32_MAX, "attention needs ", blocks,
                    " thread blocks (query tiles x batch x heads), more than a CUDA grid holds");
  params.query_tiles = int(query_tiles);
  if (smem_bytes > 48 * 1024)
    C10_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  launch_kernel(kernel, unsigned(blocks), cuda::kAttentionThreads, smem_bytes, params);
}

// Launches the tensor-core kernel padded to kHeadDim if head_dim fits it and its shared memory
// fits the device.
template <typename T, int kHeadDim, bool kSoftcap, bool kPaged>
bool launch_tensor_core(const cuda::VarlenAttentionParams<T>& params, int64_t query_rows,
                        int max_smem) {
  using Shape = cuda::TensorCoreShape<kHeadDim>;
  constexpr int kSmemBytes = kPaged ? Shape::kPagedSmemBytes : Shape::kSmemBytes;
  if (params.head_dim > kHeadDim || kSmemBytes > max_smem) return false;
  launch_attention_grid(cuda::attention_tensor_core_kernel<T, kHeadDim, kSoftcap, kPaged>, params,
                        Shape::kBlockM, kSmemBytes, query_rows);
  return true;
}

// The smallest tensor-core configuration that takes head_dim; false when none fits the device.
template <typename T, bool kSoftcap, bool kPaged>
bool launch_tensor_core_attention(const cuda::VarlenAttentionParams<T>& params,
                                  int64_t query_rows, int max_smem) {
  return launch_tensor_core<T, 64, kSoftcap, kPaged>(params, query_rows, max_smem) ||
         launch_tensor_core<T, 80, kSoftcap, kPaged>(params, query_rows, max_smem) ||
         launch_tensor_core<T, 96, kSoftcap, kPaged>(params, query_rows, max_smem) ||
         launch_tensor_core<T, 128, kSoftcap, kPaged>(params, query_rows, max_smem) ||
         launch_tensor_core<T, 256, kSoftcap, kPaged>(params, query_rows, max_smem);
}

}  // namespace fastllm
