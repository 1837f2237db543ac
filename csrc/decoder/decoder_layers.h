// The decoder layer of every family (python/fastllm/models/decoder.py) as C++ over fastllm's ops:
// a decode step makes about ten op calls a layer, and each one made from Python costs a few
// microseconds of argument boxing, more than a small model's norms or RoPE take. Here the ops
// are called through the dispatcher, so every device runs its own kernels (CPU, CUDA, the
// composites on MPS), the profiler still sees each op, and CUDA graphs capture them as before.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fastllm {

// One run of a projection's output rows: a float weight [rows, in] (weight_type < 0) or ggml
// blocks uint8 [rows, row bytes] of type weight_type, with an optional bias.
struct ProjectionPart {
  at::Tensor weight;
  int64_t weight_type;
  std::optional<at::Tensor> bias;
};

// A linear layer: its parts' outputs side by side (one part but in files that mix formats).
struct Projection {
  std::vector<ProjectionPart> parts;
  at::Tensor operator()(const at::Tensor& x) const;
};

// A mixture-of-experts MLP: the router's logits, then fastllm::moe over the experts' fused
// gate|up [experts, 2 * intermediate, hidden] and down [experts, hidden, intermediate] weights,
// floats or ggml blocks of their type.
struct Experts {
  Projection router;
  at::Tensor gate_up, down;
  std::optional<int64_t> gate_up_type, down_type;
  int64_t top_k;
  bool renormalize;
};

// The MLP's gate activation (the op that gates the fused gate|up projection's output).
enum class Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

// One decoder layer: attention, then the MLP, each a residual branch. Each branch's input is
// normalized when its input norm is set (input_norm, pre_feedforward_norm: Llama's pre-norm),
// its output when its output norm is set (post_attention_norm, post_feedforward_norm: Gemma's
// sandwich has all four, OLMo 2 only these). q/k RMSNorm is per head (q_norm [head_dim]) or
// over all of q and of k (qk_norm_per_head false: [n_heads * head_dim]). The MLP is dense
// (gate_up and down) or experts.
struct DecoderLayer {
  std::optional<at::Tensor> input_norm, post_attention_norm, pre_feedforward_norm,
      post_feedforward_norm;
  std::optional<at::Tensor> q_norm, k_norm;
  bool qk_norm_per_head;
  Projection qkv, o;
  std::optional<Projection> gate_up, down;
  std::optional<Experts> experts;
  Activation activation;
  int64_t n_heads, n_kv_heads, head_dim;
  double eps;
  bool use_rope;
  int64_t rope_table;  // which of the step's RoPE tables this layer rotates with
  int64_t window_left;
  std::optional<double> scale;  // the query-key scale; none: head_dim ** -0.5
  double softcap;               // attention scores soft-capped at this (0: not)
};

// Where one step's tokens sit in the batch and the paged cache (models/attention_metadata.py),
// the caches of all layers [num_layers, num_blocks, block_size, n_kv_heads, head_dim] and the
// model's RoPE tables (one, or Gemma 3's global and local ones).
struct DecoderStep {
  at::Tensor positions, cu_seqlens_q, seq_lens, block_tables, slot_mapping;
  int64_t max_seqlen_q;
  bool keys_are_new;
  at::Tensor k_cache, v_cache;
  std::vector<at::Tensor> cos_sin_caches;
  bool pre_rope;  // the caches hold keys before RoPE: attention rotates them as it reads them
};

// Runs `layers` in order on x [tokens, hidden] and the residual stream (none before the first
// layer), layer i writing its K/V into k_cache[i] / v_cache[i]. Returns the last layer's output
// and the residual stream before it; the model's final norm adds the one into the other.
//
// With a process group's name (tensor parallelism: the layers hold this rank's heads and MLP
// features, the o and down projections its input columns), each of those two projections'
// outputs is summed over the group (torch's functional all_reduce, then wait_tensor) before
// its residual add.
std::pair<at::Tensor, at::Tensor> run_decoder_layers(const std::vector<DecoderLayer>& layers,
                                                     at::Tensor x,
                                                     std::optional<at::Tensor> residual,
                                                     const DecoderStep& step,
                                                     const std::optional<std::string>& group_name);

}  // namespace fastllm
