// The simulator build's op registration: force-included after cuda_sim.h. The host files'
// TORCH_LIBRARY_IMPL(fastllm, CUDA, m) blocks register their functions as CPU kernels of
// fastllm_sim::<op>, an op with fastllm::<op>'s schema, so tests call the CUDA host code and
// kernels on CPU tensors next to the real CPU ops. Blocks for other dispatch keys (the composite
// files, linked for their fallbacks) register nothing.
#pragma once

#include <torch/library.h>

#include <string>
#include <utility>

namespace cuda_sim {

// Defines fastllm_sim::<name> with fastllm::<name>'s schema (once).
void define_like_fastllm(const char* name);
torch::Library& cpu_implementations();

class Library {
 public:
  template <typename Func>
  Library& impl(const char* name, Func&& f) {
    define_like_fastllm(name);
    cpu_implementations().impl(name, std::forward<Func>(f));
    return *this;
  }
};

struct Registration {
  Registration(const char* dispatch_key, void (*init)(Library&)) {
    if (std::string(dispatch_key) == "CUDA") {
      Library library;
      init(library);
    }
  }
};

}  // namespace cuda_sim

#undef TORCH_LIBRARY_IMPL
#define TORCH_LIBRARY_IMPL(ns, k, m) CUDA_SIM_LIBRARY_IMPL(k, m, C10_UID)
#define CUDA_SIM_LIBRARY_IMPL(k, m, uid)                                                \
  static void C10_CONCATENATE(cuda_sim_init_, uid)(::cuda_sim::Library&);               \
  static const ::cuda_sim::Registration C10_CONCATENATE(cuda_sim_registration_, uid)( \
      #k, &C10_CONCATENATE(cuda_sim_init_, uid));                                       \
  void C10_CONCATENATE(cuda_sim_init_, uid)(::cuda_sim::Library & m)
