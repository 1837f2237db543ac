// The linear layer on CUDA: cuBLAS through ATen, with a 16-bit product's bias added before the
// one rounding to x's dtype (the plain composition's arithmetic). A 16-bit GEMM that adds the bias
// itself (cuBLASLt's bias epilogue, or beta = 1 onto the bias) may round the product before the
// sum, or reduce split-K partials in 16 bits: the product in float32 rounds once.
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
  const auto product = at::mm(x, w.t(), at::kFloat);
  // One kernel: the sum in float32, rounded once as it is stored in x's dtype.
  auto out = at::empty({x.size(0), w.size(0)}, x.options());
  return at::add_out(out, product, *bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CUDA, m) { m.impl("linear", &linear_cuda); }

}  // namespace fastllm
