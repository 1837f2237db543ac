// Shared by the linear-layer implementations of every device.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

namespace fastllm {

// Checks x [rows, in_features], weight [out_features, in_features] (rows contiguous) and the
// optional bias [out_features]: one float dtype, one device.
void check_linear_inputs(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias);

}  // namespace fastllm
