// Block-quantized matmul as an ATen composition: dequantize with tensor ops, then a float matmul.
// It serves MPS and any device without a kernel of its own.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/composite.h"
#include "quantized/quantized.h"

namespace fastllm {

at::Tensor dequantize_composite(const at::Tensor& weight, int64_t weight_type,
                                at::ScalarType dtype) {
  int64_t in_features = 0;
  const BlockFormat format = check_quantized_weight(weight, weight_type, in_features);
  const int64_t rows = weight.size(0), bytes = block_bytes(format);
  const auto blocks = weight.reshape({rows, in_features / kBlockValues, bytes});  // [R, B, bytes]
  // fp16 fields: two bytes each, reinterpreted, then widened to float32 (never float64, which
  // MPS lacks).
  const auto half = [&](int64_t at) {
    return blocks.narrow(2, at, 2).contiguous().view(at::kHalf).to(at::kFloat);  // [R, B, 1]
  };
  const auto d = half(0);
  at::Tensor values;  // [R, B, 32] float32
  if (format == BlockFormat::kQ8_0) {
    values = blocks.narrow(2, 2, 32).contiguous().view(at::kChar).to(at::kFloat) * d;
  } else {
    const auto q = blocks.narrow(2, format == BlockFormat::kQ4_1 ? 4 : 2, 16).to(at::kShort);
    const auto nibbles = at::cat({at::bitwise_and(q, 0x0f), at::bitwise_right_shift(q, 4)}, 2);
    const auto offset = format == BlockFormat::kQ4_1 ? half(2) : d * -8.0;
    values = nibbles.to(at::kFloat) * d + offset;
  }
  return values.reshape({rows, in_features}).to(dtype);
}

at::Tensor quantized_linear_composite(const at::Tensor& x, const at::Tensor& weight,
                                      int64_t weight_type, const std::optional<at::Tensor>& bias) {
  check_quantized_linear_inputs(x, weight, weight_type, bias);
  return at::linear(x, dequantize_composite(weight, weight_type, x.scalar_type()), bias);
}

FASTLLM_COMPOSITE_IMPL(m) {
  m.impl("quantized_linear", &quantized_linear_composite);
  m.impl("dequantize", &dequantize_composite);
}

}  // namespace fastllm
