// Python bindings of the decoder layers (decoder_layers.h), added to fastllm._C by ops.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace fastllm {

// Adds the decoder's records (ProjectionPart, Experts, DecoderLayer, DecoderStep) and
// DecoderLayers to the module.
void bind_decoder(pybind11::module_& m);

}  // namespace fastllm
