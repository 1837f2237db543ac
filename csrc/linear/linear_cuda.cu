// The linear layer on CUDA: cuBLAS through ATen, with the bias added before the one rounding to
// x's dtype (the plain composition's arithmetic). ATen's linear hands a 16-bit bias to cuBLASLt's
// bias epilogue, whose result errs more than the plain composition's against a float64
// product; a GEMM accumulating onto the broadcast bias (beta = 1) rounds once.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/cuda_host.h"
#include "linear/linear.h"

namespace fastllm {
namespace {

at::Tensor linear_cuda(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  check_linear_inputs(x, weight, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  // 16-bit weights under float32 activations are converted exactly (check_linear_inputs).
  const auto w = weight.scalar_type() == x.scalar_type() ? weight : weight.to(x.scalar_type());
  if (!bias.has_value() || x.scalar_type() == at::kFloat) return at::linear(x, w, bias);
  // clone, not contiguous(): a one-row expand is already "contiguous" and would be the bias.
  auto out = bias->expand({x.size(0), w.size(0)}).clone(at::MemoryFormat::Contiguous);
  out.addmm_(x, w.t());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CUDA, m) { m.impl("linear", &linear_cuda); }

}  // namespace fastllm
