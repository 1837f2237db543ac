// The mixture-of-experts block on the CPU.
//
// Routing is HF's own ATen ops (route_tokens_composite): a bfloat16 router ties logits often,
// and torch.topk's CPU kernel does not break ties by index, so only its own choice picks HF's
// experts. The (token, choice) pairs are then counting-sorted by expert, each expert's in token
// order, and the tokens' rows gathered in that order, so each expert's rows are one block.
// Each projection runs expert by expert over its block: an expert with few rows (every expert
// of a decode step) streams its weight rows once through linear's or quantized_linear's
// few-row kernel, and all such experts share one parallel region over their weight rows (a
// decode step's chosen experts: one fork per projection, not one per expert); an expert with
// more rows than those kernels take (their own limits) runs linear's or quantized_linear's
// many-row path, a GEMM. Only the chosen experts' weights are read. silu_and_mul gates each
// row, and each token's weighted expert outputs are added in increasing expert order, each
// product and each sum rounded to x's dtype, as HF's eager index_add_ adds them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "common/batch_invariant.h"
#include "common/dispatch.h"
#include "common/vec.h"
#include "linear/linear_cpu_kernel.h"
#include "moe/moe.h"
#include "quantized/quantized_cpu.h"

namespace fastllm {
namespace {

// The typed handle of op fastllm::<name>, looked up once.
template <class Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

at::Tensor linear_op(const at::Tensor& x, const at::Tensor& weight) {
  static const auto handle =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>(
          "fastllm::linear");
  return handle.call(x, weight, std::nullopt);
}

at::Tensor quantized_linear_op(const at::Tensor& x, const at::Tensor& weight, int64_t type) {
  static const auto handle =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                    const std::optional<at::Tensor>&)>("fastllm::quantized_linear");
  return handle.call(x, weight, type, std::nullopt);
}

at::Tensor silu_and_mul_op(const at::Tensor& x) {
  static const auto handle = op<at::Tensor(const at::Tensor&)>("fastllm::silu_and_mul");
  return handle.call(x);
}

// One projection of every expert: float [num_experts, out, in], or blocks
// [num_experts, out, row bytes] of type `type` (a ggml type, or FP8_E4M3).
struct Projection {
  const at::Tensor& weight;
  const std::optional<int64_t>& type;
};

// The pairs' rows sorted by expert: expert e's are [first[e], first[e + 1]).
using ExpertRows = std::vector<int64_t>;

// The most rows an expert streams its weights for: the few-row kernels' own limits
// (linear_cpu.cpp, quantized_cpu.cpp); batch-invariant, every expert streams.
int64_t stream_limit(const at::Tensor& x, const Projection& p) {
  if (batch_invariant()) return std::numeric_limits<int64_t>::max();
  if (p.type.has_value()) return kMaxStreamRows;
  if (p.weight.scalar_type() != x.scalar_type()) return kMaxUpcastStreamRows;
  return max_stream_rows(x.scalar_type());
}

// Runs f(e, begin, end) over the weight rows of every expert e in `streamed` in one parallel
// region, each task taking the same share of every expert's weight rows (whole tiles of 8): the
// threads finish together whatever each expert's row count, and they read one expert's
// activations at the same time (cores that share a cache share them). Splitting the
// (expert, row) range into contiguous chunks instead gives each thread its own experts, which
// is slower even than one linear call per expert.
template <typename F>
void for_streamed_rows(const std::vector<int64_t>& streamed, int64_t n_out, int64_t grain,
                       const F& f) {
  constexpr int64_t kTile = 8;
  const int64_t total = int64_t(streamed.size()) * n_out;
  const int64_t parts =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total / grain));
  const auto share = [&](int64_t part) {  // where part `part`'s rows begin
    if (part == parts) return n_out;
    return std::min(n_out, (part * n_out / parts + kTile / 2) / kTile * kTile);
  };
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part) {
      const int64_t n0 = share(part), n1 = share(part + 1);
      if (n0 < n1)
        for (const int64_t e : streamed) f(e, n0, n1);
    }
  });
}

// y's rows of the experts in `streamed` = their rows of x (dense [pairs, k_len]) times their
// float weights transposed, in one parallel region.
template <typename x_t, typename w_t, typename out_t>
void stream_float_experts(const x_t* x, int64_t k_len, const at::Tensor& weight,
                          const std::vector<int64_t>& streamed, const ExpertRows& first,
                          out_t* y, int64_t n_out) {
  const w_t* w = weight.const_data_ptr<w_t>();
  const int64_t expert_stride = weight.stride(0), ldw = weight.stride(1);
  const out_t* no_bias = nullptr;
  for_streamed_rows(streamed, n_out, stream_grain(k_len, sizeof(w_t)),
                    [&](int64_t e, int64_t begin, int64_t end) {
    const int64_t row = first[e];
    stream_weight_rows(x + row * k_len, first[e + 1] - row, w + e * expert_stride, ldw, no_bias,
                       y + row * n_out, n_out, begin, end, k_len);
  });
}

void stream_float(const at::Tensor& x, const at::Tensor& weight,
                  const std::vector<int64_t>& streamed, const ExpertRows& first, at::Tensor& y) {
  const int64_t k_len = x.size(1), n_out = y.size(1);
  if (weight.scalar_type() != x.scalar_type()) {  // 16-bit weights under float32 x
    const float* xs = x.const_data_ptr<float>();
    float* ys = y.mutable_data_ptr<float>();
    AT_DISPATCH_SWITCH(weight.scalar_type(), "fastllm::moe_cpu",
                       AT_DISPATCH_CASE(at::kBFloat16, [&] {
      stream_float_experts<float, scalar_t, float>(xs, k_len, weight, streamed, first, ys, n_out);
    }) AT_DISPATCH_CASE(at::kHalf, [&] {
      stream_float_experts<float, scalar_t, float>(xs, k_len, weight, streamed, first, ys, n_out);
    }));
    return;
  }
  FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fastllm::moe_cpu", [&] {
    scalar_t* ys = y.mutable_data_ptr<scalar_t>();
#ifdef FASTLLM_BF16_DOT
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {  // bf16 pairs multiplied natively
      stream_float_experts<scalar_t, scalar_t, scalar_t>(x.const_data_ptr<scalar_t>(), k_len,
                                                         weight, streamed, first, ys, n_out);
      return;
    }
#endif
    // The activations once in float32 (linear's few-row kernel reads them so).
    const auto x_float = x.to(at::kFloat).contiguous();
    stream_float_experts<float, scalar_t, scalar_t>(x_float.const_data_ptr<float>(), k_len,
                                                    weight, streamed, first, ys, n_out);
  });
}

// The same for block-quantized weights: quantized_linear's decode rows (integer dot products
// with the activations quantized per block of 32; FP8's float32 ones with the activations as
// float32, as they are), float32 sums rounded once to y's dtype.
void stream_quantized(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                      const std::vector<int64_t>& streamed, const ExpertRows& first,
                      at::Tensor& y) {
  const auto format = static_cast<BlockFormat>(type);
  const int64_t pairs = x.size(0), k_len = x.size(1), n_out = y.size(1);
  const CpuKernels cpu = isa_kernels(format);
  const bool float_activations = cpu.float_decode_rows != nullptr;  // FP8
  const auto x_c = float_activations ? x.to(at::kFloat).contiguous() : x.contiguous();
  QuantizedActivations xq;
  if (!float_activations)
    xq = FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fastllm::moe_cpu", [&] {
      return quantize_activations(x_c.const_data_ptr<scalar_t>(), pairs, k_len,
                                  activation_max(format));
    });
  const uint8_t* w = weight.const_data_ptr<uint8_t>();
  const int64_t expert_stride = weight.stride(0), ldw = weight.stride(1);
  const bool direct = y.scalar_type() == at::kFloat;
  auto y_float = direct ? y : at::empty({pairs, n_out}, y.options().dtype(at::kFloat));
  float* sums = y_float.mutable_data_ptr<float>();
  // Grain: enough weight rows per task that their bytes (>= 64 KiB) dwarf its scheduling cost.
  const int64_t grain = std::max<int64_t>(4, (64 << 10) / std::max<int64_t>(1, ldw));
  FASTLLM_DISPATCH_FLOAT_TYPES(y.scalar_type(), "fastllm::moe_cpu", [&] {
    scalar_t* out = y.mutable_data_ptr<scalar_t>();
    for_streamed_rows(streamed, n_out, grain, [&](int64_t e, int64_t begin, int64_t end) {
      const int64_t row = first[e], rows = first[e + 1] - row;
      const uint8_t* expert = w + e * expert_stride;
      if (float_activations)
        cpu.float_decode_rows(x_c.const_data_ptr<float>() + row * k_len, rows, k_len,
                              expert, ldw, begin, end, nullptr, sums + row * n_out, n_out);
      else
        cpu.decode_rows(xq.view(row, rows), expert, ldw, begin, end, nullptr,
                        sums + row * n_out, n_out);
      if (!direct)  // this task's block of sums, rounded to y's dtype
        for (int64_t r = row; r < row + rows; ++r)
          for (int64_t j = begin; j < end; ++j) out[r * n_out + j] = scalar_t(sums[r * n_out + j]);
    });
  });
}

// y [pairs, n_out] in x's dtype: each expert's block of rows of x times its weights transposed.
at::Tensor project(const at::Tensor& x, const Projection& p, const ExpertRows& first,
                   int64_t n_out) {
  auto y = at::empty({x.size(0), n_out}, x.options());
  const int64_t limit = stream_limit(x, p);
  std::vector<int64_t> streamed;
  for (int64_t e = 0; e + 1 < int64_t(first.size()); ++e) {
    const int64_t rows = first[e + 1] - first[e];
    if (rows == 0) continue;
    if (rows <= limit) {
      streamed.push_back(e);
      continue;
    }
    // Many rows: the op's own many-row path (a GEMM), into the expert's block.
    const auto block = x.narrow(0, first[e], rows);
    const auto w = p.weight.select(0, e);
    y.narrow(0, first[e], rows)
        .copy_(p.type.has_value() ? quantized_linear_op(block, w, *p.type) : linear_op(block, w));
  }
  if (!streamed.empty()) {
    if (p.type.has_value())
      stream_quantized(x, p.weight, *p.type, streamed, first, y);
    else
      stream_float(x, p.weight, streamed, first, y);
  }
  return y;
}

// v rounded to scalar_t and back: the eager op's rounding of each result to x's dtype.
template <typename scalar_t>
inline VecF round_to(const VecF& v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return v;
  } else {
    scalar_t rounded[VecF::size()];
    store_from_float(v, rounded);
    return load_as_float(rounded);
  }
}

// out[t] = sum over the token's chosen experts, in increasing expert order, of weight * y[its
// pair's row], each product and each partial sum rounded to scalar_t (HF's index_add_ into
// zeros, expert after expert).
template <typename scalar_t>
void combine(const scalar_t* y, const int64_t* experts, const scalar_t* weights,
             const int64_t* position, int64_t tokens, int64_t top_k, int64_t hidden,
             scalar_t* out) {
  constexpr int64_t W = VecF::size();
  const int64_t grain = std::max<int64_t>(1, (16 << 10) / std::max<int64_t>(1, hidden * top_k));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> order(top_k);  // the token's choices by increasing expert
    for (int64_t t = begin; t < end; ++t) {
      const int64_t* chosen = experts + t * top_k;
      for (int64_t j = 0; j < top_k; ++j) order[j] = j;
      std::sort(order.begin(), order.end(),
                [&](int64_t a, int64_t b) { return chosen[a] < chosen[b]; });
      scalar_t* dst = out + t * hidden;
      int64_t h = 0;
      for (; h + W <= hidden; h += W) {
        VecF acc(0.f);
        for (const int64_t j : order) {
          const scalar_t* row = y + position[t * top_k + j] * hidden;
          const VecF w(float(weights[t * top_k + j]));
          acc = round_to<scalar_t>(acc + round_to<scalar_t>(w * load_as_float(row + h)));
        }
        store_from_float(acc, dst + h);
      }
      for (; h < hidden; ++h) {
        float acc = 0.f;
        for (const int64_t j : order) {
          const float term = float(scalar_t(float(weights[t * top_k + j]) *
                                            float(y[position[t * top_k + j] * hidden + h])));
          acc = float(scalar_t(acc + term));
        }
        dst[h] = scalar_t(acc);
      }
    }
  });
}

at::Tensor moe_cpu(const at::Tensor& x, const at::Tensor& router_logits,
                   const at::Tensor& gate_up, const at::Tensor& down, int64_t top_k,
                   bool renormalize, std::optional<int64_t> gate_up_type,
                   std::optional<int64_t> down_type) {
  const MoeShape s =
      check_moe_inputs(x, router_logits, gate_up, down, top_k, gate_up_type, down_type);
  auto out = at::empty({s.tokens, s.hidden}, x.options());
  if (out.numel() == 0) return out;
  if (s.intermediate == 0) return out.zero_();
  const auto routed = route_tokens_composite(router_logits, top_k, renormalize, x.scalar_type());
  const auto weights = std::get<0>(routed).contiguous();
  const auto experts = std::get<1>(routed).contiguous();
  // Counting sort of the (token, choice) pairs by expert, tokens in order within an expert:
  // pair a = t * top_k + j lands on row position[a]; expert e's rows are [first[e], first[e+1]).
  const int64_t pairs = s.tokens * top_k;
  const int64_t* chosen = experts.const_data_ptr<int64_t>();
  ExpertRows first(s.num_experts + 1, 0);
  for (int64_t a = 0; a < pairs; ++a) ++first[chosen[a] + 1];
  for (int64_t e = 0; e < s.num_experts; ++e) first[e + 1] += first[e];
  std::vector<int64_t> next(first.begin(), first.end() - 1), position(pairs);
  auto row_tokens = at::empty({pairs}, experts.options());
  int64_t* row_token = row_tokens.mutable_data_ptr<int64_t>();
  for (int64_t a = 0; a < pairs; ++a) {
    const int64_t row = next[chosen[a]]++;
    position[a] = row;
    row_token[row] = a / top_k;
  }
  const auto x_rows = x.index_select(0, row_tokens);  // [pairs, hidden], by expert
  const auto gated = silu_and_mul_op(project(x_rows, {gate_up, gate_up_type}, first,
                                             2 * s.intermediate));  // [pairs, intermediate]
  const auto y = project(gated, {down, down_type}, first, s.hidden);  // [pairs, hidden]
  FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fastllm::moe_cpu", [&] {
    combine(y.const_data_ptr<scalar_t>(), chosen, weights.const_data_ptr<scalar_t>(),
            position.data(), s.tokens, top_k, s.hidden, out.mutable_data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CPU, m) { m.impl("moe", &moe_cpu); }

}  // namespace fastllm
