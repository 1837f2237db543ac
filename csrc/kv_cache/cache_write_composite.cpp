// reshape_and_cache written with ATen ops: what a device without a native kernel runs (MPS).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/composite.h"
#include "kv_cache/cache_write.h"

namespace fastllm {
namespace {

void reshape_and_cache_composite(const at::Tensor& key, const at::Tensor& value,
                                 at::Tensor& k_cache, at::Tensor& v_cache,
                                 const at::Tensor& slot_mapping) {
  check_cache_write_inputs(key, value, k_cache, v_cache, slot_mapping);
  check_slot_values(slot_mapping.to(at::kCPU).contiguous(), k_cache.size(0) * k_cache.size(1));
  const auto keep = slot_mapping.ge(0);
  const auto slots = slot_mapping.masked_select(keep);
  const auto block = slots.div(k_cache.size(1), "floor"), offset = slots.remainder(k_cache.size(1));
  const auto rows = keep.nonzero().squeeze(1);
  // Rounded to the cache's dtype first (a no-op where it is key's): index_put_ takes one dtype.
  k_cache.index_put_({block, offset}, key.index_select(0, rows).to(k_cache.scalar_type()));
  v_cache.index_put_({block, offset}, value.index_select(0, rows).to(v_cache.scalar_type()));
}

FASTLLM_COMPOSITE_IMPL(m) { m.impl("reshape_and_cache", &reshape_and_cache_composite); }

}  // namespace
}  // namespace fastllm
