// Registration of the ATen compositions (the *_composite.cpp files): ops written with ATen ops
// only, so they run on any device.
#pragma once

#include <torch/library.h>

// FASTLLM_COMPOSITE_IMPL(m) { m.impl("op", &op_composite); } registers one list of compositions
// in both namespaces of csrc/ops.cpp's schemas: as fastllm's CompositeExplicitAutograd kernels,
// what MPS and any device without a native kernel run, and as fastllm_composite's, so that
// torch.ops.fastllm_composite.<op> runs them on every device (tests check them on the CPU).
// The body is a template because the CUDA simulator's build (tests/cuda/sim) swaps
// TORCH_LIBRARY_IMPL for its own, which hands it another library type.
#define FASTLLM_COMPOSITE_IMPL(m) FASTLLM_COMPOSITE_IMPL_UID(m, C10_UID)
#define FASTLLM_COMPOSITE_IMPL_UID(m, uid)                                            \
  template <typename Library>                                                        \
  static void C10_CONCATENATE(fastllm_composite_impl_, uid)(Library&);               \
  TORCH_LIBRARY_IMPL(fastllm, CompositeExplicitAutograd, library) {                  \
    C10_CONCATENATE(fastllm_composite_impl_, uid)(library);                          \
  }                                                                                  \
  TORCH_LIBRARY_IMPL(fastllm_composite, CompositeExplicitAutograd, library) {        \
    C10_CONCATENATE(fastllm_composite_impl_, uid)(library);                          \
  }                                                                                  \
  template <typename Library>                                                        \
  void C10_CONCATENATE(fastllm_composite_impl_, uid)(Library & m)
