// Writing new tokens' K/V into paged caches: shared by the implementations of every device.
#pragma once

#include <ATen/core/Tensor.h>

namespace fastllm {

// Metadata checks: key/value [tokens, n_kv_heads, head_dim] of one dtype, caches
// [num_blocks, block_size, n_kv_heads, head_dim] of key's dtype or, under float32 key/value, of
// bfloat16 / float16 (rows converted as they are written), slot_mapping int64 [tokens].
void check_cache_write_inputs(const at::Tensor& key, const at::Tensor& value,
                              const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& slot_mapping);

// Every slot of a CPU slot_mapping is < num_blocks * block_size (negative slots are skipped).
void check_slot_values(const at::Tensor& slot_mapping_cpu, int64_t num_slots);

}  // namespace fastllm
