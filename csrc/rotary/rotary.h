// Shared by the rotary-embedding implementations of every device.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

namespace fastllm {

// Checks the inputs' metadata and returns the number of rotated channels per head.
int64_t check_rotary_inputs(const at::Tensor& positions, const at::Tensor& q,
                            const std::optional<at::Tensor>& k, const at::Tensor& cos_sin_cache,
                            std::optional<int64_t> rotary_dim);

// Every position of a CPU positions tensor indexes a table of max_position rows.
void check_position_values(const at::Tensor& positions_cpu, int64_t max_position);

// Checks rotary_and_cache's inputs (csrc/ops.cpp) and returns the rotated channels per head (0
// without a table).
int64_t check_rotary_and_cache_inputs(
    const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k, const at::Tensor& value,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
    const std::optional<at::Tensor>& cos_sin_cache, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double eps);

// ATen composition of the op, registered for devices without a native kernel (MPS).
void rotary_embedding_composite(const at::Tensor& positions, at::Tensor& q,
                                const std::optional<at::Tensor>& k,
                                const at::Tensor& cos_sin_cache, bool is_neox,
                                std::optional<int64_t> rotary_dim);

}  // namespace fastllm
