// Shared by the RMSNorm implementations of every device.
#pragma once

#include <ATen/core/Tensor.h>

namespace fastllm {

// Checks x [..., hidden] (at most 3-D, unit stride in the last dim) and weight [hidden].
void check_rms_norm_inputs(const at::Tensor& x, const at::Tensor& weight, double eps);

// Also checks residual: x's shape, dtype and device, and sharing no memory with x (the op
// writes both).
void check_add_rms_norm_inputs(const at::Tensor& x, const at::Tensor& residual,
                               const at::Tensor& weight, double eps);

}  // namespace fastllm
