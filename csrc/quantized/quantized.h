// Shared by the block-quantized matmul implementations of every device.
#pragma once

#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

#include "quantized/block_formats.h"

namespace fastllm {

// A Q4_0, Q4_1, Q5_0, Q8_0, Q4_K or Q6_K weight [rows, row bytes] (rows a multiple of
// kInterleavedRows) in the interleaved layout (block_formats.h: kInterleavedTypes), and back:
// `format` the blocks'.
at::Tensor interleave_rows(const at::Tensor& weight, BlockFormat format);
at::Tensor deinterleave_rows(const at::Tensor& weight, BlockFormat format);
// Rows `rows` (int64 [n], each in [0, weight rows)) of a CPU weight in the interleaved layout,
// as `format`'s blocks [n, row bytes]: an embedding's lookup in a tied LM head's weight.
at::Tensor deinterleave_rows(const at::Tensor& weight, BlockFormat format, const at::Tensor& rows);

// kInterleavedFormats for messages, "Q4_0 (2), ... or Q6_K (14)": each format's type id plus
// `id_offset` (kInterleavedTypes: the interleaved types').
std::string interleaved_formats_text(int64_t id_offset);

// Checks a block-quantized weight [out_features, row bytes] (uint8, rows contiguous) of ggml type
// `weight_type`; returns its format and sets in_features from the row length. Where
// `interleaved` is given (the CPU ops), the interleaved types are taken too (the format of their
// blocks; the weight contiguous, whole groups of rows), and *interleaved says whether it was.
BlockFormat check_quantized_weight(const at::Tensor& weight, int64_t weight_type,
                                   int64_t& in_features, bool* interleaved = nullptr);

// Also checks x [rows, in_features] (float storage, on the weight's device) and the optional
// bias [out_features] of x's dtype.
BlockFormat check_quantized_linear_inputs(const at::Tensor& x, const at::Tensor& weight,
                                          int64_t weight_type,
                                          const std::optional<at::Tensor>& bias,
                                          bool* interleaved = nullptr);

// The ATen composition, for every device without a kernel of its own (and the CPU's many-row
// path's shape): dequantize, then a float matmul.
at::Tensor dequantize_composite(const at::Tensor& weight, int64_t weight_type,
                                at::ScalarType dtype);
at::Tensor quantized_linear_composite(const at::Tensor& x, const at::Tensor& weight,
                                      int64_t weight_type, const std::optional<at::Tensor>& bias);

// The CUDA implementations (quantized_cuda.cu; CUDA builds only), for other CUDA host files:
// moe runs its quantized experts through them.
at::Tensor dequantize_cuda(const at::Tensor& weight, int64_t weight_type, at::ScalarType dtype);
at::Tensor quantized_linear_cuda(const at::Tensor& x, const at::Tensor& weight,
                                 int64_t weight_type, const std::optional<at::Tensor>& bias);

}  // namespace fastllm
