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

// dst[0, n) = src[0, n) as float32, a vector at a time (at::vec::convert from float16 and
// bfloat16 goes element by element: a quarter of packing a verification step's V rows).
template <typename scalar_t>
inline void convert_to_float(const scalar_t* src, float* dst, int64_t n) {
  constexpr int64_t W = VecF::size();
  int64_t i = 0;
  for (; i + W <= n; i += W) load_as_float(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = float(src[i]);
}

inline int64_t round_up_to_vec(int64_t n) {
  constexpr int64_t W = VecF::size();
  return (n + W - 1) / W * W;
}

}  // namespace fastllm
