#include "common/checks.h"
#include "linear/linear.h"

namespace fastllm {

void check_linear_inputs(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  check_rank(x, 2, "x", "[rows, in_features]");
  check_rank(weight, 2, "weight", "[out_features, in_features]");
  check_float_storage(x, "x");
  // Weights may be stored in 16 bits under float32 activations (a float16 GGUF or a bfloat16
  // checkpoint run in float32): converted exactly as they are read.
  const bool upcast = x.scalar_type() == at::kFloat &&
      (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf);
  if (!upcast) check_same_dtype(weight, "weight", x, "x");
  check_same_device(weight, "weight", x, "x");
  TORCH_CHECK_VALUE(x.size(1) == weight.size(1), "x has ", x.size(1),
                    " features but weight is [out_features, in_features] = ", weight.sizes());
  // Weights are streamed row by row; a transposed view would be copied on every call instead.
  TORCH_CHECK_VALUE(weight.stride(1) == 1 || weight.size(1) <= 1,
                    "weight rows must be contiguous (stride 1 along in_features), got strides ",
                    weight.strides());
  check_linear_bias(bias, x, weight.size(0));
}

}  // namespace fastllm
