#include "decoder/decoder_layers.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace fastllm {
namespace {

// The typed handle of op fastllm::<name>, looked up once. Sig is the C++ signature its kernels
// are registered with (csrc/*/*_cpu.cpp): the dispatcher checks it on the first lookup.
template <class Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using OptionalTensor = std::optional<at::Tensor>;

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

// Fused QKV projection, optional q/k RMSNorm, RoPE, paged cache write and attention, then the
// output projection: [T, hidden] -> [T, hidden].
at::Tensor attend(const DecoderLayer& layer, const at::Tensor& x, at::Tensor k_cache,
                  at::Tensor v_cache, const DecoderStep& step) {
  const int64_t tokens = x.size(0);
  // Strided views of one matmul: q [T, n_heads, head_dim], k and v [T, n_kv_heads, head_dim].
  const auto qkv = layer.qkv(x).view({tokens, -1, layer.head_dim}).split_with_sizes(
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
  // attention rotates the cached keys with the table as it reads them; NoPE layers rotate
  // nothing), then k and v into the cache.
  const OptionalTensor table = layer.use_rope
                                   ? OptionalTensor(step.cos_sin_caches.at(layer.rope_table))
                                   : OptionalTensor();
  ops::rotary_and_cache(step.positions, q, k, v, k_cache, v_cache, step.slot_mapping, table,
                        q_norm, k_norm, layer.eps, !step.pre_rope);
  const OptionalTensor key_rotation = step.pre_rope ? table : OptionalTensor();
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
  return layer.o(out.view({tokens, -1}));
}

// The dense gated MLP (gate|up, the activation, down) or the experts: [T, hidden] -> [T, hidden].
at::Tensor feed_forward(const DecoderLayer& layer, const at::Tensor& x) {
  if (layer.experts.has_value()) return ops::moe(x, layer.experts->router(x), *layer.experts);
  const at::Tensor gate_up = (*layer.gate_up)(x);  // [T, 2 * intermediate]
  return (*layer.down)(layer.activation == Activation::kGeluTanh
                           ? ops::gelu_tanh_and_mul(gate_up)
                           : ops::silu_and_mul(gate_up));
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

}  // namespace

at::Tensor Projection::operator()(const at::Tensor& x) const {
  std::vector<at::Tensor> outputs;
  outputs.reserve(parts.size());
  for (const ProjectionPart& part : parts) {
    outputs.push_back(part.weight_type < 0
                          ? ops::linear(x, part.weight, part.bias)
                          : ops::quantized_linear(x, part.weight, part.weight_type, part.bias));
  }
  return outputs.size() == 1 ? outputs[0] : at::cat(outputs, 1);
}

std::pair<at::Tensor, at::Tensor> run_decoder_layers(const std::vector<DecoderLayer>& layers,
                                                     at::Tensor x,
                                                     std::optional<at::Tensor> residual,
                                                     const DecoderStep& step,
                                                     const std::optional<std::string>& group_name) {
  TORCH_CHECK_VALUE(!layers.empty(), "a decoder needs at least one layer");
  TORCH_CHECK_VALUE(step.k_cache.dim() == 5 && step.v_cache.dim() == 5 &&
                        step.k_cache.size(0) == int64_t(layers.size()) &&
                        step.v_cache.size(0) == int64_t(layers.size()),
                    "k_cache and v_cache must be [num_layers=", layers.size(),
                    ", num_blocks, block_size, n_kv_heads, head_dim], got ",
                    step.k_cache.sizes(), " and ", step.v_cache.sizes());
  at::Tensor res = residual.has_value() ? *residual : at::Tensor();
  for (size_t i = 0; i < layers.size(); ++i) {
    const DecoderLayer& layer = layers[i];
    x = attend(layer, branch_input(x, res, layer.input_norm, layer.eps),
               step.k_cache.select(0, int64_t(i)), step.v_cache.select(0, int64_t(i)), step);
    if (group_name.has_value()) x = ops::all_reduce(x, *group_name);  // o's partial sums
    if (layer.post_attention_norm.has_value())
      x = ops::rms_norm(x, *layer.post_attention_norm, layer.eps);
    x = feed_forward(layer, branch_input(x, res, layer.pre_feedforward_norm, layer.eps));
    if (group_name.has_value()) x = ops::all_reduce(x, *group_name);  // down's partial sums
    if (layer.post_feedforward_norm.has_value())
      x = ops::rms_norm(x, *layer.post_feedforward_norm, layer.eps);
  }
  return {x, res};
}

}  // namespace fastllm
