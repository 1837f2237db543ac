// Gated activations written with ATen ops: what a device without a native kernel runs.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "activation/activation.h"
#include "common/composite.h"

namespace fastllm {
namespace {

at::Tensor silu_and_mul_composite(const at::Tensor& x) {
  const int64_t d = check_gated_activation_inputs(x);
  return at::silu(x.narrow(1, 0, d)) * x.narrow(1, d, d);
}

at::Tensor gelu_tanh_and_mul_composite(const at::Tensor& x) {
  const int64_t d = check_gated_activation_inputs(x);
  return at::gelu(x.narrow(1, 0, d), "tanh") * x.narrow(1, d, d);
}

}  // namespace

FASTLLM_COMPOSITE_IMPL(m) {
  m.impl("silu_and_mul", &silu_and_mul_composite);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul_composite);
}

}  // namespace fastllm
