// float32 SIMD vectors over any storage dtype: the kernels load float32 / bfloat16 / float16
// and compute in float32.
#pragma once

#include <type_traits>

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

namespace fastllm {

using VecF = at::vec::Vectorized<float>;

// VecF::size() elements at p, as float32.
template <typename scalar_t>
inline VecF load_as_float(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return VecF::loadu(p);
  } else {
    VecF out;
    at::vec::load_to_float<scalar_t>(p, out);
    return out;
  }
}

// Stores the VecF::size() floats of v at p, rounded to scalar_t.
template <typename scalar_t>
inline void store_from_float(const VecF& v, scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    v.store(p);
  } else {
    at::vec::convert_from_float<scalar_t>(v, v).store(p, VecF::size());
  }
}

inline int64_t round_up_to_vec(int64_t n) {
  constexpr int64_t W = VecF::size();
  return (n + W - 1) / W * W;
}

}  // namespace fastllm
