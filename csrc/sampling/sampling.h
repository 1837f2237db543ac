// Shared by the sampling implementations of every device.
#pragma once

#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>

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

// ATen compositions, registered for devices without a native kernel (MPS).
at::Tensor sample_composite(const at::Tensor& logits, const at::Tensor& temperature,
                            const at::Tensor& top_k, const at::Tensor& top_p,
                            const at::Tensor& min_p, const at::Tensor& seeds,
                            const at::Tensor& offsets);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sample_with_logprobs_composite(
    const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
    const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& seeds,
    const at::Tensor& offsets, int64_t num_logprobs);
void apply_penalties_composite(at::Tensor& logits, const at::Tensor& prompt_mask,
                               const at::Tensor& output_counts,
                               const at::Tensor& repetition_penalty,
                               const at::Tensor& frequency_penalty,
                               const at::Tensor& presence_penalty,
                               const std::optional<at::Tensor>& logit_bias);

}  // namespace fastllm
