// Dtype switch for the kernels: every kernel stores float32 / bfloat16 / float16 and
// accumulates in float32 (inputs were checked to be one of these).
#pragma once

#include <ATen/Dispatch.h>

#define FASTLLM_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)        \
  AT_DISPATCH_SWITCH(TYPE, NAME,                             \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))
