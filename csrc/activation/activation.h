// Shared by the gated-activation implementations of every device.
#pragma once

#include <ATen/core/Tensor.h>

namespace fastllm {

// Checks x [rows, 2 * d] (gate | up halves) and returns d.
int64_t check_silu_and_mul_inputs(const at::Tensor& x);

// The CUDA implementation (activation_cuda.cu; CUDA builds only), for other CUDA host files
// (moe's experts).
at::Tensor silu_and_mul_cuda(const at::Tensor& x);

}  // namespace fastllm
