// The decoder layer of every family (python/fastllm/models/decoder.py) as C++ over fastllm's ops:
// a decode step makes about ten op calls a layer, and each one made from Python costs a few
// microseconds of argument boxing, more than a small model's norms or RoPE take. Here the ops
// are called through the dispatcher, so every device runs its own kernels (CPU, CUDA, the
// composites on MPS), the profiler still sees each op, and CUDA graphs capture them as before.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace fastllm {

// The decoder's records are each declared once, as a list of fields: REQUIRED(type, name, doc)
// or FIELD(type, name, default, doc). The structs below are made from the lists, and so are their
// Python classes (decoder_bindings.cpp: construction by keyword or position, read-only
// attributes, replace(), documentation), which fastllm.ops exports as its records: a new field
// is one line in its list, its checks (if any) in check_record (decoder_layers.cpp).

// One field of a record, as the bindings read it.
template <class Record, class T>
struct RecordField {
  const char* name;
  T Record::*member;
  const char* doc;
  bool required;
};

#define FASTLLM_MEMBER_REQUIRED(type, name, doc) type name{};
#define FASTLLM_MEMBER(type, name, default_value, doc) type name = default_value;
#define FASTLLM_DESCRIBE_REQUIRED(type, name, doc) RecordField<Self, type>{#name, &Self::name, doc, true},
#define FASTLLM_DESCRIBE(type, name, default_value, doc) \
  RecordField<Self, type>{#name, &Self::name, doc, false},
// A record's members, then fields(): their RecordFields in declaration order.
#define FASTLLM_RECORD(Record, FIELDS)                                   \
  FIELDS(FASTLLM_MEMBER_REQUIRED, FASTLLM_MEMBER)                        \
  static auto fields() {                                                 \
    using Self = Record;                                                 \
    return std::tuple{FIELDS(FASTLLM_DESCRIBE_REQUIRED, FASTLLM_DESCRIBE)}; \
  }

using OptionalTensor = std::optional<at::Tensor>;

#define FASTLLM_PROJECTION_PART_FIELDS(REQUIRED, FIELD)                                          \
  REQUIRED(at::Tensor, weight,                                                                   \
           "A float weight [rows, in], or ggml blocks (uint8 [rows, row bytes]).")               \
  FIELD(std::optional<int64_t>, weight_type, std::nullopt,                                       \
        "The blocks' weight type (fastllm.ops.block_format); None for a float weight.")          \
  FIELD(OptionalTensor, bias, std::nullopt, "[rows], or None.")

// One run of a projection's output rows: run by fastllm::linear (a float weight) or
// fastllm::quantized_linear (ggml blocks).
struct ProjectionPart {
  FASTLLM_RECORD(ProjectionPart, FASTLLM_PROJECTION_PART_FIELDS)
};

// A linear layer: its parts' outputs side by side (one part but in files that mix formats).
using Projection = std::vector<ProjectionPart>;
at::Tensor project(const Projection& projection, const at::Tensor& x);

#define FASTLLM_EXPERTS_FIELDS(REQUIRED, FIELD)                                                  \
  REQUIRED(Projection, router, "The router: [tokens, hidden] -> [tokens, experts] logits.")      \
  REQUIRED(at::Tensor, gate_up,                                                                  \
           "Each expert's gate rows, then its up rows: [experts, 2 * intermediate, hidden], "    \
           "floats or blocks of gate_up_type (ggml's or FP8_E4M3's).")                          \
  REQUIRED(at::Tensor, down,                                                                     \
           "[experts, hidden, intermediate], floats or blocks of down_type.")                    \
  REQUIRED(int64_t, top_k, "The experts each token runs: its best by router score.")            \
  REQUIRED(bool, renormalize, "Whether a token's top_k softmax weights are rescaled to sum to 1.") \
  FIELD(std::optional<int64_t>, gate_up_type, std::nullopt,                                      \
        "gate_up's weight type; None for floats.")                                               \
  FIELD(std::optional<int64_t>, down_type, std::nullopt, "down's weight type; None for floats.")

#define FASTLLM_PROJECTION_LORA_FIELDS(REQUIRED, FIELD)                                          \
  REQUIRED(at::Tensor, lora_a,                                                                   \
           "[slots, rank, in]: each adapter slot's A (rows past its rank zero).")                \
  REQUIRED(at::Tensor, lora_b,                                                                   \
           "[slots, out, rank]: each adapter slot's B, its scaling folded in (columns past its " \
           "rank zero).")

// The LoRA adapters a projection may add (fastllm::add_lora), each token with the adapter of its
// slot (DecoderStep::lora_slots): the adapters live in these slots on the device, so a step with
// many adapters adds two small matmuls a projection.
struct ProjectionLoRA {
  FASTLLM_RECORD(ProjectionLoRA, FASTLLM_PROJECTION_LORA_FIELDS)
};

// A mixture-of-experts MLP: the router's logits, then fastllm::moe over the experts.
struct Experts {
  FASTLLM_RECORD(Experts, FASTLLM_EXPERTS_FIELDS)
};

// The MLP's gate activations (each an op that gates the fused gate|up projection's output), and
// the names Python gives them.
enum class Activation : int64_t { kSilu = 0, kGeluTanh = 1 };
inline constexpr std::array<const char*, 2> kActivationNames = {"silu", "gelu_tanh"};

#define FASTLLM_DECODER_LAYER_FIELDS(REQUIRED, FIELD)                                            \
  REQUIRED(Projection, qkv,                                                                      \
           "[tokens, hidden] -> [tokens, (n_heads + 2 n_kv_heads) * head_dim]: q, then k, then " \
           "v.")                                                                                 \
  REQUIRED(Projection, o, "[tokens, n_heads * head_dim] -> [tokens, hidden].")                   \
  REQUIRED(int64_t, n_heads, "Query heads.")                                                     \
  REQUIRED(int64_t, n_kv_heads, "Key/value heads; n_heads is a multiple of it.")                 \
  REQUIRED(int64_t, head_dim, "Channels of a head.")                                             \
  REQUIRED(double, eps, "Every norm's epsilon.")                                                 \
  FIELD(OptionalTensor, input_norm, std::nullopt,                                                \
        "RMSNorm [hidden] of attention's input (Llama's pre-norm), or None.")                    \
  FIELD(OptionalTensor, post_attention_norm, std::nullopt,                                       \
        "RMSNorm [hidden] of attention's output (Gemma, OLMo 2), or None.")                      \
  FIELD(OptionalTensor, pre_feedforward_norm, std::nullopt,                                      \
        "RMSNorm [hidden] of the MLP's input, or None.")                                         \
  FIELD(OptionalTensor, post_feedforward_norm, std::nullopt,                                     \
        "RMSNorm [hidden] of the MLP's output, or None.")                                        \
  FIELD(std::optional<Projection>, gate_up, std::nullopt,                                        \
        "The dense MLP's [tokens, hidden] -> [tokens, 2 * intermediate] (the gate, then up); "   \
        "None with experts.")                                                                    \
  FIELD(std::optional<Projection>, down, std::nullopt,                                           \
        "The dense MLP's [tokens, intermediate] -> [tokens, hidden]; None with experts.")        \
  FIELD(std::optional<Experts>, experts, std::nullopt,                                           \
        "The mixture of experts that replaces gate_up and down, or None.")                       \
  FIELD(Activation, activation, Activation::kSilu, "The MLP's gate: 'silu' or 'gelu_tanh'.")     \
  FIELD(bool, use_rope, true, "False: a NoPE layer (no RoPE).")                                  \
  FIELD(int64_t, rope_table, 0, "Which of the model's RoPE tables the layer rotates with.")      \
  FIELD(int64_t, window_left, -1, "Keys left of each query it sees (-1: all): a sliding window.") \
  FIELD(std::optional<double>, scale, std::nullopt,                                              \
        "The query-key scale; None: head_dim ** -0.5.")                                          \
  FIELD(double, softcap, 0.0, "Attention scores become softcap * tanh(s / softcap) (0: not).")   \
  FIELD(OptionalTensor, q_norm, std::nullopt,                                                    \
        "RMSNorm of q before RoPE: per head [head_dim], or over all heads [n_heads * head_dim] " \
        "with qk_norm_per_head False; given with k_norm.")                                       \
  FIELD(OptionalTensor, k_norm, std::nullopt, "RMSNorm of k before RoPE, as q_norm.")            \
  FIELD(bool, qk_norm_per_head, true, "Whether q_norm and k_norm are per head.")              \
  FIELD(std::optional<ProjectionLoRA>, qkv_lora, std::nullopt,                                   \
        "LoRA adapter slots of qkv (q, k and v stacked along the rank), or None.")               \
  FIELD(std::optional<ProjectionLoRA>, o_lora, std::nullopt, "LoRA adapter slots of o, or None.") \
  FIELD(std::optional<ProjectionLoRA>, gate_up_lora, std::nullopt,                               \
        "LoRA adapter slots of gate_up (gate and up stacked along the rank), or None.")          \
  FIELD(std::optional<ProjectionLoRA>, down_lora, std::nullopt,                                  \
        "LoRA adapter slots of down, or None.")

// One decoder layer: attention, then the MLP, each a residual branch. Each branch's input is
// normalized when its input norm is set (input_norm, pre_feedforward_norm: Llama's pre-norm),
// its output when its output norm is set (post_attention_norm, post_feedforward_norm: Gemma's
// sandwich has all four, OLMo 2 only these). The MLP is dense (gate_up and down) or experts.
struct DecoderLayer {
  FASTLLM_RECORD(DecoderLayer, FASTLLM_DECODER_LAYER_FIELDS)
};

#define FASTLLM_DECODER_STEP_FIELDS(REQUIRED, FIELD)                                             \
  REQUIRED(at::Tensor, positions, "int64 [T]: each new token's position in its sequence.")       \
  REQUIRED(at::Tensor, cu_seqlens_q,                                                             \
           "int32 [B + 1]: offsets of each sequence's new tokens in the packed batch.")          \
  REQUIRED(int64_t, max_seqlen_q, "The most new tokens of any sequence.")                        \
  REQUIRED(at::Tensor, seq_lens, "int32 [B]: keys per sequence once the step's are written.")    \
  REQUIRED(at::Tensor, block_tables,                                                             \
           "int32 [B, max_blocks]: each sequence's cache blocks, in token order.")               \
  REQUIRED(at::Tensor, slot_mapping,                                                             \
           "int64 [T]: each new token's cache slot (block * block_size + offset; -1: none).")    \
  FIELD(bool, keys_are_new, false,                                                               \
        "Every sequence's keys are exactly its new tokens (a prefill with nothing cached): "     \
        "attention may run on the step's own K/V, packed.")                                     \
  FIELD(OptionalTensor, lora_slots, std::nullopt,                                                \
        "int32 [T]: each new token's LoRA adapter slot in the layers' *_lora (-1: none); None: " \
        "no adapter this step.")

// Where one step's tokens sit in the packed batch and in the paged cache: built once a step by
// the engine's model runner (or captured once by a CUDA graph) and read as it is by the layers.
struct DecoderStep {
  FASTLLM_RECORD(DecoderStep, FASTLLM_DECODER_STEP_FIELDS)
};

// Throw a ValueError (TypeError for a value of the wrong kind) naming the field that is wrong.
void check_record(const ProjectionPart& part);
void check_record(const ProjectionLoRA& lora);
void check_record(const Experts& experts);
void check_record(const DecoderLayer& layer);
void check_record(const DecoderStep& step);

// Layers run back to back, bound to the model's RoPE tables (one, or Gemma 3's global and local
// ones, indexed by each layer's rope_table) and, for tensor parallelism, to the process group
// their partial sums are all-reduced over.
class DecoderLayers {
 public:
  DecoderLayers(std::vector<DecoderLayer> layers, std::vector<at::Tensor> rope_tables,
                std::optional<std::string> group_name);

  // Runs the layers in order on x [tokens, hidden] and the residual stream (none before the
  // first layer), layer i writing its K/V into k_cache[i] / v_cache[i] ([num_layers,
  // num_blocks, block_size, n_kv_heads, head_dim]; pre_rope: they hold keys before RoPE, which
  // attention rotates as it reads them). Returns the last layer's output and the residual stream
  // before it; the model's final norm adds the one into the other.
  //
  // With a process group's name (the layers hold this rank's heads and MLP features, the o and
  // down projections its input columns), each of those two projections' outputs is summed over
  // the group (torch's functional all_reduce, then wait_tensor) before its residual add.
  std::pair<at::Tensor, at::Tensor> forward(at::Tensor x, std::optional<at::Tensor> residual,
                                            const DecoderStep& step, const at::Tensor& k_cache,
                                            const at::Tensor& v_cache, bool pre_rope) const;

  size_t size() const { return layers_.size(); }

 private:
  std::vector<DecoderLayer> layers_;
  std::vector<at::Tensor> rope_tables_;
  std::optional<std::string> group_name_;
};

}  // namespace fastllm
