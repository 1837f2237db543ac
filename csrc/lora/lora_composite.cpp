// Batched LoRA written with ATen ops: what a device without a native kernel runs (MPS). The
// arithmetic never waits for the device: every token is shrunk against all the adapters at
// once, the results of the slots not its own zeroed, and the expand takes every adapter's B as
// one matrix; the work grows with the number of slots, which is small.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/composite.h"
#include "common/trusted_inputs.h"
#include "lora/lora.h"

namespace fastllm {
namespace {

void add_lora_composite(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
                        const at::Tensor& lora_b, const at::Tensor& token_slots) {
  check_lora_inputs(y, x, lora_a, lora_b, token_slots);
  const int64_t tokens = x.size(0), slots = lora_a.size(0), rank = lora_a.size(1);
  // Reading the slots waits for the device: only for callers that do not vouch for them. A slot
  // outside [0, slots) matches no adapter below, so its token is left as it is.
  if (!trusted_inputs()) check_token_slot_values(token_slots.to(at::kCPU).contiguous(), slots);
  const auto float_options = x.options().dtype(at::kFloat);
  // [tokens, slots * rank]: each token against every adapter's A, summed in float32 and rounded
  // to x's dtype.
  auto h = at::mm(x.to(at::kFloat), lora_a.reshape({slots * rank, x.size(1)}).to(at::kFloat).t())
               .to(x.scalar_type())
               .to(at::kFloat);
  const auto own_slot = token_slots.view({tokens, 1, 1})
                            .eq(at::arange(slots, token_slots.options()).view({1, slots, 1}));
  h.view({tokens, slots, rank}).masked_fill_(own_slot.logical_not(), 0);
  // [slots * rank, out]: row s * rank + r is column r of adapter s's B.
  const auto b = at::empty({slots, rank, y.size(1)}, float_options)
                     .copy_(lora_b.transpose(1, 2))
                     .view({slots * rank, y.size(1)});
  y.copy_(at::addmm(y.to(at::kFloat), h, b));
}

}  // namespace

FASTLLM_COMPOSITE_IMPL(m) { m.impl("add_lora", &add_lora_composite); }

}  // namespace fastllm
