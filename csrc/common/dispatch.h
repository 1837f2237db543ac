// Dtype switch for the kernels: every kernel stores float32 / bfloat16 / float16 and
// accumulates in float32 (inputs were checked to be one of these).
#pragma once

#include <type_traits>

#include <ATen/Dispatch.h>

#define FASTLLM_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)        \
  AT_DISPATCH_SWITCH(TYPE, NAME,                             \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// The (activations, KV cache) dtype pairs of the cache ops (check_kv_cache_dtype): the cache in
// the activations' dtype, or a bfloat16 / float16 cache under float32 activations. Inside,
// scalar_t is the activations' type and cache_t the cache's.
#define FASTLLM_DISPATCH_KV_CACHE_TYPES(TYPE, CACHE_TYPE, NAME, ...)                       \
  FASTLLM_DISPATCH_FLOAT_TYPES(TYPE, NAME, [&] {                                          \
    const at::ScalarType fastllm_cache_type = (CACHE_TYPE);                                \
    if (fastllm_cache_type == (TYPE)) {                                                    \
      using cache_t = scalar_t;                                                            \
      __VA_ARGS__();                                                                       \
      return;                                                                              \
    }                                                                                      \
    if constexpr (std::is_same_v<scalar_t, float>) {                                       \
      if (fastllm_cache_type == at::kBFloat16) {                                           \
        using cache_t = at::BFloat16;                                                      \
        __VA_ARGS__();                                                                     \
        return;                                                                            \
      }                                                                                    \
      if (fastllm_cache_type == at::kHalf) {                                               \
        using cache_t = at::Half;                                                          \
        __VA_ARGS__();                                                                     \
        return;                                                                            \
      }                                                                                    \
    }                                                                                      \
    TORCH_INTERNAL_ASSERT(false, NAME, ": unchecked cache dtype ", fastllm_cache_type);    \
  })
