// The CPU's RMSNorm of one row, with HF's arithmetic: norm_cpu.cpp runs it over a tensor's
// rows, rotary_cpu.cpp over the q and k heads that rotary_and_cache normalizes. Every TU that
// includes it compiles its own copy (an anonymous namespace), with the build's flags.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/vec.h"

namespace fastllm {
namespace {

// Rounds a float to scalar_t and back (the eager form's `.to(dtype)` between its steps).
template <typename scalar_t>
inline float round_to(float v) {
  return float(scalar_t(v));
}

// out[j] = w[j] * round(x[j] * inverse rms), in scalar_t; out may be x.
template <typename scalar_t>
inline void normalize_row(const scalar_t* x, const scalar_t* w, scalar_t* out, int64_t n,
                          float eps) {
  constexpr int64_t W = VecF::size();
  // The sum of squares in a fixed order (vector lanes, then the tail): a row's result never
  // depends on the rows beside it.
  VecF acc(0.f);
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const VecF v = load_as_float(x + j);
    acc = at::vec::fmadd(v, v, acc);
  }
  float sum = at::vec::vec_reduce_all<float>([](const VecF& a, const VecF& b) { return a + b; },
                                             acc);
  for (; j < n; ++j) sum += float(x[j]) * float(x[j]);
  const float inverse = 1.f / std::sqrt(sum / float(n) + eps);
  const VecF scale(inverse);
  for (j = 0; j + W <= n; j += W) {
    VecF normed = load_as_float(x + j) * scale;
    if constexpr (!std::is_same_v<scalar_t, float>) {
      scalar_t rounded[W];
      store_from_float(normed, rounded);
      normed = load_as_float(rounded);
    }
    store_from_float(load_as_float(w + j) * normed, out + j);
  }
  for (; j < n; ++j) out[j] = scalar_t(float(w[j]) * round_to<scalar_t>(float(x[j]) * inverse));
}

}  // namespace
}  // namespace fastllm
