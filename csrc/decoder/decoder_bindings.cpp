#include "decoder/decoder_bindings.h"

#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "common/checks.h"
#include "decoder/decoder_layers.h"

namespace py = pybind11;

namespace fastllm {
namespace {

template <class T>
struct IsOptional : std::false_type {};
template <class T>
struct IsOptional<std::optional<T>> : std::true_type {
  using Value = T;
};

// What a field of C++ type T takes in Python, for error messages.
template <class T>
std::string python_type() {
  if constexpr (IsOptional<T>::value) return python_type<typename IsOptional<T>::Value>() + " or None";
  else if constexpr (std::is_same_v<T, at::Tensor>) return "a Tensor";
  else if constexpr (std::is_same_v<T, Projection>) return "a list of ProjectionPart";
  else if constexpr (std::is_same_v<T, Experts>) return "an Experts";
  else if constexpr (std::is_same_v<T, ProjectionLoRA>) return "a ProjectionLoRA";
  else if constexpr (std::is_same_v<T, bool>) return "a bool";
  else if constexpr (std::is_same_v<T, int64_t>) return "an int";
  else if constexpr (std::is_same_v<T, double>) return "a float";
  else static_assert(!sizeof(T), "a record field of a type the bindings do not convert");
}

std::string brief_repr(py::handle value) {
  std::string text = py::repr(value);
  return text.size() <= 80 ? text : text.substr(0, 77) + "...";
}

// A field's value from Python: `value` as C++ type T, or a TypeError naming the field. A bool
// field takes a bool only (pybind's conversion would take None as False); an activation takes
// one of kActivationNames.
template <class T>
T from_python(py::handle value, const std::string& field) {
  if constexpr (std::is_same_v<T, Activation>) {
    const std::string names = "'silu' or 'gelu_tanh'";
    if (!py::isinstance<py::str>(value))
      throw py::type_error(field + " must be " + names + ", got " + brief_repr(value));
    const auto name = value.cast<std::string>();
    for (size_t i = 0; i < kActivationNames.size(); ++i)
      if (name == kActivationNames[i]) return Activation(i);
    throw py::value_error(field + " must be " + names + ", got " + brief_repr(value));
  } else {
    if (!std::is_same_v<T, bool> || py::isinstance<py::bool_>(value)) {
      try {
        return value.cast<T>();
      } catch (const py::cast_error&) {
      }
    }
    throw py::type_error(field + " must be " + python_type<T>() + ", got " + brief_repr(value));
  }
}

template <class T>
py::object to_python(const T& value) {
  if constexpr (std::is_same_v<T, Activation>) return py::str(kActivationNames[size_t(value)]);
  else return py::cast(value);
}

// A field's value as a repr shows it: a tensor by its shape, dtype and device.
template <class T>
std::string describe(const T& value) {
  if constexpr (std::is_same_v<T, at::Tensor>)
    return "Tensor(" + c10::str(value.sizes()) + ", " + dtype_name(value.scalar_type()) + ", " +
           value.device().str() + ")";
  else if constexpr (std::is_same_v<T, OptionalTensor>)
    return value.has_value() ? describe(*value) : "None";
  else
    return py::repr(to_python(value));
}

// Sets the fields of `record` given in `kwargs` (a TypeError for a name that is no field).
template <class Record>
void assign(Record& record, const char* record_name, const py::kwargs& kwargs) {
  for (const auto& [key, value] : kwargs) {
    const auto name = py::cast<std::string>(key);
    bool found = false;
    std::apply(
        [&](const auto&... field) {
          (
              [&] {
                using T = std::remove_reference_t<decltype(record.*field.member)>;
                if (found || name != field.name) return;
                record.*field.member = from_python<T>(value, name);
                found = true;
              }(),
              ...);
        },
        Record::fields());
    if (!found) throw py::type_error(std::string(record_name) + " has no field " + name);
  }
}

// A record from positional values (in field order) and keyword ones, checked.
template <class Record>
Record construct(const char* record_name, const py::args& args, const py::kwargs& kwargs) {
  constexpr size_t count = std::tuple_size_v<decltype(Record::fields())>;
  if (args.size() > count)
    throw py::type_error(std::string(record_name) + " takes at most " + std::to_string(count) +
                         " positional values, got " + std::to_string(args.size()));
  Record record;
  size_t index = 0;
  std::apply(
      [&](const auto&... field) {
        (
            [&] {
              using T = std::remove_reference_t<decltype(record.*field.member)>;
              const bool by_keyword = kwargs.contains(field.name);
              if (index < args.size()) {
                if (by_keyword)
                  throw py::type_error(std::string(record_name) + " got two values of " +
                                       field.name);
                record.*field.member = from_python<T>(args[index], field.name);
              } else if (field.required && !by_keyword) {
                throw py::type_error(std::string(record_name) + " needs field " + field.name);
              }
              ++index;
            }(),
            ...);
      },
      Record::fields());
  assign(record, record_name, kwargs);
  check_record(record);
  return record;
}

// Binds Record as a Python class: built by position or keyword, fields read-only, replace()
// for a checked copy with some fields changed, a repr, and `fields` (the names, in order).
template <class Record>
void bind_record(py::module_& m, const char* name, const std::string& summary) {
  std::string doc = summary + "\n\nFields (by position in this order, or by keyword):\n";
  py::list names;
  std::apply(
      [&](const auto&... field) {
        ((doc += std::string("\n- ``") + field.name + "``" + (field.required ? "" : " (optional)") +
                 ": " + field.doc,
          names.append(field.name)),
         ...);
      },
      Record::fields());
  py::class_<Record> cls(m, name, doc.c_str());
  cls.def(py::init([name](const py::args& args, const py::kwargs& kwargs) {
    return construct<Record>(name, args, kwargs);
  }));
  std::apply(
      [&](const auto&... field) {
        (cls.def_property_readonly(
             field.name,
             [member = field.member](const Record& record) { return to_python(record.*member); },
             field.doc),
         ...);
      },
      Record::fields());
  cls.def(
      "replace",
      [name](const Record& self, const py::kwargs& changes) {
        Record record = self;
        assign(record, name, changes);
        check_record(record);
        return record;
      },
      "A copy with the fields given by keyword changed, checked as a new record is.");
  cls.def("__repr__", [name](const Record& self) {
    std::string text = std::string(name) + "(";
    const char* separator = "";
    std::apply(
        [&](const auto&... field) {
          ((text += separator + std::string(field.name) + "=" + describe(self.*field.member),
            separator = ", "),
           ...);
        },
        Record::fields());
    return text + ")";
  });
  cls.attr("fields") = py::tuple(names);
}

// The layers' group name: None or a process group's name (a ValueError for anything else).
std::optional<std::string> group_name_of(const py::object& group_name) {
  if (group_name.is_none()) return std::nullopt;
  TORCH_CHECK_VALUE(py::isinstance<py::str>(group_name) && !group_name.cast<std::string>().empty(),
                    "group_name must be a process group's name or None, got ",
                    brief_repr(group_name));
  return group_name.cast<std::string>();
}

}  // namespace

void bind_decoder(py::module_& m) {
  bind_record<ProjectionPart>(
      m, "ProjectionPart",
      "A run of a projection's output rows: a float ``weight`` run by fastllm.ops.linear, or "
      "ggml blocks run by fastllm.ops.quantized_linear.");
  bind_record<ProjectionLoRA>(
      m, "ProjectionLoRA",
      "The LoRA adapters a projection may add, one per slot: a token of slot s (DecoderStep's "
      "``lora_slots``) gets ``lora_b[s] @ (lora_a[s] @ x)`` added to the projection's output, by "
      "fastllm.ops.add_lora.");
  bind_record<Experts>(
      m, "Experts",
      "A mixture-of-experts MLP, run by fastllm.ops.moe: the ``router`` projection's logits pick "
      "each token's ``top_k`` experts.");
  bind_record<DecoderLayer>(
      m, "DecoderLayer",
      "One decoder layer: attention, then the MLP, each a residual branch. A branch's input is "
      "RMS-normalized when its input norm is given (``input_norm``, ``pre_feedforward_norm``: "
      "Llama's pre-norm), its output when its output norm is (``post_attention_norm``, "
      "``post_feedforward_norm``: Gemma has all four, OLMo 2 only these two). Each projection is "
      "its parts' outputs side by side (one part unless a file mixes formats).");
  bind_record<DecoderStep>(
      m, "DecoderStep",
      "Where one step's tokens sit in the packed batch and in the paged KV cache: built once a "
      "step by the engine's model runner (a CUDA graph captures one) and read as it is by "
      "fastllm.ops.DecoderLayers.");

  py::class_<DecoderLayers>(m, "DecoderLayers", R"doc(
Decoder layers bound to their weights (``DecoderLayer`` records), the model's RoPE tables
(``fastllm.ops.rope_cos_sin_cache``, indexed by each layer's ``rope_table``) and, for tensor
parallelism, a ``torch.distributed`` process group's name (``group.group_name``), run back to
back by one call. Rebuild it after replacing or moving the weights or the tables.

With ``group_name`` the layers are one tensor-parallel rank's shard: the outputs of the o and down
projections (partial sums over this rank's heads and MLP features) are all-reduced over the group
before each residual add, from C++ through ``torch.ops._c10d_functional`` (``all_reduce`` then
``wait_tensor``), so a step stays one call on every rank. Every rank of the group must make the
same calls in the same order.)doc")
      .def(py::init([](const py::sequence& layers, std::vector<at::Tensor> rope_tables,
                       const py::object& group_name) {
             std::vector<DecoderLayer> records;
             for (size_t i = 0; i < layers.size(); ++i) {
               const py::object layer = layers[i];
               if (!py::isinstance<DecoderLayer>(layer))
                 throw py::type_error("layers[" + std::to_string(i) +
                                      "] must be a DecoderLayer, got " + brief_repr(layer));
               records.push_back(layer.cast<DecoderLayer>());
             }
             return DecoderLayers(std::move(records), std::move(rope_tables),
                                  group_name_of(group_name));
           }),
           py::arg("layers"), py::arg("rope_tables"), py::arg("group_name") = py::none())
      .def("__len__", &DecoderLayers::size)
      .def(
          "__call__",
          [](const DecoderLayers& self, at::Tensor x, std::optional<at::Tensor> residual,
             const DecoderStep& step, const at::Tensor& k_cache, const at::Tensor& v_cache,
             bool pre_rope) {
            // Other Python threads (an asyncio server's loop) run while the layers do.
            py::gil_scoped_release release;
            return self.forward(std::move(x), std::move(residual), step, k_cache, v_cache,
                                pre_rope);
          },
          py::arg("x"), py::arg("residual"), py::arg("step"), py::arg("k_cache"),
          py::arg("v_cache"), py::arg("pre_rope"), R"doc(
Runs the layers on one step's packed batch.

``x`` ``[tokens, hidden]`` is the first layer's input; with ``residual`` None it is also the
residual stream (the embeddings), else the previous sublayer's output, which the first norm adds
into ``residual`` in place. ``step`` is the step's ``DecoderStep``. Layer ``i`` writes its new K/V
into ``k_cache[i]`` / ``v_cache[i]`` (``[num_layers, num_blocks, block_size, n_kv_heads,
head_dim]``, paged pools as fastllm.ops.reshape_and_cache takes them) and attends through the
block tables (fastllm.ops.paged_attention, or fastllm.ops.attention on the step's own K/V when
``step.keys_are_new``); ``pre_rope``: the caches hold keys before RoPE, rotated as attention reads
them.

Returns ``(out, residual)``: the last layer's MLP output and the residual stream before it (the
model's final norm adds one into the other).)doc");
}

}  // namespace fastllm
