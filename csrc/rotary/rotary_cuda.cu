// Rotary embedding, and rotary_and_cache, on CUDA: checks, device guard and stream; the kernels
// are in rotary_kernels.cuh.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/cuda_host.h"
#include "common/cuda_launch.cuh"
#include "common/dispatch.h"
#include "kv_cache/cache_write.h"
#include "rotary/rotary.h"
#include "rotary/rotary_kernels.cuh"

namespace fastllm {
namespace {

void check_positions(const at::Tensor& positions, int64_t max_position) {
  check_position_values(host_copy(positions), max_position);
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

void rotary_and_cache_cuda(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                           const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& slot_mapping,
                           const std::optional<at::Tensor>& cos_sin_cache,
                           const std::optional<at::Tensor>& q_norm,
                           const std::optional<at::Tensor>& k_norm, double eps, bool is_neox,
                           bool rotate_keys) {
  const int64_t rot = check_rotary_and_cache_inputs(positions, q, k, value, k_cache, v_cache,
                                                    slot_mapping, cos_sin_cache, q_norm, k_norm,
                                                    eps);
  TORCH_CHECK_VALUE(k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides(),
                    "on CUDA, k_cache and v_cache must share strides with a dense head_dim, got ",
                    k_cache.strides(), " and ", v_cache.strides());
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  if (can_check_values()) {
    if (rot > 0) check_positions(positions, cos_sin_cache->size(0));
    check_slot_values(host_copy(slot_mapping), num_slots);
  }
  const int64_t tokens = q.size(0);
  if (tokens == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t head_dim = q.size(2);
  const size_t smem = size_t(cuda::kRotaryCacheThreads / 32) * head_dim * sizeof(float);
  TORCH_CHECK_VALUE(smem <= 48 * 1024, "rotary_and_cache on CUDA takes head_dim up to ",
                    48 * 1024 / (cuda::kRotaryCacheThreads / 32 * sizeof(float)), ", got ",
                    head_dim);
  const auto table = rot > 0 ? cos_sin_cache->contiguous() : at::Tensor();
  const auto pos = positions.contiguous();
  const auto slots = slot_mapping.contiguous();
  const auto qn = q_norm.has_value() ? q_norm->contiguous() : at::Tensor();
  const auto kn = k_norm.has_value() ? k_norm->contiguous() : at::Tensor();
  const auto table_type = rot > 0 ? table.scalar_type() : at::kFloat;
  FASTLLM_DISPATCH_KV_CACHE_TYPES(q.scalar_type(), k_cache.scalar_type(),
                                  "fastllm::rotary_and_cache_cuda", [&] {
    using T = cuda_storage_t<scalar_t>;
    using C = cuda_storage_t<cache_t>;
    const T* q_norm_ptr = qn.defined() ? cuda_ptr<scalar_t>(qn) : nullptr;
    const T* k_norm_ptr = kn.defined() ? cuda_ptr<scalar_t>(kn) : nullptr;
    T* q_ptr = cuda_mutable_ptr<scalar_t>(q);
    T* k_ptr = cuda_mutable_ptr<scalar_t>(k);
    const T* v_ptr = cuda_ptr<scalar_t>(value);
    C* k_cache_ptr = cuda_mutable_ptr<cache_t>(k_cache);
    C* v_cache_ptr = cuda_mutable_ptr<cache_t>(v_cache);
    FASTLLM_DISPATCH_FLOAT_TYPES(table_type, "fastllm::rotary_and_cache_table", [&] {
      using table_t = cuda_storage_t<scalar_t>;
      AT_DISPATCH_INDEX_TYPES(pos.scalar_type(), "fastllm::rotary_and_cache_positions", [&] {
        cuda::RotaryAndCacheParams<T, C, table_t, index_t> p{};
        p.positions = pos.const_data_ptr<index_t>();
        p.q = q_ptr;
        p.k = k_ptr;
        p.v = v_ptr;
        p.k_cache = k_cache_ptr;
        p.v_cache = v_cache_ptr;
        p.slot_mapping = slots.const_data_ptr<int64_t>();
        p.cos_sin = rot > 0 ? cuda_ptr<scalar_t>(table) : nullptr;
        p.q_norm = q_norm_ptr;
        p.k_norm = k_norm_ptr;
        for (int d = 0; d < 3; ++d) {
          p.q_stride[d] = q.stride(d);
          p.k_stride[d] = k.stride(d);
          p.v_stride[d] = value.stride(d);
        }
        p.cache_stride_block = k_cache.stride(0);
        p.cache_stride_slot = k_cache.stride(1);
        p.cache_stride_head = k_cache.stride(2);
        p.num_slots = num_slots;
        p.max_position = rot > 0 ? table.size(0) : 0;
        p.num_q_heads = int(q.size(1));
        p.num_kv_heads = int(k.size(1));
        p.head_dim = int(head_dim);
        p.rot_dim = int(rot);
        p.block_size = int(k_cache.size(1));
        p.eps = float(eps);
        p.is_neox = is_neox;
        p.rotate_keys = rotate_keys;
        launch_kernel(&cuda::rotary_and_cache_kernel<T, C, table_t, index_t>, unsigned(tokens),
                      cuda::kRotaryCacheThreads, smem, p);
      });
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CUDA, m) {
  m.impl("rotary_embedding", &rotary_embedding_cuda);
  m.impl("rotary_and_cache", &rotary_and_cache_cuda);
}

}  // namespace fastllm
