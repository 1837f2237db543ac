#include "decoder/decoder_bindings.h"

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
  py::class_<DecoderLayer>(m, "DecoderLayer",
                           "One pre-norm decoder layer's weights and shape (see "
                           "fastllm.ops.DecoderLayers).")
      .def(py::init([](at::Tensor input_norm, at::Tensor post_attention_norm,
                       const std::vector<PartTuple>& qkv, const std::vector<PartTuple>& o,
                       const std::vector<PartTuple>& gate_up, const std::vector<PartTuple>& down,
                       std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
                       int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, double eps,
                       bool use_rope, int64_t window_left) {
             TORCH_CHECK_VALUE(q_norm.has_value() == k_norm.has_value(),
                               "q_norm and k_norm come together");
             TORCH_CHECK_VALUE(n_heads > 0 && n_kv_heads > 0 && head_dim > 0 &&
                                   n_heads % n_kv_heads == 0,
                               "n_heads, n_kv_heads and head_dim must be positive with n_heads a "
                               "multiple of n_kv_heads, got ", n_heads, ", ", n_kv_heads, ", ",
                               head_dim);
             return DecoderLayer{std::move(input_norm), std::move(post_attention_norm),
                                 std::move(q_norm), std::move(k_norm),
                                 to_projection(qkv, "qkv"), to_projection(o, "o"),
                                 to_projection(gate_up, "gate_up"), to_projection(down, "down"),
                                 n_heads, n_kv_heads, head_dim, eps, use_rope, window_left};
           }),
           py::kw_only(), py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("n_heads"), py::arg("n_kv_heads"), py::arg("head_dim"),
           py::arg("eps"), py::arg("use_rope"), py::arg("window_left"));

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
             at::Tensor cos_sin_cache, bool pre_rope) {
            const DecoderStep step{std::move(positions), std::move(cu_seqlens_q),
                                   std::move(seq_lens), std::move(block_tables),
                                   std::move(slot_mapping), max_seqlen_q, keys_are_new,
                                   std::move(k_cache), std::move(v_cache),
                                   std::move(cos_sin_cache), pre_rope};
            // Other Python threads (an asyncio server's loop) run while the layers do.
            py::gil_scoped_release release;
            return run_decoder_layers(self.layers, std::move(x), std::move(residual), step,
                                      self.group_name);
          },
          py::arg("x"), py::arg("residual"), py::arg("positions"), py::arg("cu_seqlens_q"),
          py::arg("max_seqlen_q"), py::arg("seq_lens"), py::arg("block_tables"),
          py::arg("slot_mapping"), py::arg("keys_are_new"), py::arg("k_cache"),
          py::arg("v_cache"), py::arg("cos_sin_cache"), py::arg("pre_rope"));
}

}  // namespace fastllm
