// fastllm._C: every op schema, declared once, and the pybind11 module for the C++ classes.
// Device implementations register themselves beside their code (*_cpu.cpp, *_cuda.cu,
// *_composite.cpp).
#include <pybind11/pybind11.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include "attention/attention.h"
#include "common/trusted_inputs.h"
#include "kv_cache/cache_write.h"
#include "kv_cache/kv_cache_bindings.h"
#include "linear/linear.h"
#include "mask_cache/mask_cache.h"
#include "rotary/rotary.h"
#include "sampling/philox.h"
#include "sampling/sampling.h"

TORCH_LIBRARY(fastllm, m) {
  // Attention over packed variable-length sequences (flash-attention varlen layout), causal mask
  // bottom-right aligned and computed from indices, GQA by index, optional sliding window.
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, *, bool causal=True, float? scale=None, "
      "int window_left=-1) -> Tensor");
  // The same, written into a preallocated `out` of q's shape (no allocation in a decode loop).
  m.def(
      "attention_out(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, *, bool causal=True, float? scale=None, "
      "int window_left=-1, Tensor(a!) out) -> ()");
  // Attention of packed queries over K/V read through block tables from paged caches
  // [num_blocks, block_size, n_kv_heads, head_dim]: decode and chunked prefill, same semantics.
  // With a cos|sin table the cached keys are pre-RoPE and rotated on read by their position.
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor cu_seqlens_q, int max_seqlen_q, *, bool causal=True, "
      "float? scale=None, int window_left=-1, Tensor? rotary_cos_sin_cache=None, "
      "bool rotary_is_neox=True) -> Tensor");
  // Writes new tokens' K/V into their cache slots (block * block_size + offset; < 0 skips).
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> ()");
  // x [rows, in] times weight [out, in] transposed, plus bias: F.linear for 2-D inputs. On the
  // CPU a few rows (decode) stream the weights once at memory bandwidth.
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  // Rotary position embedding applied in place to q and, if given, k.
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!)? k, Tensor cos_sin_cache, *, "
      "bool is_neox=True, int? rotary_dim=None) -> ()");
  // One token per row after temperature / top-k / top-p / min-p, without sorting the vocabulary;
  // the row's random number comes from Philox keyed by (seeds[row], offsets[row]) alone.
  m.def(
      "sample(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, "
      "Tensor seeds, Tensor offsets) -> Tensor");
  // The same, with the log-probabilities of the drawn token and the top num_logprobs tokens.
  m.def(
      "sample_with_logprobs(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, "
      "Tensor min_p, Tensor seeds, Tensor offsets, int num_logprobs) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
  // Logit bias, repetition (prompt and output), frequency and presence penalties, in place.
  m.def(
      "apply_penalties(Tensor(a!) logits, Tensor prompt_mask, Tensor output_counts, "
      "Tensor repetition_penalty, Tensor frequency_penalty, Tensor presence_penalty, "
      "Tensor? logit_bias=None) -> ()");
}

namespace py = pybind11;

namespace {

// A torch.device or a string such as "cpu" / "cuda:1".
at::Device to_device(const py::object& device) {
  return py::isinstance<py::str>(device) ? at::Device(device.cast<std::string>())
                                         : device.cast<at::Device>();
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastllm C++ core: op registry (torch.ops.fastllm) and C++ classes";
  m.attr("torch_version") = FASTLLM_TORCH_VERSION;
#if defined(CPU_CAPABILITY_AVX512)
  m.attr("cpu_capability") = "AVX512";
#elif defined(CPU_CAPABILITY_AVX2)
  m.attr("cpu_capability") = "AVX2";
#else
  m.attr("cpu_capability") = "DEFAULT";
#endif

  // c10's typed errors become the matching Python exceptions.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    }
  });

  py::class_<fastllm::MaskCache>(m, "MaskCache", R"doc(
Cache of additive causal masks: one buffer per (dtype, device), grown by doubling.

``get(len_q, len_k, dtype, device)`` returns a ``[len_q, len_k]`` view with 0 where query i may
see key j (``j <= i + len_k - len_q``, bottom-right aligned like ``fastllm.ops.attention``) and
-inf elsewhere. Views are read-only by contract: they alias the cached buffer.
The cache never holds more than ``max_bytes`` (default 1 GiB); a request that would grow it past
that raises ValueError. Safe to use from several threads.)doc")
      .def(py::init<int64_t>(), py::arg("max_bytes") = fastllm::MaskCache::kDefaultMaxBytes)
      .def(
          "get",
          [](fastllm::MaskCache& self, int64_t len_q, int64_t len_k, at::ScalarType dtype,
             const py::object& device) {
            const at::Device dev = to_device(device);
            py::gil_scoped_release release;
            return self.get(len_q, len_k, dtype, dev);
          },
          py::arg("len_q"), py::arg("len_k"), py::arg("dtype") = at::kFloat,
          py::arg("device") = py::str("cpu"))
      .def(
          "side",
          [](const fastllm::MaskCache& self, at::ScalarType dtype, const py::object& device) {
            return self.side(dtype, to_device(device));
          },
          py::arg("dtype"), py::arg("device") = py::str("cpu"),
          "Side of the buffer held for (dtype, device); 0 if none.")
      .def("clear", &fastllm::MaskCache::clear, "Drop every buffer (views already handed out stay valid).")
      .def_property_readonly("nbytes", &fastllm::MaskCache::nbytes)
      .def_property_readonly("max_bytes", &fastllm::MaskCache::max_bytes)
      .def("__repr__", [](const fastllm::MaskCache& self) {
        return "MaskCache(nbytes=" + std::to_string(self.nbytes()) +
               ", max_bytes=" + std::to_string(self.max_bytes()) + ")";
      });

  // The ATen compositions registered for MPS, callable on any device so tests can check them
  // against the reference where no MPS device exists.
  auto composite = m.def_submodule("composite", "ATen-composite implementations of the ops");
  composite.def(
      "attention_out",
      [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
         int64_t max_seqlen_k, bool causal, std::optional<double> scale, int64_t window_left,
         at::Tensor out) {
        fastllm::attention_out_composite(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, causal, scale, window_left, out);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"),
      py::arg("max_seqlen_q"), py::arg("max_seqlen_k"), py::kw_only(), py::arg("causal") = true,
      py::arg("scale") = py::none(), py::arg("window_left") = -1, py::arg("out"));
  composite.def("paged_attention", &fastllm::paged_attention_composite, py::arg("q"),
                py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
                py::arg("seq_lens"), py::arg("cu_seqlens_q"), py::arg("max_seqlen_q"),
                py::kw_only(), py::arg("causal") = true, py::arg("scale") = py::none(),
                py::arg("window_left") = -1, py::arg("rotary_cos_sin_cache") = py::none(),
                py::arg("rotary_is_neox") = true);
  composite.def(
      "reshape_and_cache",
      [](const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
         const at::Tensor& slot_mapping) {
        fastllm::reshape_and_cache_composite(key, value, k_cache, v_cache, slot_mapping);
      },
      py::arg("key"), py::arg("value"), py::arg("k_cache"), py::arg("v_cache"),
      py::arg("slot_mapping"));
  composite.def("linear", &fastllm::linear_composite, py::arg("x"), py::arg("weight"),
                py::arg("bias") = py::none());
  composite.def(
      "rotary_embedding",
      [](const at::Tensor& positions, at::Tensor q, std::optional<at::Tensor> k,
         const at::Tensor& cos_sin_cache, bool is_neox, std::optional<int64_t> rotary_dim) {
        fastllm::rotary_embedding_composite(positions, q, k, cos_sin_cache, is_neox, rotary_dim);
      },
      py::arg("positions"), py::arg("q"), py::arg("k"), py::arg("cos_sin_cache"), py::kw_only(),
      py::arg("is_neox") = true, py::arg("rotary_dim") = py::none());
  composite.def("sample", &fastllm::sample_composite, py::arg("logits"), py::arg("temperature"),
                py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("seeds"),
                py::arg("offsets"));
  composite.def("sample_with_logprobs", &fastllm::sample_with_logprobs_composite,
                py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
                py::arg("min_p"), py::arg("seeds"), py::arg("offsets"), py::arg("num_logprobs"));
  composite.def(
      "apply_penalties",
      [](at::Tensor logits, const at::Tensor& prompt_mask, const at::Tensor& output_counts,
         const at::Tensor& repetition_penalty, const at::Tensor& frequency_penalty,
         const at::Tensor& presence_penalty, std::optional<at::Tensor> logit_bias) {
        fastllm::apply_penalties_composite(logits, prompt_mask, output_counts, repetition_penalty,
                                           frequency_penalty, presence_penalty, logit_bias);
      },
      py::arg("logits"), py::arg("prompt_mask"), py::arg("output_counts"),
      py::arg("repetition_penalty"), py::arg("frequency_penalty"), py::arg("presence_penalty"),
      py::arg("logit_bias") = py::none());

  m.def(
      "philox_uniform",
      [](uint64_t seed, uint64_t offset) { return fastllm::philox_uniform(seed, offset); },
      py::arg("seed"), py::arg("offset"),
      "The uniform number in [0, 1) that sampling draws for (seed, offset): Philox4x32-10.");
  m.def("set_trusted_inputs", &fastllm::set_trusted_inputs, py::arg("trusted"),
        "Sets this thread's trusted-inputs flag (see fastllm.ops.trusted_inputs); returns the "
        "previous value.");
  m.def("trusted_inputs", &fastllm::trusted_inputs, "This thread's trusted-inputs flag.");
  fastllm::bind_kv_cache(m);
}
