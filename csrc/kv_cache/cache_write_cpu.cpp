// reshape_and_cache on the CPU: each new token's K and V rows copied (converted, for a cache of
// another dtype) into its cache slot.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/dispatch.h"
#include "kv_cache/cache_write.h"
#include "kv_cache/cache_write_cpu_kernel.h"

namespace fastllm {
namespace {

// Each token's rows copied to its slot (copy_token_rows); negative slots are padding.
template <typename scalar_t, typename cache_t>
void copy_rows_to_slots(const at::Tensor& src, at::Tensor& cache, const int64_t* slots) {
  const scalar_t* in = src.const_data_ptr<scalar_t>();
  cache_t* out = cache.mutable_data_ptr<cache_t>();
  at::parallel_for(0, src.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      if (slots[t] >= 0) copy_token_rows(in + t * src.stride(0), src, out, cache, slots[t]);
  });
}

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_cache_write_inputs(key, value, k_cache, v_cache, slot_mapping);
  const auto slots = slot_mapping.contiguous();
  // All slots are checked before anything is written: bad input leaves the caches unchanged.
  check_slot_values(slots, k_cache.size(0) * k_cache.size(1));
  FASTLLM_DISPATCH_KV_CACHE_TYPES(key.scalar_type(), k_cache.scalar_type(),
                                  "fastllm::reshape_and_cache_cpu", [&] {
    copy_rows_to_slots<scalar_t, cache_t>(key, k_cache, slots.const_data_ptr<int64_t>());
    copy_rows_to_slots<scalar_t, cache_t>(value, v_cache, slots.const_data_ptr<int64_t>());
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CPU, m) { m.impl("reshape_and_cache", &reshape_and_cache_cpu); }

}  // namespace fastllm
