#include "lora/lora.h"

#include "common/checks.h"

namespace fastllm {

void check_lora_inputs(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
                       const at::Tensor& lora_b, const at::Tensor& token_slots) {
  check_rank(y, 2, "y", "[tokens, out_features]");
  check_rank(x, 2, "x", "[tokens, in_features]");
  check_rank(lora_a, 3, "lora_a", "[slots, rank, in_features]");
  check_rank(lora_b, 3, "lora_b", "[slots, out_features, rank]");
  check_rank(token_slots, 1, "token_slots", "[tokens]");
  check_float_storage(x, "x");
  check_same_dtype(y, "y", x, "x");
  check_same_dtype(lora_a, "lora_a", x, "x");
  check_same_dtype(lora_b, "lora_b", x, "x");
  check_dtype(token_slots, at::kInt, "token_slots");
  check_same_device(y, "y", x, "x");
  check_same_device(lora_a, "lora_a", x, "x");
  check_same_device(lora_b, "lora_b", x, "x");
  check_same_device(token_slots, "token_slots", x, "x");
  const int64_t tokens = x.size(0), slots = lora_a.size(0), rank = lora_a.size(1);
  TORCH_CHECK_VALUE(y.size(0) == tokens, "y has ", y.size(0), " rows but x has ", tokens,
                    " tokens");
  TORCH_CHECK_VALUE(token_slots.size(0) == tokens, "token_slots has ", token_slots.size(0),
                    " slots but x has ", tokens, " tokens");
  TORCH_CHECK_VALUE(slots >= 1, "lora_a must hold at least one adapter slot, got shape ",
                    lora_a.sizes());
  TORCH_CHECK_VALUE(rank >= 1 && rank <= kMaxLoraRank, "the LoRA rank (lora_a's dim 1) must be "
                    "in [1, ", kMaxLoraRank, "], got ", rank);
  TORCH_CHECK_VALUE(lora_a.size(2) == x.size(1), "lora_a [slots, rank, in_features] = ",
                    lora_a.sizes(), " does not match x's ", x.size(1), " features");
  TORCH_CHECK_VALUE(lora_b.size(0) == slots && lora_b.size(1) == y.size(1) &&
                        lora_b.size(2) == rank,
                    "lora_b must be [slots, out_features, rank] = [", slots, ", ", y.size(1),
                    ", ", rank, "] (lora_a's slots and rank, y's features), got ",
                    lora_b.sizes());
  TORCH_CHECK_VALUE(y.size(1) <= 1 || y.stride(1) == 1, "y's last dim must be contiguous, got "
                    "strides ", y.strides());
  // Updated in place: an element reached twice would take its LoRA twice, and an input in y's
  // memory would change under the op.
  check_no_internal_overlap(y, "y");
  check_no_shared_memory(y, "y", x, "x");
  check_no_shared_memory(y, "y", lora_a, "lora_a");
  check_no_shared_memory(y, "y", lora_b, "lora_b");
  check_no_shared_memory(y, "y", token_slots, "token_slots");
}

void check_token_slot_values(const at::Tensor& token_slots_cpu, int64_t num_slots) {
  const int32_t* slots = token_slots_cpu.const_data_ptr<int32_t>();
  for (int64_t t = 0; t < token_slots_cpu.numel(); ++t)
    TORCH_CHECK_VALUE(slots[t] >= -1 && slots[t] < num_slots, "token_slots[", t, "]=", slots[t],
                      " is outside [-1, ", num_slots, "): -1 (no adapter) or one of lora_a's ",
                      num_slots, " slots");
}

}  // namespace fastllm
