// Shared by the gated-activation implementations of every device.
#pragma once

#include <ATen/core/Tensor.h>

namespace fastllm {

// Checks the input of a gated activation (silu_and_mul, gelu_tanh_and_mul): x [rows, 2 * d]
// (gate | up halves) with a contiguous last dim; returns d.
int64_t check_gated_activation_inputs(const at::Tensor& x);

// The CUDA implementation (activation_cuda.cu; CUDA builds only), for other CUDA host files
// (moe's experts).
at::Tensor silu_and_mul_cuda(const at::Tensor& x);

}  // namespace fastllm
