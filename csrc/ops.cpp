// fastllm._C: every op schema, declared once, and the pybind11 module for the C++ classes.
// Device implementations register themselves beside their code (*_cpu.cpp, *_cuda.cu,
// *_composite.cpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include "common/checks.h"
#include "common/cpu_isa.h"
#include "common/batch_invariant.h"
#include "common/trusted_inputs.h"
#include "decoder/decoder_bindings.h"
#include "gguf/gguf_bindings.h"
#include "kv_cache/kv_cache_bindings.h"
#include "mask_cache/mask_cache.h"
#include "quantized/quantized.h"
#include "quantized/quantized_cpu.h"
#include "sampling/philox.h"

namespace {

// Every op's schema, declared once. Two namespaces are defined from them: fastllm, whose ops run
// each device's kernel, and fastllm_composite, whose ops run the ATen compositions (what MPS
// runs) on any device (common/composite.h registers both).
constexpr const char* kSchemas[] = {
    // Attention over packed variable-length sequences (flash-attention varlen layout), causal
    // mask bottom-right aligned and computed from indices, GQA by index, optional sliding window,
    // optional logit soft-cap (Gemma 2: softcap > 0 turns each scaled score s into
    // softcap * tanh(s / softcap) before the mask and softmax; 0 is off).
    "attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    "int max_seqlen_q, int max_seqlen_k, *, bool causal=True, float? scale=None, "
    "int window_left=-1, float softcap=0.0) -> Tensor",
    // The same, written into a preallocated `out` of q's shape (no allocation in a decode loop).
    "attention_out(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    "int max_seqlen_q, int max_seqlen_k, *, bool causal=True, float? scale=None, "
    "int window_left=-1, Tensor(a!) out, float softcap=0.0) -> ()",
    // Attention of packed queries over K/V read through block tables from paged caches
    // [num_blocks, block_size, n_kv_heads, head_dim]: decode and chunked prefill, same
    // semantics. With a cos|sin table the cached keys are pre-RoPE and rotated on read by their
    // position. Under float32 q the caches may be bfloat16 / float16. softcap as in attention.
    "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
    "Tensor seq_lens, Tensor cu_seqlens_q, int max_seqlen_q, *, bool causal=True, "
    "float? scale=None, int window_left=-1, Tensor? rotary_cos_sin_cache=None, "
    "bool rotary_is_neox=True, float softcap=0.0) -> Tensor",
    // Writes new tokens' K/V into their cache slots (block * block_size + offset; < 0 skips),
    // rounded to the caches' dtype where it is narrower.
    "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor slot_mapping) -> ()",
    // x [rows, in] times weight [out, in] transposed, plus bias: F.linear for 2-D inputs. On
    // the CPU a few rows (decode) stream the weights once at memory bandwidth.
    "linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor",
    // Batched LoRA in place (Punica's BGMV): y[t] += lora_b[s] @ (lora_a[s] @ x[t]) for each
    // token t of slot s = token_slots[t] (int32; -1: none), adapters lora_a [S, R, in] and
    // lora_b [S, out, R] with 1 <= R <= 1024; the shrink rounded to x's dtype, the expand added
    // to y with one rounding.
    "add_lora(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor token_slots) -> ()",
    // Rotary position embedding applied in place to q and, if given, k.
    "rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!)? k, Tensor cos_sin_cache, *, "
    "bool is_neox=True, int? rotary_dim=None) -> ()",
    // An attention block's steps between the QKV projection and attention, in one op: q and
    // key (views of the projection) RMS-normalized per head with q_norm / k_norm if given, then
    // rotated by the cos|sin table if given (key only with rotate_keys: False caches keys
    // before RoPE), both in place; then key and value written to their cache slots as
    // reshape_and_cache writes them.
    "rotary_and_cache(Tensor positions, Tensor(a!) q, Tensor(b!) key, Tensor value, "
    "Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping, Tensor? cos_sin_cache, "
    "Tensor? q_norm=None, Tensor? k_norm=None, float eps=1e-06, *, bool is_neox=True, "
    "bool rotate_keys=True) -> ()",
    // One token per row after temperature / top-k / top-p / min-p, without sorting the
    // vocabulary; the row's random number comes from Philox keyed by (seeds[row], offsets[row])
    // alone.
    "sample(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, "
    "Tensor seeds, Tensor offsets) -> Tensor",
    // The same, with the log-probabilities of the drawn token and the top num_logprobs tokens.
    "sample_with_logprobs(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, "
    "Tensor min_p, Tensor seeds, Tensor offsets, int num_logprobs) -> "
    "(Tensor, Tensor, Tensor, Tensor)",
    // Logit bias, repetition (prompt and output), frequency and presence penalties, in place.
    "apply_penalties(Tensor(a!) logits, Tensor prompt_mask, Tensor output_counts, "
    "Tensor repetition_penalty, Tensor frequency_penalty, Tensor presence_penalty, "
    "Tensor? logit_bias=None) -> ()",
    // x [rows, in] times a block-quantized weight transposed, plus bias. The weight is ggml's
    // blocks row by row, uint8 [out, row bytes], weight_type a ggml type id (Q4_0 2, Q4_1 3,
    // Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14), or fastllm's FP8_E4M3 blocks (2000:
    // float8_e4m3fn codes, a float32 scale per 32). A few rows (decode) stream the blocks:
    // integer dot products on the CPU (FP8: float32 ones), a GEMV decoding them in registers on
    // CUDA.
    "quantized_linear(Tensor x, Tensor weight, int weight_type, Tensor? bias=None) -> Tensor",
    // Rows of such a weight as floats [rows, in] of `dtype`.
    "dequantize(Tensor weight, int weight_type, ScalarType dtype) -> Tensor",
    // RMSNorm of x [..., hidden] times weight, HF's arithmetic (normalized in float32, rounded
    // to x's dtype, then scaled).
    "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    // The pre-norm block's residual step in place: residual += x, then x = rms_norm(residual).
    "add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()",
    // SwiGLU's gate over a fused gate|up projection [rows, 2 * d]: silu(gate) * up, [rows, d].
    "silu_and_mul(Tensor x) -> Tensor",
    // GeGLU's gate (Gemma) over a fused gate|up projection [rows, 2 * d]:
    // gelu(gate, approximate="tanh") * up, [rows, d].
    "gelu_tanh_and_mul(Tensor x) -> Tensor",
    // A mixture-of-experts MLP block (Qwen3-MoE, Mixtral), HF's eager arithmetic: each token's
    // top_k experts by softmax(router_logits) in float32 (their weights renormalized to sum 1
    // if asked), each expert a SwiGLU MLP (gate_up: its gate rows then its up rows; down),
    // their outputs summed with the weights. Experts float [E, rows, in], or blocks uint8
    // [E, rows, row bytes] with their type id (a ggml type, or FP8_E4M3 2000).
    "moe(Tensor x, Tensor router_logits, Tensor gate_up, Tensor down, int top_k, "
    "bool renormalize, *, int? gate_up_type=None, int? down_type=None) -> Tensor",
};

}  // namespace

TORCH_LIBRARY(fastllm, m) {
  for (const char* schema : kSchemas) m.def(schema);
}

TORCH_LIBRARY(fastllm_composite, m) {
  for (const char* schema : kSchemas) m.def(schema);
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

  m.def(
      "philox_uniform",
      [](uint64_t seed, uint64_t offset) { return fastllm::philox_uniform(seed, offset); },
      py::arg("seed"), py::arg("offset"),
      "The uniform number in [0, 1) that sampling draws for (seed, offset): Philox4x32-10.");
  m.def("set_trusted_inputs", &fastllm::set_trusted_inputs, py::arg("trusted"),
        "Sets this thread's trusted-inputs flag (see fastllm.ops.trusted_inputs); returns the "
        "previous value.");
  m.def("trusted_inputs", &fastllm::trusted_inputs, "This thread's trusted-inputs flag.");
  m.def("set_batch_invariant", &fastllm::set_batch_invariant, py::arg("invariant"),
        "Sets this thread's batch-invariant flag (see fastllm.ops.batch_invariant); returns the "
        "previous value.");
  m.def("batch_invariant", &fastllm::batch_invariant, "This thread's batch-invariant flag.");
  m.def(
      "cpu_isas",
      [] {
        std::vector<std::string> names;
        for (auto isa : fastllm::supported_cpu_isas()) names.push_back(fastllm::cpu_isa_name(isa));
        return names;
      },
      "The instruction sets this CPU runs the per-ISA CPU kernels with, widest first.");
  m.def(
      "cpu_isa", [] { return std::string(fastllm::cpu_isa_name(fastllm::cpu_isa())); },
      "The instruction set the per-ISA CPU kernels run with: the widest this CPU has, or the "
      "environment variable FASTLLM_CPU_ISA (amx, avx512, avx2 or scalar), read once.");
  m.def(
      "set_cpu_isa",
      [](const std::string& name) {
        const auto previous = fastllm::set_cpu_isa(fastllm::parse_cpu_isa(name));
        return std::string(fastllm::cpu_isa_name(previous));
      },
      py::arg("name"),
      "Runs the per-ISA CPU kernels with instruction set `name` (one of cpu_isas()) from now on, "
      "on every thread; returns the previous one.");
  m.def(
      "cpu_interleaved_types",
      [] {
        std::vector<int64_t> types;
        for (const auto format : fastllm::kInterleavedFormats)
          if (fastllm::isa_kernels(format).interleaved_decode_rows)
            types.push_back(int64_t(format));
        return types;
      },
      "The ggml weight types whose interleaved layout (interleave_rows) the CPU kernels of the "
      "instruction set in use decode as it is; the others' rows are put back in order.");
  m.def(
      "interleave_rows",
      [](const at::Tensor& weight, int64_t weight_type) {
        TORCH_CHECK_VALUE(fastllm::is_interleaved_type(fastllm::kInterleavedTypes + weight_type),
                          "interleaving takes ", fastllm::interleaved_formats_text(0),
                          " blocks, got weight_type ", weight_type);
        return fastllm::interleave_rows(weight, fastllm::BlockFormat(weight_type));
      },
      py::arg("weight"), py::arg("weight_type"),
      "A Q4_0, Q4_1, Q5_0, Q8_0, Q4_K or Q6_K weight [rows, row bytes] (rows a multiple of "
      "16) in the CPU decode kernels' layout, weight type 1000 + weight_type: each group of 16 "
      "rows interleaved.");
  m.def(
      "deinterleave_rows",
      [](const at::Tensor& weight, int64_t weight_type, const at::Tensor& rows) {
        TORCH_CHECK_VALUE(fastllm::is_interleaved_type(weight_type),
                          "weight_type must be an interleaved type, ",
                          fastllm::interleaved_formats_text(fastllm::kInterleavedTypes), "; got ",
                          weight_type);
        int64_t in_features = 0;
        bool interleaved = false;
        const auto format =
            fastllm::check_quantized_weight(weight, weight_type, in_features, &interleaved);
        TORCH_CHECK_VALUE(weight.device().is_cpu(), "an interleaved weight is the CPU's, got "
                          "one on ", weight.device());
        TORCH_CHECK_VALUE(rows.dim() == 1 && rows.device().is_cpu(),
                          "rows must be a 1-D tensor on the CPU, got shape ", rows.sizes(),
                          " on ", rows.device());
        TORCH_CHECK_TYPE(at::isIntegralType(rows.scalar_type(), /*includeBool=*/false),
                         "rows must be integers, got ", fastllm::dtype_name(rows.scalar_type()));
        return fastllm::deinterleave_rows(weight, format, rows.to(at::kLong).contiguous());
      },
      py::arg("weight"), py::arg("weight_type"), py::arg("rows"),
      "Rows `rows` (1-D integers) of a weight of interleaved type `weight_type` (1000 + the "
      "ggml type, interleave_rows' result), as that ggml type's blocks [len(rows), row bytes].");
  fastllm::bind_kv_cache(m);
  fastllm::bind_decoder(m);
  fastllm::bind_gguf(m);
}
