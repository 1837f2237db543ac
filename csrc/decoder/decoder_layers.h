// The Llama family's decoder layer (python/fastllm/models/llama.py) as C++ over fastllm's ops:
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

// A pre-norm block: x + attention(norm(x)), then x + mlp(norm(x)), with q/k/v and gate/up each
// one projection, optional q/k RMSNorm, RoPE (unless a NoPE layer) and a sliding window.
struct DecoderLayer {
  at::Tensor input_norm, post_attention_norm;
  std::optional<at::Tensor> q_norm, k_norm;
  Projection qkv, o, gate_up, down;
  int64_t n_heads, n_kv_heads, head_dim;
  double eps;
  bool use_rope;
  int64_t window_left;
};

// Where one step's tokens sit in the batch and the paged cache (models/attention_metadata.py),
// and the caches of all layers [num_layers, num_blocks, block_size, n_kv_heads, head_dim].
struct DecoderStep {
  at::Tensor positions, cu_seqlens_q, seq_lens, block_tables, slot_mapping;
  int64_t max_seqlen_q;
  bool keys_are_new;
  at::Tensor k_cache, v_cache, cos_sin_cache;
  bool pre_rope;  // the caches hold keys before RoPE: attention rotates them as it reads them
};

// Runs `layers` in order on x [tokens, hidden] and the residual stream (none before the first
// layer), layer i writing its K/V into k_cache[i] / v_cache[i]. Returns the last layer's output
// and the residual stream; the model's final norm adds the one into the other.
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
