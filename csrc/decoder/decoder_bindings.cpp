#include "decoder/decoder_bindings.h"

#include <cmath>
#include <tuple>

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "decoder/decoder_layers.h"

namespace py = pybind11;

namespace fastllm {
namespace {

// (weight, weight_type or None for a float weight, bias or None) per run of output rows.
using PartTuple = std::tuple<at::Tensor, std::optional<int64_t>, std::optional<at::Tensor>>;

Projection to_projection(const std::vector<PartTuple>& parts, const char* name) {
  TORCH_CHECK_VALUE(!parts.empty(), name, " needs at least one (weight, weight_type, bias)");
  Projection projection;
  for (const auto& [weight, weight_type, bias] : parts) {
    TORCH_CHECK_VALUE(!weight_type.has_value() || *weight_type >= 0, name,
                      ": weight_type must be a ggml type id or None, got ", *weight_type);
    projection.parts.push_back({weight, weight_type.value_or(-1), bias});
  }
  return projection;
}

// The layers a model runs back to back, bound once (a Python list would be converted per call),
// and the tensor-parallel process group their partial sums are all-reduced over, if any.
struct DecoderLayers {
  std::vector<DecoderLayer> layers;
  std::optional<std::string> group_name;
};

}  // namespace

void bind_decoder(py::module_& m) {
  py::class_<Experts>(m, "Experts",
                      "A layer's mixture-of-experts MLP (see fastllm.ops.ExpertWeights).")
      .def(py::init([](const std::vector<PartTuple>& router, at::Tensor gate_up, at::Tensor down,
                       std::optional<int64_t> gate_up_type, std::optional<int64_t> down_type,
                       int64_t top_k, bool renormalize) {
             TORCH_CHECK_VALUE(top_k > 0, "top_k must be positive, got ", top_k);
             return Experts{to_projection(router, "router"), std::move(gate_up),
                            std::move(down), gate_up_type, down_type, top_k, renormalize};
           }),
           py::kw_only(), py::arg("router"), py::arg("gate_up"), py::arg("down"),
           py::arg("gate_up_type"), py::arg("down_type"), py::arg("top_k"),
           py::arg("renormalize"));

  py::class_<DecoderLayer>(m, "DecoderLayer",
                           "One decoder layer's weights and shape (see "
                           "fastllm.ops.DecoderLayers).")
      .def(py::init([](std::optional<at::Tensor> input_norm,
                       std::optional<at::Tensor> post_attention_norm,
                       std::optional<at::Tensor> pre_feedforward_norm,
                       std::optional<at::Tensor> post_feedforward_norm,
                       const std::vector<PartTuple>& qkv, const std::vector<PartTuple>& o,
                       const std::optional<std::vector<PartTuple>>& gate_up,
                       const std::optional<std::vector<PartTuple>>& down,
                       std::optional<Experts> experts, int64_t activation,
                       std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
                       bool qk_norm_per_head, int64_t n_heads, int64_t n_kv_heads,
                       int64_t head_dim, double eps, bool use_rope, int64_t rope_table,
                       int64_t window_left, std::optional<double> scale, double softcap) {
             TORCH_CHECK_VALUE(q_norm.has_value() == k_norm.has_value(),
                               "q_norm and k_norm come together");
             TORCH_CHECK_VALUE(n_heads > 0 && n_kv_heads > 0 && head_dim > 0 &&
                                   n_heads % n_kv_heads == 0,
                               "n_heads, n_kv_heads and head_dim must be positive with n_heads a "
                               "multiple of n_kv_heads, got ", n_heads, ", ", n_kv_heads, ", ",
                               head_dim);
             TORCH_CHECK_VALUE(experts.has_value() != (gate_up.has_value() && down.has_value()) &&
                                   gate_up.has_value() == down.has_value(),
                               "a layer has either gate_up and down or experts");
             TORCH_CHECK_VALUE(activation == int64_t(Activation::kSilu) ||
                                   activation == int64_t(Activation::kGeluTanh),
                               "activation must be 0 (silu) or 1 (gelu_tanh), got ", activation);
             TORCH_CHECK_VALUE(rope_table >= 0, "rope_table must be >= 0, got ", rope_table);
             TORCH_CHECK_VALUE(softcap >= 0 && std::isfinite(softcap),
                               "softcap must be finite and >= 0, got ", softcap);
             std::optional<Projection> gate_up_projection, down_projection;
             if (gate_up.has_value()) {
               gate_up_projection = to_projection(*gate_up, "gate_up");
               down_projection = to_projection(*down, "down");
             }
             return DecoderLayer{std::move(input_norm), std::move(post_attention_norm),
                                 std::move(pre_feedforward_norm),
                                 std::move(post_feedforward_norm), std::move(q_norm),
                                 std::move(k_norm), qk_norm_per_head, to_projection(qkv, "qkv"),
                                 to_projection(o, "o"), std::move(gate_up_projection),
                                 std::move(down_projection), std::move(experts),
                                 Activation(activation), n_heads, n_kv_heads, head_dim, eps,
                                 use_rope, rope_table, window_left, scale, softcap};
           }),
           py::kw_only(), py::arg("input_norm"), py::arg("post_attention_norm"),
           py::arg("pre_feedforward_norm"), py::arg("post_feedforward_norm"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("experts"),
           py::arg("activation"), py::arg("q_norm"), py::arg("k_norm"),
           py::arg("qk_norm_per_head"), py::arg("n_heads"), py::arg("n_kv_heads"),
           py::arg("head_dim"), py::arg("eps"), py::arg("use_rope"), py::arg("rope_table"),
           py::arg("window_left"), py::arg("scale"), py::arg("softcap"));

  py::class_<DecoderLayers>(m, "DecoderLayers",
                                         "Decoder layers run back to back (see "
                                         "fastllm.ops.DecoderLayers).")
      .def(py::init([](std::vector<DecoderLayer> layers, std::optional<std::string> group_name) {
             TORCH_CHECK_VALUE(!layers.empty(), "a decoder needs at least one layer");
             TORCH_CHECK_VALUE(!group_name.has_value() || !group_name->empty(),
                               "group_name must be a process group's name or None");
             return DecoderLayers{std::move(layers), std::move(group_name)};
           }),
           py::arg("layers"), py::arg("group_name") = py::none())
      .def("__len__", [](const DecoderLayers& self) { return self.layers.size(); })
      .def(
          "forward",
          [](const DecoderLayers& self, at::Tensor x,
             std::optional<at::Tensor> residual, at::Tensor positions, at::Tensor cu_seqlens_q,
             int64_t max_seqlen_q, at::Tensor seq_lens, at::Tensor block_tables,
             at::Tensor slot_mapping, bool keys_are_new, at::Tensor k_cache, at::Tensor v_cache,
             std::vector<at::Tensor> cos_sin_caches, bool pre_rope) {
            for (const DecoderLayer& layer : self.layers)
              TORCH_CHECK_VALUE(!layer.use_rope || layer.rope_table < int64_t(cos_sin_caches.size()),
                                "a layer rotates with RoPE table ", layer.rope_table, " but ",
                                cos_sin_caches.size(), " table(s) were given");
            const DecoderStep step{std::move(positions), std::move(cu_seqlens_q),
                                   std::move(seq_lens), std::move(block_tables),
                                   std::move(slot_mapping), max_seqlen_q, keys_are_new,
                                   std::move(k_cache), std::move(v_cache),
                                   std::move(cos_sin_caches), pre_rope};
            // Other Python threads (an asyncio server's loop) run while the layers do.
            py::gil_scoped_release release;
            return run_decoder_layers(self.layers, std::move(x), std::move(residual), step,
                                      self.group_name);
          },
          py::arg("x"), py::arg("residual"), py::arg("positions"), py::arg("cu_seqlens_q"),
          py::arg("max_seqlen_q"), py::arg("seq_lens"), py::arg("block_tables"),
          py::arg("slot_mapping"), py::arg("keys_are_new"), py::arg("k_cache"),
          py::arg("v_cache"), py::arg("cos_sin_caches"), py::arg("pre_rope"));
}

}  // namespace fastllm
