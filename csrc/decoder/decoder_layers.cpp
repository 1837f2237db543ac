#include "decoder/decoder_layers.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>

#include "common/checks.h"

namespace fastllm {
namespace {

// The typed handle of op fastllm::<name>, looked up once. Sig is the C++ signature its kernels
// are registered with (csrc/*/*_cpu.cpp): the dispatcher checks it on the first lookup.
template <class Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// fastllm's ops, called by qualified name (argument-dependent lookup would also find ATen's).
namespace ops {

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& bias) {
  static const auto handle =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&)>(
          "fastllm::linear");
  return handle.call(x, weight, bias);
}

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& weight, int64_t weight_type,
                            const OptionalTensor& bias) {
  static const auto handle =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptionalTensor&)>(
          "fastllm::quantized_linear");
  return handle.call(x, weight, weight_type, bias);
}

void add_lora(at::Tensor& y, const at::Tensor& x, const ProjectionLoRA& lora,
              const at::Tensor& token_slots) {
  static const auto handle =
      op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&)>("fastllm::add_lora");
  handle.call(y, x, lora.lora_a, lora.lora_b, token_slots);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static const auto handle =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("fastllm::rms_norm");
  return handle.call(x, weight, eps);
}

void add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  static const auto handle =
      op<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)>("fastllm::add_rms_norm");
  handle.call(x, residual, weight, eps);
}

void rotary_and_cache(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                      const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                      const at::Tensor& slot_mapping, const OptionalTensor& cos_sin_cache,
                      const OptionalTensor& q_norm, const OptionalTensor& k_norm, double eps,
                      bool rotate_keys) {
  static const auto handle =
      op<void(const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, at::Tensor&,
              at::Tensor&, const at::Tensor&, const OptionalTensor&, const OptionalTensor&,
              const OptionalTensor&, double, bool, bool)>("fastllm::rotary_and_cache");
  handle.call(positions, q, k, v, k_cache, v_cache, slot_mapping, cos_sin_cache, q_norm, k_norm,
              eps, /*is_neox=*/true, rotate_keys);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& cu_seqlens, int64_t max_seqlen, const DecoderLayer& layer) {
  static const auto handle =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, int64_t, int64_t, bool, std::optional<double>, int64_t,
                    double)>("fastllm::attention");
  return handle.call(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, /*causal=*/true,
                     layer.scale, layer.window_left, layer.softcap);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const DecoderStep& step,
                           const DecoderLayer& layer, const OptionalTensor& key_rotation) {
  static const auto handle =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, const at::Tensor&, int64_t, bool, std::optional<double>,
                    int64_t, const OptionalTensor&, bool, double)>("fastllm::paged_attention");
  return handle.call(q, k_cache, v_cache, step.block_tables, step.seq_lens, step.cu_seqlens_q,
                     step.max_seqlen_q, /*causal=*/true, layer.scale, layer.window_left,
                     key_rotation, /*rotary_is_neox=*/true, layer.softcap);
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  static const auto handle = op<at::Tensor(const at::Tensor&)>("fastllm::silu_and_mul");
  return handle.call(x);
}

at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  static const auto handle = op<at::Tensor(const at::Tensor&)>("fastllm::gelu_tanh_and_mul");
  return handle.call(x);
}

at::Tensor moe(const at::Tensor& x, const at::Tensor& router_logits, const Experts& experts) {
  static const auto handle =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    int64_t, bool, std::optional<int64_t>, std::optional<int64_t>)>("fastllm::moe");
  return handle.call(x, router_logits, experts.gate_up, experts.down, experts.top_k,
                     experts.renormalize, experts.gate_up_type, experts.down_type);
}

// x summed over the process group `group_name`: torch's functional collectives, which are
// dispatcher ops on every backend (gloo, NCCL) and which CUDA graphs capture. Called boxed:
// their schemas take the group as `Any` (a name or a ProcessGroup), which has no fixed C++
// signature to call typed, and a boxed call costs nothing beside a collective.
at::Tensor all_reduce(const at::Tensor& x, const std::string& group_name) {
  static const auto reduce =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::all_reduce", "");
  static const auto wait =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::wait_tensor", "");
  std::vector<c10::IValue> stack{x, std::string("sum"), group_name};
  reduce.callBoxed(stack);
  wait.callBoxed(stack);  // the reduced tensor in, the same tensor out, ready
  return stack[0].toTensor();
}

}  // namespace ops

// The projection's output plus, on a step with adapters, each token's LoRA (of its slot).
at::Tensor project(const Projection& projection, const at::Tensor& x,
                   const std::optional<ProjectionLoRA>& lora, const DecoderStep& step) {
  at::Tensor y = project(projection, x);
  if (lora.has_value() && step.lora_slots.has_value())
    ops::add_lora(y, x, *lora, *step.lora_slots);
  return y;
}

// Fused QKV projection, optional q/k RMSNorm, RoPE (with `table`, none in a NoPE layer), paged
// cache write and attention, then the output projection: [T, hidden] -> [T, hidden].
at::Tensor attend(const DecoderLayer& layer, const at::Tensor& x, at::Tensor k_cache,
                  at::Tensor v_cache, const DecoderStep& step, const OptionalTensor& table,
                  bool pre_rope) {
  const int64_t tokens = x.size(0);
  // Strided views of one matmul: q [T, n_heads, head_dim], k and v [T, n_kv_heads, head_dim].
  const auto qkv = project(layer.qkv, x, layer.qkv_lora, step).view({tokens, -1, layer.head_dim}).split_with_sizes(
      {layer.n_heads, layer.n_kv_heads, layer.n_kv_heads}, 1);
  at::Tensor q = qkv[0], k = qkv[1];
  const at::Tensor& v = qkv[2];
  OptionalTensor q_norm = layer.q_norm, k_norm = layer.k_norm;
  if (q_norm.has_value() && !layer.qk_norm_per_head) {
    // One RMSNorm over all of q ([T, n_heads * head_dim]) and one over all of k (OLMo 2).
    q = ops::rms_norm(q.flatten(1), *q_norm, layer.eps).view(q.sizes());
    k = ops::rms_norm(k.flatten(1), *k_norm, layer.eps).view(k.sizes());
    q_norm = k_norm = std::nullopt;
  }
  // Per-head q/k norms and RoPE in place (on k unless the cache holds keys before RoPE: then
  // attention rotates the cached keys with the table as it reads them), then k and v into the
  // cache.
  ops::rotary_and_cache(step.positions, q, k, v, k_cache, v_cache, step.slot_mapping, table,
                        q_norm, k_norm, layer.eps, !pre_rope);
  const OptionalTensor key_rotation = pre_rope ? table : OptionalTensor();
  // A cache narrower than the activations (kv_cache_dtype) is always read back: attention must
  // see K/V as stored, or a sequence's result would depend on whether its keys came from this
  // step or from the cache (chunked prefill, prefix hits, preemption).
  at::Tensor out;
  if (step.keys_are_new && !key_rotation.has_value() && k_cache.scalar_type() == q.scalar_type())
    // The packed prefill kernel on the step's own (rotated) K/V: on a GPU the tensor-core one;
    // on the CPU the same kernel paged attention runs, so the same bits.
    out = ops::attention(q, k, v, step.cu_seqlens_q, step.max_seqlen_q, layer);
  else
    out = ops::paged_attention(q, k_cache, v_cache, step, layer, key_rotation);
  return project(layer.o, out.view({tokens, -1}), layer.o_lora, step);
}

// The dense gated MLP (gate|up, the activation, down) or the experts: [T, hidden] -> [T, hidden].
at::Tensor feed_forward(const DecoderLayer& layer, const at::Tensor& x, const DecoderStep& step) {
  if (layer.experts.has_value())
    return ops::moe(x, project(layer.experts->router, x), *layer.experts);
  // [T, 2 * intermediate]
  const at::Tensor gate_up = project(*layer.gate_up, x, layer.gate_up_lora, step);
  return project(*layer.down,
                 layer.activation == Activation::kGeluTanh ? ops::gelu_tanh_and_mul(gate_up)
                                                           : ops::silu_and_mul(gate_up),
                 layer.down_lora, step);
}

// Adds the pending branch output x into the residual stream res (none yet: x is the stream)
// and returns the next branch's input: the stream normalized by `norm`, or the stream itself.
at::Tensor branch_input(at::Tensor& x, at::Tensor& res, const OptionalTensor& norm, double eps) {
  if (!res.defined()) {
    res = x;
    return norm.has_value() ? ops::rms_norm(x, *norm, eps) : x;
  }
  if (norm.has_value()) {
    ops::add_rms_norm(x, res, *norm, eps);  // the residual add fused into the norm
    return x;
  }
  res.add_(x);
  return res;
}

void check_projection(const Projection& projection, const char* name) {
  TORCH_CHECK_TYPE(!projection.empty(), name, " must be a non-empty list of ProjectionPart");
}

void check_weight_type(const std::optional<int64_t>& weight_type, const char* name) {
  TORCH_CHECK_VALUE(!weight_type.has_value() || *weight_type >= 0, name,
                    " must be a ggml type id or None, got ", *weight_type);
}

void check_tensor(const at::Tensor& t, const char* name, int64_t rank, const char* layout,
                  at::ScalarType dtype, const at::Tensor& positions) {
  check_rank(t, rank, name, layout);
  check_dtype(t, dtype, name);
  check_same_device(t, name, positions, "positions");
}

}  // namespace

at::Tensor project(const Projection& projection, const at::Tensor& x) {
  std::vector<at::Tensor> outputs;
  outputs.reserve(projection.size());
  for (const ProjectionPart& part : projection) {
    outputs.push_back(part.weight_type.has_value()
                          ? ops::quantized_linear(x, part.weight, *part.weight_type, part.bias)
                          : ops::linear(x, part.weight, part.bias));
  }
  return outputs.size() == 1 ? outputs[0] : at::cat(outputs, 1);
}

void check_record(const ProjectionPart& part) {
  TORCH_CHECK_VALUE(part.weight.defined(), "a ProjectionPart needs a weight");
  check_weight_type(part.weight_type, "weight_type");
}

void check_record(const ProjectionLoRA& lora) {
  check_rank(lora.lora_a, 3, "lora_a", "[slots, rank, in]");
  check_rank(lora.lora_b, 3, "lora_b", "[slots, out, rank]");
  TORCH_CHECK_VALUE(lora.lora_a.size(0) == lora.lora_b.size(0) &&
                        lora.lora_a.size(1) == lora.lora_b.size(2),
                    "lora_a [slots, rank, in] and lora_b [slots, out, rank] must agree on slots "
                    "and rank, got ", lora.lora_a.sizes(), " and ", lora.lora_b.sizes());
}

void check_record(const Experts& experts) {
  check_projection(experts.router, "router");
  TORCH_CHECK_VALUE(experts.top_k > 0, "top_k must be positive, got ", experts.top_k);
  check_weight_type(experts.gate_up_type, "gate_up_type");
  check_weight_type(experts.down_type, "down_type");
}

void check_record(const DecoderLayer& layer) {
  check_projection(layer.qkv, "qkv");
  check_projection(layer.o, "o");
  TORCH_CHECK_VALUE(layer.n_heads > 0 && layer.n_kv_heads > 0 && layer.head_dim > 0 &&
                        layer.n_heads % layer.n_kv_heads == 0,
                    "n_heads, n_kv_heads and head_dim must be positive with n_heads a multiple "
                    "of n_kv_heads, got ", layer.n_heads, ", ", layer.n_kv_heads, ", ",
                    layer.head_dim);
  TORCH_CHECK_VALUE(layer.q_norm.has_value() == layer.k_norm.has_value(),
                    "q_norm and k_norm come together");
  TORCH_CHECK_VALUE(layer.experts.has_value() !=
                            (layer.gate_up.has_value() && layer.down.has_value()) &&
                        layer.gate_up.has_value() == layer.down.has_value(),
                    "a layer has either gate_up and down or experts");
  if (layer.gate_up.has_value()) {
    check_projection(*layer.gate_up, "gate_up");
    check_projection(*layer.down, "down");
  }
  TORCH_CHECK_VALUE(layer.eps > 0 && std::isfinite(layer.eps),
                    "eps must be a positive number, got ", layer.eps);
  TORCH_CHECK_VALUE(layer.rope_table >= 0, "rope_table must be >= 0, got ", layer.rope_table);
  TORCH_CHECK_VALUE(layer.window_left >= -1, "window_left must be >= -1 (-1: no window), got ",
                    layer.window_left);
  TORCH_CHECK_VALUE(!layer.scale.has_value() || (*layer.scale > 0 && std::isfinite(*layer.scale)),
                    "scale must be a positive number or None, got ", *layer.scale);
  TORCH_CHECK_VALUE(layer.softcap >= 0 && std::isfinite(layer.softcap),
                    "softcap must be finite and >= 0, got ", layer.softcap);
}

void check_record(const DecoderStep& step) {
  check_rank(step.positions, 1, "positions", "[tokens]");
  check_dtype(step.positions, at::kLong, "positions");
  check_tensor(step.slot_mapping, "slot_mapping", 1, "[tokens]", at::kLong, step.positions);
  check_tensor(step.cu_seqlens_q, "cu_seqlens_q", 1, "[batch + 1]", at::kInt, step.positions);
  check_tensor(step.seq_lens, "seq_lens", 1, "[batch]", at::kInt, step.positions);
  check_tensor(step.block_tables, "block_tables", 2, "[batch, max_blocks]", at::kInt,
               step.positions);
  const int64_t batch = step.seq_lens.size(0);
  TORCH_CHECK_VALUE(step.slot_mapping.size(0) == step.positions.size(0) &&
                        step.cu_seqlens_q.size(0) == batch + 1 &&
                        step.block_tables.size(0) == batch,
                    "a step of ", step.positions.size(0), " tokens (positions) in ", batch,
                    " sequences (seq_lens) needs slot_mapping [", step.positions.size(0),
                    "], cu_seqlens_q [", batch + 1, "] and block_tables [", batch,
                    ", max_blocks], got ", step.slot_mapping.sizes(), ", ",
                    step.cu_seqlens_q.sizes(), " and ", step.block_tables.sizes());
  TORCH_CHECK_VALUE(step.max_seqlen_q >= 0, "max_seqlen_q must be >= 0, got ",
                    step.max_seqlen_q);
  if (step.lora_slots.has_value()) {
    check_tensor(*step.lora_slots, "lora_slots", 1, "[tokens]", at::kInt, step.positions);
    TORCH_CHECK_VALUE(step.lora_slots->size(0) == step.positions.size(0), "a step of ",
                      step.positions.size(0), " tokens needs lora_slots [",
                      step.positions.size(0), "], got ", step.lora_slots->sizes());
  }
}

DecoderLayers::DecoderLayers(std::vector<DecoderLayer> layers,
                             std::vector<at::Tensor> rope_tables,
                             std::optional<std::string> group_name)
    : layers_(std::move(layers)),
      rope_tables_(std::move(rope_tables)),
      group_name_(std::move(group_name)) {
  TORCH_CHECK_TYPE(!layers_.empty(), "layers must be a non-empty list of DecoderLayer");
  TORCH_CHECK_VALUE(!group_name_.has_value() || !group_name_->empty(),
                    "group_name must be a process group's name or None");
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DecoderLayer& layer = layers_[i];
    TORCH_CHECK_VALUE(!layer.use_rope || layer.rope_table < int64_t(rope_tables_.size()),
                      "layer ", i, " rotates with RoPE table ", layer.rope_table, " but ",
                      rope_tables_.size(), " table(s) were given");
  }
}

std::pair<at::Tensor, at::Tensor> DecoderLayers::forward(at::Tensor x,
                                                         std::optional<at::Tensor> residual,
                                                         const DecoderStep& step,
                                                         const at::Tensor& k_cache,
                                                         const at::Tensor& v_cache,
                                                         bool pre_rope) const {
  const auto num_layers = int64_t(layers_.size());
  TORCH_CHECK_VALUE(k_cache.dim() == 5 && v_cache.dim() == 5 && k_cache.size(0) == num_layers &&
                        v_cache.size(0) == num_layers,
                    "k_cache and v_cache must be [num_layers=", num_layers,
                    ", num_blocks, block_size, n_kv_heads, head_dim], got ", k_cache.sizes(),
                    " and ", v_cache.sizes());
  at::Tensor res = residual.has_value() ? *residual : at::Tensor();
  for (int64_t i = 0; i < num_layers; ++i) {
    const DecoderLayer& layer = layers_[i];
    const OptionalTensor table =
        layer.use_rope ? OptionalTensor(rope_tables_[layer.rope_table]) : OptionalTensor();
    x = attend(layer, branch_input(x, res, layer.input_norm, layer.eps), k_cache.select(0, i),
               v_cache.select(0, i), step, table, pre_rope);
    if (group_name_.has_value()) x = ops::all_reduce(x, *group_name_);  // o's partial sums
    if (layer.post_attention_norm.has_value())
      x = ops::rms_norm(x, *layer.post_attention_norm, layer.eps);
    x = feed_forward(layer, branch_input(x, res, layer.pre_feedforward_norm, layer.eps), step);
    if (group_name_.has_value()) x = ops::all_reduce(x, *group_name_);  // down's partial sums
    if (layer.post_feedforward_norm.has_value())
      x = ops::rms_norm(x, *layer.post_feedforward_norm, layer.eps);
  }
  return {x, res};
}

}  // namespace fastllm
