// reshape_and_cache on CUDA: checks, device guard and stream; the kernel is in
// cache_write_kernels.cuh.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/cuda_host.h"
#include "common/cuda_launch.cuh"
#include "common/dispatch.h"
#include "kv_cache/cache_write.h"
#include "kv_cache/cache_write_kernels.cuh"

namespace fastllm {
namespace {

void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                            at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_cache_write_inputs(key, value, k_cache, v_cache, slot_mapping);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  if (can_check_values()) check_slot_values(host_copy(slot_mapping), num_slots);
  TORCH_CHECK_VALUE(k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
                        k_cache.strides() == v_cache.strides(),
                    "on CUDA, k_cache and v_cache must share strides with a dense head_dim, got ",
                    k_cache.strides(), " and ", v_cache.strides());
  const int64_t tokens = key.size(0);
  if (tokens == 0 || key.size(1) * key.size(2) == 0) return;
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const auto k = dense_rows(key), v = dense_rows(value);
  const auto slots = slot_mapping.contiguous();
  const int elements = int(key.size(1) * key.size(2));
  const int threads = int(std::min<int64_t>(512, ceil_div(elements, 32) * 32));
  FASTLLM_DISPATCH_KV_CACHE_TYPES(key.scalar_type(), k_cache.scalar_type(),
                                  "fastllm::reshape_and_cache_cuda", [&] {
    launch_kernel(&cuda::reshape_and_cache_kernel<cuda_storage_t<scalar_t>,
                                                  cuda_storage_t<cache_t>>,
                  unsigned(tokens), threads, 0, cuda_ptr<scalar_t>(k), cuda_ptr<scalar_t>(v),
                  cuda_mutable_ptr<cache_t>(k_cache), cuda_mutable_ptr<cache_t>(v_cache),
                  slots.const_data_ptr<int64_t>(), k.stride(0), k.stride(1), v.stride(0),
                  v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  int(key.size(1)), int(key.size(2)), int(k_cache.size(1)), num_slots);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CUDA, m) { m.impl("reshape_and_cache", &reshape_and_cache_cuda); }

}  // namespace fastllm
