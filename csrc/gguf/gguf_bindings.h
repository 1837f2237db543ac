// Python bindings of the GGUF metadata reader, added to fastllm._C by ops.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace fastllm {

// Adds read_gguf_strings to the module.
void bind_gguf(pybind11::module_& m);

}  // namespace fastllm
