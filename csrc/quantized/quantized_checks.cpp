#include <iterator>
#include <string>

#include "common/checks.h"
#include "quantized/quantized.h"

namespace fastllm {

std::string interleaved_formats_text(int64_t id_offset) {
  std::string text;
  constexpr size_t count = std::size(kInterleavedFormats);
  for (size_t i = 0; i < count; ++i)
    text += std::string(i == 0 ? "" : i + 1 < count ? ", " : " or ") +
            block_layout(kInterleavedFormats[i]).name + " (" +
            std::to_string(id_offset + int64_t(kInterleavedFormats[i])) + ")";
  return text;
}

BlockFormat check_quantized_weight(const at::Tensor& weight, int64_t weight_type,
                                   int64_t& in_features, bool* interleaved) {
  const bool is_interleaved = is_interleaved_type(weight_type);
  const auto format = static_cast<BlockFormat>(is_interleaved ? weight_type - kInterleavedTypes
                                                              : weight_type);
  TORCH_CHECK_VALUE(!is_interleaved || interleaved, "weight_type ", weight_type, " (",
                    block_layout(format).name, " with rows interleaved by ", kInterleavedRows,
                    ") is the CPU's decode layout; on ", weight.device(),
                    " pass the weight's ggml blocks (", block_layout(format).name, ", ",
                    int64_t(format), ")");
  TORCH_CHECK_VALUE(is_interleaved || is_block_format(weight_type) ||
                        weight_type == kFp8E4M3Type,
                    "weight_type must be a ggml type id of Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 "
                    "(7), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14), or fastllm's FP8_E4M3 "
                    "blocks (2000), got ", weight_type,
                    interleaved ? " (the CPU also takes " +
                                      interleaved_formats_text(kInterleavedTypes) +
                                      " with rows interleaved by 16)"
                                : std::string());
  check_rank(weight, 2, "weight", "[out_features, row bytes]");
  check_dtype(weight, at::kByte, "weight");
  if (interleaved) *interleaved = is_interleaved;
  if (is_interleaved) {
    TORCH_CHECK_VALUE(weight.size(0) % kInterleavedRows == 0, "an interleaved ",
                      block_layout(format).name, " weight has whole groups of ",
                      kInterleavedRows, " rows, got ", weight.size(0));
    TORCH_CHECK_VALUE(weight.is_contiguous(), "an interleaved ", block_layout(format).name,
                      " weight must be contiguous, got strides ", weight.strides());
  }
  const BlockLayout layout = block_layout(format);
  TORCH_CHECK_VALUE(weight.size(1) % layout.bytes == 0, "a ", layout.name,
                    " weight row is whole blocks of ", layout.bytes, " bytes (",
                    layout.values, " values), got rows of ", weight.size(1), " bytes");
  TORCH_CHECK_VALUE(weight.stride(1) == 1 || weight.size(1) <= 1,
                    "weight rows must be contiguous, got strides ", weight.strides());
  in_features = weight.size(1) / layout.bytes * layout.values;
  return format;
}

BlockFormat check_quantized_linear_inputs(const at::Tensor& x, const at::Tensor& weight,
                                          int64_t weight_type,
                                          const std::optional<at::Tensor>& bias,
                                          bool* interleaved) {
  int64_t in_features = 0;
  const BlockFormat format = check_quantized_weight(weight, weight_type, in_features, interleaved);
  check_rank(x, 2, "x", "[rows, in_features]");
  check_float_storage(x, "x");
  check_same_device(weight, "weight", x, "x");
  TORCH_CHECK_VALUE(x.size(1) == in_features, "x has ", x.size(1), " features but the ",
                    block_layout(format).name, " weight's rows hold ", in_features);
  check_linear_bias(bias, x, weight.size(0));
  return format;
}

}  // namespace fastllm
