// RMSNorm on CUDA: checks, device guard and stream; the kernel is in norm_kernels.cuh.
#include <algorithm>
#include <cstdint>
#include <limits>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/cuda_host.h"
#include "common/cuda_launch.cuh"
#include "common/dispatch.h"
#include "norm/norm.h"
#include "norm/norm_kernels.cuh"

namespace fastllm {
namespace {

// Rows up to this long take a warp each (q/k heads), longer ones a block (hidden states).
constexpr int64_t kMaxWarpRow = 512;

template <typename scalar_t, bool kAddResidual>
void launch_rms_norm(const cuda::RmsNormParams<scalar_t>& params) {
  if (params.hidden <= kMaxWarpRow) {
    constexpr int64_t rows_per_block = cuda::kNormThreads / 32;
    launch_kernel(&cuda::rms_norm_kernel<scalar_t, 32, kAddResidual>,
                  unsigned(ceil_div(params.rows, rows_per_block)), cuda::kNormThreads, 0, params);
  } else {
    launch_kernel(&cuda::rms_norm_kernel<scalar_t, cuda::kNormThreads, kAddResidual>,
                  unsigned(params.rows), cuda::kNormThreads, 0, params);
  }
}

// The rows of x [..., hidden] (at most 3-D) as [outer, inner, hidden].
template <typename T>
cuda::RmsNormParams<T> row_params(const at::Tensor& x, const at::Tensor& weight, double eps) {
  cuda::RmsNormParams<T> p{};
  p.inner = x.dim() == 3 ? int(x.size(1)) : 1;
  p.rows = x.dim() == 1 ? 1 : x.size(0) * p.inner;
  p.stride_outer = x.dim() == 1 ? 0 : x.stride(0);
  p.stride_inner = x.dim() == 3 ? x.stride(1) : 0;
  p.hidden = int(x.size(-1));
  p.weight = reinterpret_cast<const T*>(weight.const_data_ptr());
  p.eps = float(eps);
  return p;
}

void check_launch_sizes(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.size(-1) <= std::numeric_limits<int32_t>::max() &&
                        (x.dim() < 3 || x.size(1) <= std::numeric_limits<int32_t>::max()),
                    "rms_norm on CUDA takes rows of at most 2^31 - 1 elements, got shape ",
                    x.sizes());
  TORCH_CHECK_VALUE(x.numel() / std::max<int64_t>(x.size(-1), 1) <=
                        std::numeric_limits<int32_t>::max(),
                    "rms_norm on CUDA takes at most 2^31 - 1 rows, got shape ", x.sizes());
}

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm_inputs(x, weight, eps);
  check_launch_sizes(x);
  auto out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  const c10::cuda::CUDAGuard guard(x.device());
  const auto w = weight.contiguous();
  FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fastllm::rms_norm_cuda", [&] {
    using T = cuda_storage_t<scalar_t>;
    auto params = row_params<T>(x, w, eps);
    params.x = cuda_ptr<scalar_t>(x);
    params.out = cuda_mutable_ptr<scalar_t>(out);
    launch_rms_norm<T, false>(params);
  });
  return out;
}

void add_rms_norm_cuda(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                       double eps) {
  check_add_rms_norm_inputs(x, residual, weight, eps);
  check_launch_sizes(x);
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const auto w = weight.contiguous();
  FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fastllm::add_rms_norm_cuda", [&] {
    using T = cuda_storage_t<scalar_t>;
    // Both contiguous (checked): rows of [rows, hidden].
    auto params = row_params<T>(x.view({-1, x.size(-1)}), w, eps);
    params.x = cuda_ptr<scalar_t>(x);
    params.residual = cuda_mutable_ptr<scalar_t>(residual);
    params.out = cuda_mutable_ptr<scalar_t>(x);
    launch_rms_norm<T, true>(params);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CUDA, m) {
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("add_rms_norm", &add_rms_norm_cuda);
}

}  // namespace fastllm
