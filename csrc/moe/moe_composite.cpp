// The mixture-of-experts block written with ATen ops: what a device without a native kernel
// runs. HF's eager block (Qwen3MoeSparseMoeBlock) op for op: route, then a loop over the
// experts that have tokens, each expert's MLP on its tokens' rows in x's dtype, its output
// times the routing weights added into the result with index_add_ in increasing expert order.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/composite.h"
#include "moe/moe.h"
#include "quantized/quantized.h"

namespace fastllm {

std::tuple<at::Tensor, at::Tensor> route_tokens_composite(const at::Tensor& router_logits,
                                                          int64_t top_k, bool renormalize,
                                                          at::ScalarType dtype) {
  const auto probs = at::softmax(router_logits, 1, at::kFloat);
  auto [weights, experts] = at::topk(probs, top_k, 1);
  if (renormalize) weights = weights / weights.sum(1, /*keepdim=*/true);
  return {weights.to(dtype), experts};
}

namespace {

// Expert e's [rows, in] weight in `dtype`: a float slice converted, or blocks dequantized.
at::Tensor expert_weight(const at::Tensor& w, const std::optional<int64_t>& type, int64_t e,
                         at::ScalarType dtype) {
  return type.has_value() ? dequantize_composite(w.select(0, e), *type, dtype)
                          : w.select(0, e).to(dtype);
}

at::Tensor moe_composite(const at::Tensor& x, const at::Tensor& router_logits,
                         const at::Tensor& gate_up, const at::Tensor& down, int64_t top_k,
                         bool renormalize, std::optional<int64_t> gate_up_type,
                         std::optional<int64_t> down_type) {
  const MoeShape s =
      check_moe_inputs(x, router_logits, gate_up, down, top_k, gate_up_type, down_type);
  auto out = at::zeros({s.tokens, s.hidden}, x.options());
  if (out.numel() == 0 || s.intermediate == 0) return out;
  const auto dtype = x.scalar_type();
  const auto [weights, experts] = route_tokens_composite(router_logits, top_k, renormalize, dtype);
  // The (token, choice) pairs grouped by expert, each expert's in token order (a stable sort),
  // and each expert's count on the host, for the loop over the experts that have tokens.
  const auto chosen = experts.flatten();
  const auto order = std::get<1>(at::sort(chosen, /*stable=*/true, 0, /*descending=*/false));
  const auto counts = at::bincount(chosen, {}, s.num_experts).to(at::kCPU);
  const auto tokens = at::div(order, top_k, "floor");
  const auto pair_weights = weights.flatten().index_select(0, order).unsqueeze(1);
  const int64_t* count = counts.const_data_ptr<int64_t>();
  const int64_t I = s.intermediate;
  int64_t first = 0;
  for (int64_t e = 0; e < s.num_experts; ++e) {
    const int64_t rows = count[e];
    if (rows == 0) continue;
    const auto token_rows = tokens.narrow(0, first, rows);
    const auto h = at::linear(x.index_select(0, token_rows),
                              expert_weight(gate_up, gate_up_type, e, dtype));
    const auto y = at::linear(at::silu(h.narrow(1, 0, I)) * h.narrow(1, I, I),
                              expert_weight(down, down_type, e, dtype));
    out.index_add_(0, token_rows, y * pair_weights.narrow(0, first, rows));
    first += rows;
  }
  return out;
}

}  // namespace

FASTLLM_COMPOSITE_IMPL(m) { m.impl("moe", &moe_composite); }

}  // namespace fastllm
