// RMSNorm written with ATen ops: what a device without a native kernel runs. HF's arithmetic:
// normalized in float32, rounded to x's dtype, then scaled by the weight in that dtype.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/composite.h"
#include "norm/norm.h"

namespace fastllm {
namespace {

at::Tensor normalize(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto x32 = x.to(at::kFloat);
  const auto normed = x32 * at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * normed.to(x.scalar_type());
}

at::Tensor rms_norm_composite(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm_inputs(x, weight, eps);
  return normalize(x, weight, eps);
}

void add_rms_norm_composite(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                            double eps) {
  check_add_rms_norm_inputs(x, residual, weight, eps);
  residual.add_(x);
  x.copy_(normalize(residual, weight, eps));
}

}  // namespace

FASTLLM_COMPOSITE_IMPL(m) {
  m.impl("rms_norm", &rms_norm_composite);
  m.impl("add_rms_norm", &add_rms_norm_composite);
}

}  // namespace fastllm
