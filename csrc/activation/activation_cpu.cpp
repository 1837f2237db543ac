// Gated activations on the CPU: act(gate) * up over the two halves of the fused gate|up
// projection (SwiGLU's silu, GeGLU's tanh-approximated gelu), with the eager form's roundings
// (the activation rounded to the dtype, then the product), in one op where the eager form runs
// three (split, activation, mul).
#include <cmath>
#include <type_traits>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "activation/activation.h"
#include "common/dispatch.h"
#include "common/vec.h"

namespace fastllm {
namespace {

// silu(g) = g / (1 + exp(-g)).
struct Silu {
  static constexpr const char* kName = "fastllm::silu_and_mul_cpu";
  static VecF apply(const VecF& g) { return g / (VecF(1.f) + g.neg().exp()); }
  static float apply(float g) { return g / (1.f + std::exp(-g)); }
};

// gelu(g, approximate="tanh") = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), PyTorch's
// expression (aten/src/ATen/native/cpu/Activation.cpp).
struct GeluTanh {
  static constexpr const char* kName = "fastllm::gelu_tanh_and_mul_cpu";
  static constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  static constexpr float kKappa = 0.044715f;
  static VecF apply(const VecF& g) {
    const VecF inner = VecF(kBeta) * (g + VecF(kKappa) * (g * g * g));
    return VecF(0.5f) * g * (VecF(1.f) + inner.tanh());
  }
  static float apply(float g) {
    const float inner = kBeta * (g + kKappa * (g * g * g));
    return 0.5f * g * (1.f + std::tanh(inner));
  }
};

template <typename Act, typename scalar_t>
void gated_row(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t d) {
  constexpr int64_t W = VecF::size();
  int64_t j = 0;
  for (; j + W <= d; j += W) {
    VecF act = Act::apply(load_as_float(gate + j));
    if constexpr (!std::is_same_v<scalar_t, float>) {
      scalar_t rounded[W];
      store_from_float(act, rounded);
      act = load_as_float(rounded);
    }
    store_from_float(act * load_as_float(up + j), out + j);
  }
  for (; j < d; ++j)
    out[j] = scalar_t(float(scalar_t(Act::apply(float(gate[j])))) * float(up[j]));
}

template <typename Act>
at::Tensor gated_and_mul_cpu(const at::Tensor& x) {
  const int64_t d = check_gated_activation_inputs(x);
  auto out = at::empty({x.size(0), d}, x.options());
  if (out.numel() == 0) return out;
  FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), Act::kName, [&] {
    const scalar_t* src = x.const_data_ptr<scalar_t>();
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), std::max<int64_t>(1, (32 << 10) / d), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        gated_row<Act>(src + r * x.stride(0), src + r * x.stride(0) + d, dst + r * d, d);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CPU, m) {
  m.impl("silu_and_mul", &gated_and_mul_cpu<Silu>);
  m.impl("gelu_tanh_and_mul", &gated_and_mul_cpu<GeluTanh>);
}

}  // namespace fastllm
