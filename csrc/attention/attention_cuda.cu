// Varlen attention on CUDA: checks, device guard, stream and kernel choice; the kernels are in
// attention_kernels.cuh. bfloat16/float16 with head_dim <= 256 run the tensor-core kernel (head_dim
// padded up to 64, 80, 96, 128 or 256), float32 the SIMT kernel; head_dim > 256, which no kernel
// is built for, runs the ATen composition. A soft-cap (softcap > 0) runs the kernels' kSoftcap
// instantiations.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "attention/attention.h"
#include "attention/attention_kernels.cuh"
#include "attention/attention_launch.cuh"
#include "common/cuda_host.h"
#include "common/dispatch.h"

namespace fastllm {
namespace {

constexpr int64_t kMaxKernelHeadDim = 256;
constexpr int64_t kMaxTokens = INT32_MAX - 256;

template <typename T, int kDimsPerLane, bool kSoftcap>
bool launch_simt(const cuda::VarlenAttentionParams<T>& params, int64_t query_rows, int max_smem) {
  using Shape = cuda::SimtShape<kDimsPerLane>;
  if (params.head_dim > Shape::kDims || Shape::kSmemBytes > max_smem) return false;
  launch_attention_grid(cuda::attention_simt_kernel<T, kDimsPerLane, kSoftcap>, params,
                        Shape::kBlockM, Shape::kSmemBytes, query_rows);
  return true;
}

// The smallest kernel configuration that takes head_dim; false when none fits the device.
template <typename T, bool kSoftcap>
bool launch_attention(const cuda::VarlenAttentionParams<T>& params, int64_t query_rows) {
  const int max_smem = max_shared_memory_per_block();
  if constexpr (!std::is_same_v<T, float>) {
    if (launch_tensor_core_attention<T, kSoftcap, false>(params, query_rows, max_smem))
      return true;
  }
  return launch_simt<T, 1, kSoftcap>(params, query_rows, max_smem) ||
         launch_simt<T, 2, kSoftcap>(params, query_rows, max_smem) ||
         launch_simt<T, 3, kSoftcap>(params, query_rows, max_smem) ||
         launch_simt<T, 4, kSoftcap>(params, query_rows, max_smem) ||
         launch_simt<T, 6, kSoftcap>(params, query_rows, max_smem) ||
         launch_simt<T, 8, kSoftcap>(params, query_rows, max_smem);
}

void attention_out_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                        int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                        std::optional<double> scale, int64_t window_left, at::Tensor& out,
                        double softcap) {
  const AttentionDims dims = check_attention_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                    max_seqlen_q, max_seqlen_k, window_left,
                                                    softcap);
  check_attention_out(out, q, k, v);
  if (can_check_values()) {
    check_cu_seqlens_values(host_copy(cu_seqlens_q), q.size(0), max_seqlen_q, "cu_seqlens_q");
    check_cu_seqlens_values(host_copy(cu_seqlens_k), k.size(0), max_seqlen_k, "cu_seqlens_k");
  }
  const double softmax_scale = resolve_attention_scale(scale, dims.head_dim);
  // The kernels index tokens with int32, as cu_seqlens do, with a tile's worth of headroom.
  TORCH_CHECK_VALUE(q.size(0) <= kMaxTokens && k.size(0) <= kMaxTokens, "attention takes at most ",
                    kMaxTokens, " packed tokens, got q with ", q.size(0), " and k with ",
                    k.size(0));
  if (dims.head_dim > kMaxKernelHeadDim) {
    attention_out_composite(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            causal, scale, window_left, out, softcap);
    return;
  }
  // No sequence is longer than max_seqlen_q (checked above) nor than all of q.
  const int64_t query_rows = std::min(max_seqlen_q, q.size(0));
  if (query_rows == 0 || dims.batch == 0) return;

  const c10::cuda::CUDAGuard guard(q.device());
  const auto q_rows = dense_rows(q), k_rows = dense_rows(k), v_rows = dense_rows(v);
  const auto cu_q = cu_seqlens_q.contiguous(), cu_k = cu_seqlens_k.contiguous();
  bool launched = false;
  FASTLLM_DISPATCH_FLOAT_TYPES(q.scalar_type(), "fastllm::attention_cuda", [&] {
    using T = cuda_storage_t<scalar_t>;
    auto params = query_params<T>(q_rows, out, cu_q, dims.batch, dims.n_heads, dims.n_kv_heads,
                                  causal, softmax_scale, softcap);
    params.k = cuda_ptr<scalar_t>(k_rows);
    params.v = cuda_ptr<scalar_t>(v_rows);
    params.cu_seqlens_k = cu_k.const_data_ptr<int32_t>();
    params.k_stride_token = k_rows.stride(0);
    params.k_stride_head = k_rows.stride(1);
    params.v_stride_token = v_rows.stride(0);
    params.v_stride_head = v_rows.stride(1);
    params.total_k = int(k.size(0));
    // A window of at least total_k keys never excludes a visible key: the same as none.
    params.window_left = window_left < 0 || window_left >= k.size(0) ? -1 : int(window_left);
    params.vector_loads =
        has_16_byte_rows(q_rows) && has_16_byte_rows(k_rows) && has_16_byte_rows(v_rows);
    launched = softcap > 0.0 ? launch_attention<T, true>(params, query_rows)
                             : launch_attention<T, false>(params, query_rows);
  });
  if (!launched)  // no kernel configuration fits this device's shared memory
    attention_out_composite(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            causal, scale, window_left, out, softcap);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CUDA, m) {
  m.impl("attention", &attention_op<attention_out_cuda>);
  m.impl("attention_out", &attention_out_cuda);
}

}  // namespace fastllm
