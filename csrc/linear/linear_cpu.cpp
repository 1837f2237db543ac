// The linear layer on the CPU. A decode step multiplies a few rows of activations by every
// weight matrix, so its cost is streaming the weights from memory once: the few-row kernel
// here reads each weight row once for all the activation rows and keeps the activations in L1,
// where a general GEMM call falls well short of the memory bandwidth for one row. Many rows
// (prefill) are compute-bound: ATen's GEMM for float32 weights (and bfloat16 ones where the CPU
// multiplies bfloat16), panels of a 16-bit weight converted to float32 otherwise.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/batch_invariant.h"
#include "common/cpu_isa.h"
#include "common/dispatch.h"
#include "linear/linear.h"
#include "linear/linear_cpu_kernel.h"

namespace fastllm {
namespace {

// y[rows, N] = x[rows, K] * w[N, K]^T (+ bias), output features split across threads.
template <typename x_t, typename w_t, typename out_t>
void stream_weights(const x_t* x, int64_t rows, const w_t* w, int64_t ldw,
                    const out_t* bias, out_t* y, int64_t n_out, int64_t k_len) {
  at::parallel_for(0, n_out, stream_grain(k_len, sizeof(w_t)), [&](int64_t begin, int64_t end) {
    stream_weight_rows(x, rows, w, ldw, bias, y, n_out, begin, end, k_len);
  });
}

// Many rows against a 16-bit weight: x in float32 through the weight's panels
// (gemm_weight_panels), the float32 sums rounded once to x's dtype.
at::Tensor linear_weight_panels(const at::Tensor& x, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias) {
  const int64_t rows = x.size(0), n_out = weight.size(0), k_len = weight.size(1);
  const auto x_float = x.to(at::kFloat).contiguous();
  const auto bias_float = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  auto y = at::empty({rows, n_out}, x_float.options());
  const float* bp = bias_float.defined() ? bias_float.const_data_ptr<float>() : nullptr;
  float* yp = y.mutable_data_ptr<float>();
  std::vector<float> x_tiles(rows * k_len);
  pack_row_tiles(x_float.const_data_ptr<float>(), rows, k_len, x_tiles.data());
  // One task per panel: enough of them (4 a thread on the smallest projections) that the
  // threads finish together.
  const auto run = [&](const auto* w) {
    at::parallel_for(0, (n_out + kPanelRows - 1) / kPanelRows, 1, [&](int64_t b, int64_t e) {
      gemm_weight_panels(x_tiles.data(), rows, k_len, w, weight.stride(0), bp, yp, n_out,
                         b * kPanelRows, std::min(n_out, e * kPanelRows));
    });
  };
  AT_DISPATCH_SWITCH(
      weight.scalar_type(), "fastllm::linear_weight_panels",
      AT_DISPATCH_CASE(at::kBFloat16, [&] { run(weight.const_data_ptr<scalar_t>()); })
      AT_DISPATCH_CASE(at::kHalf, [&] { run(weight.const_data_ptr<scalar_t>()); }));
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// Many rows (compute-bound): ATen's GEMM in float32, and in bfloat16 where the CPU multiplies
// it natively (AVX512-BF16, which oneDNN uses); elsewhere ATen's 16-bit GEMM is far slower
// than its float32 one, so 16-bit weights go through the float32 panels.
at::Tensor linear_gemm(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  const at::ScalarType dtype = x.scalar_type();
  if (dtype == at::kFloat || (dtype == at::kBFloat16 && cpu_has_avx512_bf16()))
    return at::linear(x, weight, bias);
  return linear_weight_panels(x, weight, bias);
}

// float32 activations times 16-bit weights, each weight converted exactly to float32 as it is
// read: the same sums as the upcast weight, from half the bytes.
at::Tensor linear_upcast_weights_cpu(const at::Tensor& x, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias) {
  const int64_t rows = x.size(0), n_out = weight.size(0), k_len = weight.size(1);
  if (k_len == 0) return at::linear(x, weight.to(at::kFloat), bias);
  if (rows > kMaxUpcastStreamRows && !batch_invariant())
    return linear_weight_panels(x, weight, bias);
  auto y = at::empty({rows, n_out}, x.options());
  if (rows == 0 || n_out == 0) return y;
  const auto x_c = x.contiguous();
  const auto bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  AT_DISPATCH_SWITCH(weight.scalar_type(), "fastllm::linear_upcast_weights_cpu",
                     AT_DISPATCH_CASE(at::kBFloat16, [&] {
    stream_weights(x_c.const_data_ptr<float>(), rows, weight.const_data_ptr<scalar_t>(),
                   weight.stride(0), bias_c.defined() ? bias_c.const_data_ptr<float>() : nullptr,
                   y.mutable_data_ptr<float>(), n_out, k_len);
  }) AT_DISPATCH_CASE(at::kHalf, [&] {
    stream_weights(x_c.const_data_ptr<float>(), rows, weight.const_data_ptr<scalar_t>(),
                   weight.stride(0), bias_c.defined() ? bias_c.const_data_ptr<float>() : nullptr,
                   y.mutable_data_ptr<float>(), n_out, k_len);
  }));
  return y;
}

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  check_linear_inputs(x, weight, bias);
  if (weight.scalar_type() != x.scalar_type()) return linear_upcast_weights_cpu(x, weight, bias);
  const int64_t rows = x.size(0), n_out = weight.size(0), k_len = weight.size(1);
  // Batch-invariant: the few-row kernel for any number of rows (a row's sums never depend on
  // the tile it shares; a GEMM's blocking may).
  if ((rows > max_stream_rows(x.scalar_type()) && !batch_invariant()) || k_len == 0)
    return linear_gemm(x, weight, bias);
  auto y = at::empty({rows, n_out}, x.options());
  if (rows == 0 || n_out == 0) return y;
  const auto bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fastllm::linear_cpu", [&] {
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    const scalar_t* b = bias_c.defined() ? bias_c.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* out = y.mutable_data_ptr<scalar_t>();
#ifdef FASTLLM_BF16_DOT
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      const auto x_c = x.contiguous();
      stream_weights(x_c.const_data_ptr<scalar_t>(), rows, w, weight.stride(0), b, out, n_out,
                     k_len);
      return;
    }
#endif
    // The activations once in float32: [rows, K], a few KiB that stay in L1.
    const auto x_float = x.to(at::kFloat).contiguous();
    stream_weights(x_float.const_data_ptr<float>(), rows, w, weight.stride(0), b, out, n_out,
                   k_len);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CPU, m) { m.impl("linear", &linear_cpu); }

}  // namespace fastllm
