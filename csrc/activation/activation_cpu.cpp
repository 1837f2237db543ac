// SwiGLU's gate on the CPU: silu(gate) * up over the two halves of the fused gate|up
// projection, with the eager form's roundings (silu rounded to the dtype, then the product),
// in one op where the eager form runs three (split, silu, mul).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "activation/activation.h"
#include "common/dispatch.h"
#include "common/vec.h"

namespace fastllm {
namespace {

template <typename scalar_t>
void silu_and_mul_row(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t d) {
  constexpr int64_t W = VecF::size();
  const VecF one(1.f);
  int64_t j = 0;
  for (; j + W <= d; j += W) {
    const VecF g = load_as_float(gate + j);
    VecF silu = g / (one + g.neg().exp());
    if constexpr (!std::is_same_v<scalar_t, float>) {
      scalar_t rounded[W];
      store_from_float(silu, rounded);
      silu = load_as_float(rounded);
    }
    store_from_float(silu * load_as_float(up + j), out + j);
  }
  for (; j < d; ++j) {
    const float g = float(gate[j]);
    out[j] = scalar_t(float(scalar_t(g / (1.f + std::exp(-g)))) * float(up[j]));
  }
}

at::Tensor silu_and_mul_cpu(const at::Tensor& x) {
  const int64_t d = check_silu_and_mul_inputs(x);
  auto out = at::empty({x.size(0), d}, x.options());
  if (out.numel() == 0) return out;
  FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fastllm::silu_and_mul_cpu", [&] {
    const scalar_t* src = x.const_data_ptr<scalar_t>();
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), std::max<int64_t>(1, (32 << 10) / d), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        silu_and_mul_row(src + r * x.stride(0), src + r * x.stride(0) + d, dst + r * d, d);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CPU, m) { m.impl("silu_and_mul", &silu_and_mul_cpu); }

}  // namespace fastllm
