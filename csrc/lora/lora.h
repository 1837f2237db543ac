// Shared by the batched LoRA implementations of every device.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace fastllm {

// The largest adapter rank add_lora takes, on every device: the CUDA expand kernel keeps a
// token's shrink result (rank floats) in shared memory.
constexpr int64_t kMaxLoraRank = 1024;

// Metadata checks of add_lora: y [tokens, out] (unit stride in its last dim, no element reached
// twice, sharing no memory with the inputs), x [tokens, in], lora_a [slots, rank, in] and
// lora_b [slots, out, rank] of one float dtype, token_slots int32 [tokens], all on x's device;
// slots >= 1 and 1 <= rank <= kMaxLoraRank.
void check_lora_inputs(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
                       const at::Tensor& lora_b, const at::Tensor& token_slots);

// Every value of a CPU token_slots is in [-1, num_slots).
void check_token_slot_values(const at::Tensor& token_slots_cpu, int64_t num_slots);

}  // namespace fastllm
