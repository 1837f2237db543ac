// Gated activations on CUDA: checks, device guard and stream; the kernel is in
// activation_kernels.cuh.
#include <algorithm>
#include <cstdint>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "activation/activation.h"
#include "activation/activation_kernels.cuh"
#include "common/cuda_host.h"
#include "common/cuda_launch.cuh"
#include "common/dispatch.h"

namespace fastllm {
namespace {

template <typename Act>
at::Tensor gated_and_mul_cuda(const at::Tensor& x) {
  const int64_t d = check_gated_activation_inputs(x);
  auto out = at::empty({x.size(0), d}, x.options());
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t chunks = ceil_div(d, cuda::kActivationThreads);
  FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fastllm::gated_and_mul_cuda", [&] {
    for (int64_t begin = 0; begin < x.size(0); begin += kMaxGridY) {
      const int64_t rows = std::min(kMaxGridY, x.size(0) - begin);
      launch_kernel(&cuda::gated_activation_kernel<Act, cuda_storage_t<scalar_t>>,
                    dim3(unsigned(chunks), unsigned(rows)), cuda::kActivationThreads, 0,
                    cuda_ptr<scalar_t>(x), cuda_mutable_ptr<scalar_t>(out), x.stride(0), d,
                    begin);
    }
  });
  return out;
}

}  // namespace

at::Tensor silu_and_mul_cuda(const at::Tensor& x) { return gated_and_mul_cuda<cuda::Silu>(x); }

TORCH_LIBRARY_IMPL(fastllm, CUDA, m) {
  m.impl("silu_and_mul", &silu_and_mul_cuda);
  m.impl("gelu_tanh_and_mul", &gated_and_mul_cuda<cuda::GeluTanh>);
}

}  // namespace fastllm
