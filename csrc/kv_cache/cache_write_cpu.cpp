// reshape_and_cache on the CPU: each new token's K and V rows copied (converted, for a cache of
// another dtype) into its cache slot.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>

#include "common/dispatch.h"
#include "kv_cache/cache_write.h"

namespace fastllm {
namespace {

// Each row converted to the cache's dtype as it is copied (rounded to nearest even, as
// Tensor.to rounds), or copied as is where the dtypes match.
template <typename scalar_t, typename cache_t>
void copy_rows_to_slots(const at::Tensor& src, at::Tensor& cache, const int64_t* slots) {
  const int64_t tokens = src.size(0), heads = src.size(1), dim = src.size(2);
  const int64_t block_size = cache.size(1);
  const int64_t in_token = src.stride(0), in_head = src.stride(1), in_dim = src.stride(2);
  const int64_t out_block = cache.stride(0), out_slot = cache.stride(1),
                out_head = cache.stride(2), out_dim = cache.stride(3);
  // Rows contiguous on both sides (the usual case: K/V are column slices of the fused QKV
  // output): one memcpy or vectorized conversion per head row instead of an element loop.
  const bool rows_contiguous = in_dim == 1 && out_dim == 1;
  const scalar_t* in = src.const_data_ptr<scalar_t>();
  cache_t* out = cache.mutable_data_ptr<cache_t>();
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;  // padding: no slot
      cache_t* row = out + (slots[t] / block_size) * out_block + (slots[t] % block_size) * out_slot;
      const scalar_t* token = in + t * in_token;
      for (int64_t h = 0; h < heads; ++h) {
        if (!rows_contiguous) {
          for (int64_t d = 0; d < dim; ++d)
            row[h * out_head + d * out_dim] = cache_t(token[h * in_head + d * in_dim]);
        } else if constexpr (std::is_same_v<scalar_t, cache_t>) {
          std::memcpy(row + h * out_head, token + h * in_head, dim * sizeof(scalar_t));
        } else {
          at::vec::convert(token + h * in_head, row + h * out_head, dim);
        }
      }
    }
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
