#include "common/checks.h"
#include "kv_cache/cache_write.h"

namespace fastllm {

void check_cache_write_inputs(const at::Tensor& key, const at::Tensor& value,
                              const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& slot_mapping) {
  check_rank(key, 3, "key", "[tokens, n_kv_heads, head_dim]");
  check_rank(value, 3, "value", "[tokens, n_kv_heads, head_dim]");
  check_paged_caches(k_cache, v_cache);
  check_float_storage(key, "key");
  check_same_dtype(value, "value", key, "key");
  check_kv_cache_dtype(k_cache, "k_cache", key, "key");
  for (const auto& [t, name] : {std::pair(&key, "key"), std::pair(&value, "value"),
                                std::pair(&slot_mapping, "slot_mapping")})
    check_same_device(*t, name, k_cache, "k_cache");
  check_dtype(slot_mapping, at::kLong, "slot_mapping");
  check_rank(slot_mapping, 1, "slot_mapping", "[tokens]");
  TORCH_CHECK_VALUE(key.sizes() == value.sizes(), "key and value must have the same shape, got ",
                    key.sizes(), " and ", value.sizes());
  TORCH_CHECK_VALUE(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3),
                    "key rows [n_kv_heads, head_dim] = ", key.sizes().slice(1),
                    " do not match the cache's ", k_cache.sizes().slice(2));
  TORCH_CHECK_VALUE(slot_mapping.size(0) == key.size(0), "slot_mapping has ",
                    slot_mapping.size(0), " slots but key has ", key.size(0), " tokens");
  // Written in place: a slot reached through two indices, or a cache that is the other cache or
  // an input, would take the wrong rows.
  check_no_internal_overlap(k_cache, "k_cache");
  check_no_internal_overlap(v_cache, "v_cache");
  check_no_shared_memory(k_cache, "k_cache", v_cache, "v_cache");
  for (const auto& [cache, cache_name] :
       {std::pair(&k_cache, "k_cache"), std::pair(&v_cache, "v_cache")})
    for (const auto& [input, input_name] : {std::pair(&key, "key"), std::pair(&value, "value")})
      check_no_shared_memory(*cache, cache_name, *input, input_name);
}

void check_slot_values(const at::Tensor& slot_mapping_cpu, int64_t num_slots) {
  const int64_t* slots = slot_mapping_cpu.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < slot_mapping_cpu.numel(); ++i)
    TORCH_CHECK_VALUE(slots[i] < num_slots, "slot_mapping[", i, "]=", slots[i],
                      " is past the cache's ", num_slots, " slots (num_blocks * block_size)");
}

}  // namespace fastllm
