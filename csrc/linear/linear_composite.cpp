// The linear layer written with ATen: what a device without a native kernel runs.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/composite.h"
#include "linear/linear.h"

namespace fastllm {
namespace {

at::Tensor linear_composite(const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
  check_linear_inputs(x, weight, bias);
  return at::linear(x, weight.to(x.scalar_type()), bias);
}

FASTLLM_COMPOSITE_IMPL(m) { m.impl("linear", &linear_composite); }

}  // namespace
}  // namespace fastllm
