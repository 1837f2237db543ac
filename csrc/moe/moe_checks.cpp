#include "moe/moe.h"

#include "common/checks.h"
#include "quantized/block_formats.h"

namespace fastllm {
namespace {

// One projection of every expert, [num_experts, rows, in]: floats of x's dtype (or 16 bits
// under float32 x, converted exactly as linear converts them), or with a type id ggml's blocks
// or fastllm's FP8_E4M3 blocks, uint8 [num_experts, rows, row bytes]. Rows contiguous. Returns
// in, the values per row.
int64_t check_experts(const at::Tensor& w, const char* name, const char* float_layout,
                      const char* block_layout_text, const std::optional<int64_t>& type,
                      const char* type_name, const at::Tensor& x) {
  check_same_device(w, name, x, "x");
  if (type.has_value()) {
    TORCH_CHECK_VALUE(is_block_format(*type) || *type == kFp8E4M3Type, type_name,
                      " must be None (float experts), a ggml type id of Q4_0 (2), Q4_1 (3), "
                      "Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14), or "
                      "fastllm's FP8_E4M3 blocks (2000), got ", *type);
    const BlockLayout blocks = block_layout(static_cast<BlockFormat>(*type));
    TORCH_CHECK_VALUE(w.dim() == 3, name, " must be ", block_layout_text, " (", blocks.name,
                      " blocks), got shape ", w.sizes());
    check_dtype(w, at::kByte, name);
    TORCH_CHECK_VALUE(w.size(2) % blocks.bytes == 0, "a ", blocks.name, " ", name,
                      " row is whole blocks of ", blocks.bytes, " bytes (", blocks.values,
                      " values), got rows of ", w.size(2), " bytes");
    TORCH_CHECK_VALUE(w.stride(2) == 1 || w.size(2) <= 1, name,
                      " rows must be contiguous, got strides ", w.strides());
    return w.size(2) / blocks.bytes * blocks.values;
  }
  TORCH_CHECK_VALUE(w.dim() == 3, name, " must be ", float_layout, ", got shape ", w.sizes());
  TORCH_CHECK_TYPE(w.scalar_type() != at::kByte, name, " is torch.uint8 (ggml or FP8 blocks?) but ",
                   type_name, " is None");
  const bool upcast = x.scalar_type() == at::kFloat &&
      (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf);
  if (!upcast) check_same_dtype(w, name, x, "x");
  TORCH_CHECK_VALUE(w.stride(2) == 1 || w.size(2) <= 1, name,
                    " rows must be contiguous (stride 1 along the last dim), got strides ",
                    w.strides());
  return w.size(2);
}

}  // namespace

MoeShape check_moe_inputs(const at::Tensor& x, const at::Tensor& router_logits,
                          const at::Tensor& gate_up, const at::Tensor& down, int64_t top_k,
                          std::optional<int64_t> gate_up_type, std::optional<int64_t> down_type) {
  check_rank(x, 2, "x", "[tokens, hidden]");
  check_float_storage(x, "x");
  check_rank(router_logits, 2, "router_logits", "[tokens, num_experts]");
  check_float_storage(router_logits, "router_logits");
  check_same_device(router_logits, "router_logits", x, "x");
  TORCH_CHECK_VALUE(router_logits.size(0) == x.size(0), "router_logits has ",
                    router_logits.size(0), " tokens but x has ", x.size(0));
  const int64_t num_experts = router_logits.size(1);
  TORCH_CHECK_VALUE(num_experts >= 1, "router_logits must score at least one expert, got shape ",
                    router_logits.sizes());
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= num_experts, "top_k must be in [1, num_experts=",
                    num_experts, "], got ", top_k);

  const int64_t gate_up_in = check_experts(
      gate_up, "gate_up", "[num_experts, 2 * intermediate, hidden]",
      "[num_experts, 2 * intermediate, row bytes]", gate_up_type, "gate_up_type", x);
  TORCH_CHECK_VALUE(gate_up.size(0) == num_experts, "gate_up has ", gate_up.size(0),
                    " experts but router_logits scores ", num_experts);
  TORCH_CHECK_VALUE(gate_up.size(1) % 2 == 0, "gate_up must hold each expert's gate rows then "
                    "its up rows, an even number, got ", gate_up.size(1));
  TORCH_CHECK_VALUE(gate_up_in == x.size(1), "x has ", x.size(1),
                    " features but gate_up's rows hold ", gate_up_in);
  const int64_t intermediate = gate_up.size(1) / 2;

  const int64_t down_in = check_experts(down, "down", "[num_experts, hidden, intermediate]",
                                        "[num_experts, hidden, row bytes]", down_type,
                                        "down_type", x);
  TORCH_CHECK_VALUE(down.size(0) == num_experts, "down has ", down.size(0),
                    " experts but router_logits scores ", num_experts);
  TORCH_CHECK_VALUE(down.size(1) == x.size(1), "down has ", down.size(1),
                    " rows per expert but x has ", x.size(1), " features");
  TORCH_CHECK_VALUE(down_in == intermediate, "down's rows hold ", down_in,
                    " values but gate_up's intermediate size is ", intermediate);
  return {x.size(0), x.size(1), num_experts, intermediate, top_k};
}

}  // namespace fastllm
