// The linear layer written with ATen: what a device without a native kernel runs.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "linear/linear.h"

namespace fastllm {

at::Tensor linear_composite(const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
  check_linear_inputs(x, weight, bias);
  return at::linear(x, weight, bias);
}

TORCH_LIBRARY_IMPL(fastllm, CompositeExplicitAutograd, m) { m.impl("linear", &linear_composite); }

}  // namespace fastllm
