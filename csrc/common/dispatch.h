// Dtype switches for the kernels: every kernel stores float32 / bfloat16 / float16 and
// accumulates in float32.
#pragma once

#include <ATen/Dispatch.h>

#define FASTLLM_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)
