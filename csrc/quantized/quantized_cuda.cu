// Block-quantized matmul on CUDA: checks, device guard, stream and dispatch; the kernels are in
// quantized_kernels.cuh. Decode rows (up to cuda::kMaxGemvRows) stream the weight once through
// the GEMV; more rows dequantize the weight to x's dtype and multiply with cuBLAS.
#include <cstdint>
#include <optional>
#include <utility>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/cuda_host.h"
#include "common/cuda_launch.cuh"
#include "common/dispatch.h"
#include "quantized/quantized.h"
#include "quantized/quantized_kernels.cuh"

namespace fastllm {

at::Tensor dequantize_cuda(const at::Tensor& weight, int64_t weight_type, at::ScalarType dtype) {
  int64_t in_features = 0;
  const BlockFormat format = check_quantized_weight(weight, weight_type, in_features);
  const int64_t rows = weight.size(0);
  // The kernel writes the float storage types; any other dtype is converted from float32.
  const bool direct = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
  auto out = at::empty({rows, in_features}, weight.options().dtype(direct ? dtype : at::kFloat));
  const int64_t parts = rows * (in_features / cuda::kPartValues);
  if (parts > 0) {
    const c10::cuda::CUDAGuard guard(weight.device());
    // Within the grid's 2^31 - 1 blocks for any weight under 2 TiB.
    const auto blocks = unsigned(ceil_div(parts, cuda::kDequantizeThreads));
    visit_block_format(format, [&](auto f) {
      constexpr BlockFormat F = decltype(f)::value;
      FASTLLM_DISPATCH_FLOAT_TYPES(out.scalar_type(), "fastllm::dequantize_cuda", [&] {
        launch_kernel(&cuda::dequantize_kernel<F, cuda_storage_t<scalar_t>>, blocks,
                      cuda::kDequantizeThreads, 0, weight.const_data_ptr<uint8_t>(),
                      weight.stride(0), cuda_mutable_ptr<scalar_t>(out), rows, in_features);
      });
    });
  }
  return direct ? out : out.to(dtype);
}

at::Tensor quantized_linear_cuda(const at::Tensor& x_in, const at::Tensor& weight,
                                 int64_t weight_type, const std::optional<at::Tensor>& bias) {
  const BlockFormat format = check_quantized_linear_inputs(x_in, weight, weight_type, bias);
  const int64_t rows = x_in.size(0), n_out = weight.size(0), k_len = x_in.size(1);
  if (rows > cuda::kMaxGemvRows) {
    // Compute-bound: cuBLAS on the weight dequantized to x's dtype.
    return at::linear(x_in, dequantize_cuda(weight, weight_type, x_in.scalar_type()), bias);
  }
  auto y = at::empty({rows, n_out}, x_in.options());
  if (rows == 0 || n_out == 0) return y;
  if (k_len == 0) return bias.has_value() ? y.copy_(bias->expand({rows, n_out})) : y.zero_();
  const c10::cuda::CUDAGuard guard(x_in.device());
  // The kernel reads each x row densely, rows x.stride(0) apart.
  const auto x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const auto bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  const auto blocks = unsigned(ceil_div(n_out, cuda::kGemvWarps));
  visit_block_format(format, [&](auto f) {
    constexpr BlockFormat F = decltype(f)::value;
    cuda::visit_gemv_rows(rows, [&](auto m) {
      constexpr int M = decltype(m)::value;
      FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fastllm::quantized_linear_cuda", [&] {
        launch_kernel(&cuda::quantized_gemv_kernel<F, M, cuda_storage_t<scalar_t>>, blocks,
                      cuda::kGemvWarps * 32, 0, cuda_ptr<scalar_t>(x), x.stride(0),
                      weight.const_data_ptr<uint8_t>(), weight.stride(0),
                      bias_c.defined() ? cuda_ptr<scalar_t>(bias_c) : nullptr,
                      cuda_mutable_ptr<scalar_t>(y), n_out, k_len);
      });
    });
  });
  return y;
}

TORCH_LIBRARY_IMPL(fastllm, CUDA, m) {
  m.impl("quantized_linear", &quantized_linear_cuda);
  m.impl("dequantize", &dequantize_cuda);
}

}  // namespace fastllm
