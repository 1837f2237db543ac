// RMSNorm on the CPU, one row per task chunk, with HF's arithmetic: the row normalized in
// float32, rounded to its dtype, then scaled by the weight in that dtype. One op where the
// eager form runs seven (pow, mean, add, rsqrt, mul, to, mul): a decode step's norms are tiny,
// so their cost was the ops' overhead.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/dispatch.h"
#include "common/vec.h"
#include "norm/norm.h"
#include "norm/norm_cpu_kernel.h"

namespace fastllm {
namespace {

// Calls f(row pointer offset) for every row of x [..., hidden] (at most 3-D).
template <typename F>
void for_each_row(const at::Tensor& x, int64_t grain, const F& f) {
  const int64_t inner = x.dim() == 3 ? x.size(1) : 1;
  const int64_t rows = x.dim() == 1 ? 1 : x.size(0) * inner;
  const int64_t outer_stride = x.dim() == 1 ? 0 : x.stride(0);
  const int64_t inner_stride = x.dim() == 3 ? x.stride(1) : 0;
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      f(r, (r / inner) * outer_stride + (r % inner) * inner_stride);
  });
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm_inputs(x, weight, eps);
  auto out = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(-1);
  if (x.numel() == 0) return out;
  const auto w = weight.contiguous();
  FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fastllm::rms_norm_cpu", [&] {
    const scalar_t* src = x.const_data_ptr<scalar_t>();
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    for_each_row(x, std::max<int64_t>(1, (64 << 10) / n), [&](int64_t row, int64_t offset) {
      normalize_row(src + offset, w.const_data_ptr<scalar_t>(), dst + row * n, n, float(eps));
    });
  });
  return out;
}

void add_rms_norm_cpu(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                      double eps) {
  check_add_rms_norm_inputs(x, residual, weight, eps);
  const int64_t n = x.size(-1);
  if (x.numel() == 0) return;
  const auto w = weight.contiguous();
  FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fastllm::add_rms_norm_cpu", [&] {
    scalar_t* xp = x.mutable_data_ptr<scalar_t>();
    scalar_t* rp = residual.mutable_data_ptr<scalar_t>();
    for_each_row(x, std::max<int64_t>(1, (64 << 10) / n), [&](int64_t row, int64_t) {
      scalar_t* xr = xp + row * n;
      scalar_t* rr = rp + row * n;
      for (int64_t j = 0; j < n; ++j) rr[j] = scalar_t(float(rr[j]) + float(xr[j]));
      normalize_row(rr, w.const_data_ptr<scalar_t>(), xr, n, float(eps));
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("add_rms_norm", &add_rms_norm_cpu);
}

}  // namespace fastllm
