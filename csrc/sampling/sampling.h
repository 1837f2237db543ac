// Shared by the sampling implementations of every device.
#pragma once

#include <algorithm>
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

namespace fastllm {

// Metadata checks of the sample op's inputs (ranks, dtypes, devices, row counts).
void check_sample_inputs(const at::Tensor& logits, const at::Tensor& temperature,
                         const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                         const at::Tensor& seeds, const at::Tensor& offsets);

// Value checks of the per-row parameters, given as CPU tensors.
void check_sample_params(const at::Tensor& temperature, const at::Tensor& top_p,
                         const at::Tensor& min_p);

void check_penalties_inputs(const at::Tensor& logits, const at::Tensor& prompt_mask,
                            const at::Tensor& output_counts,
                            const at::Tensor& repetition_penalty,
                            const at::Tensor& frequency_penalty, const at::Tensor& presence_penalty,
                            const std::optional<at::Tensor>& logit_bias);

// Value checks of the penalties, given as CPU tensors.
void check_penalty_values(const at::Tensor& repetition_penalty, const at::Tensor& frequency_penalty,
                          const at::Tensor& presence_penalty);

// A device's sampler: checks its inputs, then writes tokens and, when token_logprobs is given,
// the log-probabilities (top_ids / top_logprobs [batch, num_logprobs]).
using SampleImpl = void (*)(const at::Tensor& logits, const at::Tensor& temperature,
                            const at::Tensor& top_k, const at::Tensor& top_p,
                            const at::Tensor& min_p, const at::Tensor& seeds,
                            const at::Tensor& offsets, int64_t num_logprobs, at::Tensor& tokens,
                            at::Tensor* token_logprobs, at::Tensor* top_ids,
                            at::Tensor* top_logprobs);

// The sample op around a device's sampler: allocates the tokens it fills.
template <SampleImpl impl>
at::Tensor sample_op(const at::Tensor& logits, const at::Tensor& temperature,
                     const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                     const at::Tensor& seeds, const at::Tensor& offsets) {
  auto tokens = at::empty({logits.dim() == 2 ? logits.size(0) : 0},
                          logits.options().dtype(at::kLong));
  impl(logits, temperature, top_k, top_p, min_p, seeds, offsets, 0, tokens, nullptr, nullptr,
       nullptr);
  return tokens;
}

// The sample_with_logprobs op around a device's sampler: allocates every output it fills.
template <SampleImpl impl>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sample_with_logprobs_op(
    const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
    const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& seeds,
    const at::Tensor& offsets, int64_t num_logprobs) {
  const int64_t batch = logits.dim() == 2 ? logits.size(0) : 0;
  const int64_t n = std::max<int64_t>(num_logprobs, 0);
  auto tokens = at::empty({batch}, logits.options().dtype(at::kLong));
  auto token_logprobs = at::empty({batch}, logits.options().dtype(at::kFloat));
  auto top_ids = at::empty({batch, n}, logits.options().dtype(at::kLong));
  auto top_logprobs = at::empty({batch, n}, logits.options().dtype(at::kFloat));
  impl(logits, temperature, top_k, top_p, min_p, seeds, offsets, num_logprobs, tokens,
       &token_logprobs, &top_ids, &top_logprobs);
  return {tokens, token_logprobs, top_ids, top_logprobs};
}

}  // namespace fastllm
