// Python bindings of the KV-cache classes, added to fastllm._C by ops.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace fastllm {

// Adds BlockManager and KVCacheFullError to the module.
void bind_kv_cache(pybind11::module_& m);

}  // namespace fastllm
