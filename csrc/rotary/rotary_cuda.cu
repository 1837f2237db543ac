// Rotary embedding on CUDA: checks, device guard and stream; the kernel is in rotary_kernels.cuh.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/cuda_host.h"
#include "common/cuda_launch.cuh"
#include "common/dispatch.h"
#include "rotary/rotary.h"
#include "rotary/rotary_kernels.cuh"

namespace fastllm {
namespace {

void check_positions(const at::Tensor& positions, int64_t max_position) {
  const auto pos = host_copy(positions);
  AT_DISPATCH_INDEX_TYPES(pos.scalar_type(), "fastllm::rotary_positions", [&] {
    const index_t* p = pos.const_data_ptr<index_t>();
    for (int64_t t = 0; t < pos.numel(); ++t)
      TORCH_CHECK_VALUE(p[t] >= 0 && p[t] < max_position, "positions[", t, "]=", p[t],
                        " is outside the cos_sin_cache, which covers positions [0, ",
                        max_position, ")");
  });
}

void rotary_embedding_cuda(const at::Tensor& positions, at::Tensor& q,
                           const std::optional<at::Tensor>& k, const at::Tensor& cos_sin_cache,
                           bool is_neox, std::optional<int64_t> rotary_dim) {
  const int64_t rot = check_rotary_inputs(positions, q, k, cos_sin_cache, rotary_dim);
  const int64_t max_position = cos_sin_cache.size(0);
  if (can_check_values()) check_positions(positions, max_position);
  const int64_t tokens = q.size(0);
  if (tokens == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  // The kernel reads dense head rows and table rows; other layouts work on a dense copy that is
  // written back (q and k are rotated in place).
  at::Tensor q_dense = q.stride(2) == 1 ? q : q.contiguous();
  std::optional<at::Tensor> k_dense;
  if (k.has_value()) k_dense = k->stride(2) == 1 ? *k : k->contiguous();
  const auto table = cos_sin_cache.contiguous();
  const auto pos = positions.contiguous();
  const int64_t heads = q.size(1) + (k.has_value() ? k->size(1) : 0);
  const int threads = int(std::min<int64_t>(256, ceil_div(heads * rot / 2, 32) * 32));
  FASTLLM_DISPATCH_FLOAT_TYPES(q.scalar_type(), "fastllm::rotary_embedding_cuda", [&] {
    using q_t = cuda_storage_t<scalar_t>;
    q_t* k_ptr = k_dense.has_value() ? cuda_mutable_ptr<scalar_t>(*k_dense) : nullptr;
    const int64_t k_stride_token = k_dense.has_value() ? k_dense->stride(0) : 0;
    const int64_t k_stride_head = k_dense.has_value() ? k_dense->stride(1) : 0;
    const int num_k_heads = k_dense.has_value() ? int(k_dense->size(1)) : 0;
    q_t* q_ptr = cuda_mutable_ptr<scalar_t>(q_dense);
    FASTLLM_DISPATCH_FLOAT_TYPES(table.scalar_type(), "fastllm::rotary_cache_cuda", [&] {
      using cache_t = cuda_storage_t<scalar_t>;
      const cache_t* table_ptr = cuda_ptr<scalar_t>(table);
      AT_DISPATCH_INDEX_TYPES(pos.scalar_type(), "fastllm::rotary_positions_cuda", [&] {
        launch_kernel(&cuda::rotary_embedding_kernel<q_t, cache_t, index_t>, unsigned(tokens),
                      threads, 0, pos.const_data_ptr<index_t>(), q_ptr, k_ptr, table_ptr,
                      int(rot), q_dense.stride(0), q_dense.stride(1), k_stride_token,
                      k_stride_head, int(q.size(1)), num_k_heads, is_neox, max_position);
      });
    });
  });
  if (!q_dense.is_same(q)) q.copy_(q_dense);
  if (k_dense.has_value() && !k_dense->is_same(*k)) k->copy_(*k_dense);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CUDA, m) { m.impl("rotary_embedding", &rotary_embedding_cuda); }

}  // namespace fastllm
