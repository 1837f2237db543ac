// Shared by the mixture-of-experts implementations of every device.
#pragma once

#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace fastllm {

struct MoeShape {
  int64_t tokens, hidden, num_experts, intermediate, top_k;
};

// Checks x [tokens, hidden], router_logits [tokens, num_experts], the experts' gate|up
// projections gate_up [num_experts, 2 * intermediate, hidden] and down projections down
// [num_experts, hidden, intermediate] (float in x's dtype, or 16-bit under float32 x; with a
// ggml type id or FP8_E4M3's, uint8 blocks [num_experts, rows, row bytes]), one device, and
// 1 <= top_k <= num_experts; returns the sizes.
MoeShape check_moe_inputs(const at::Tensor& x, const at::Tensor& router_logits,
                          const at::Tensor& gate_up, const at::Tensor& down, int64_t top_k,
                          std::optional<int64_t> gate_up_type, std::optional<int64_t> down_type);

// HF's routing (Qwen3MoeTopKRouter) with its ATen ops: softmax of the logits in float32, the
// top_k probabilities as torch.topk picks them (ties included), divided by their sum if
// renormalize, rounded to `dtype`. Returns (weights [tokens, top_k] of dtype, experts int64
// [tokens, top_k]), largest weight first.
std::tuple<at::Tensor, at::Tensor> route_tokens_composite(const at::Tensor& router_logits,
                                                          int64_t top_k, bool renormalize,
                                                          at::ScalarType dtype);

}  // namespace fastllm
