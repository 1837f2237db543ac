// Rotary embedding written with ATen ops: what a device without a native kernel runs (MPS).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>

#include "rotary/rotary.h"

namespace fastllm {
namespace {

void rotate_in_place(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t rot,
                     bool is_neox) {
  auto part = x.narrow(2, 0, rot);
  auto xf = part.to(at::kFloat);
  const int64_t half = rot / 2;
  // neox pairs channel i with i + half; the interleaved layout pairs 2i with 2i + 1.
  auto pairs = is_neox ? xf.view({x.size(0), x.size(1), 2, half}).transpose(2, 3)
                       : xf.view({x.size(0), x.size(1), half, 2});
  auto x1 = pairs.select(3, 0), x2 = pairs.select(3, 1);  // [tokens, heads, half]
  auto rotated = at::stack({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, 3);
  if (is_neox) rotated = rotated.transpose(2, 3);
  part.copy_(rotated.reshape({x.size(0), x.size(1), rot}));
}

}  // namespace

void rotary_embedding_composite(const at::Tensor& positions, at::Tensor& q,
                                const std::optional<at::Tensor>& k,
                                const at::Tensor& cos_sin_cache, bool is_neox,
                                std::optional<int64_t> rotary_dim) {
  const int64_t rot = check_rotary_inputs(positions, q, k, cos_sin_cache, rotary_dim);
  if (positions.numel() > 0) {
    const int64_t lo = positions.min().item<int64_t>(), hi = positions.max().item<int64_t>();
    TORCH_CHECK_VALUE(lo >= 0 && hi < cos_sin_cache.size(0), "positions span [", lo, ", ", hi,
                      "], outside the cos_sin_cache, which covers positions [0, ",
                      cos_sin_cache.size(0), ")");
  }
  auto rows = cos_sin_cache.index_select(0, positions.to(at::kLong)).to(at::kFloat).unsqueeze(1);
  const auto cos = rows.narrow(2, 0, rot / 2), sin = rows.narrow(2, rot / 2, rot / 2);
  rotate_in_place(q, cos, sin, rot, is_neox);
  if (k.has_value()) {
    at::Tensor key = *k;
    rotate_in_place(key, cos, sin, rot, is_neox);
  }
}

// rotary_and_cache as the three ops it fuses, each of the namespace the composition is
// registered in: fastllm's run each device's kernels (the CPU's, or MPS's compositions), and
// fastllm_composite's the ATen compositions everywhere.
template <const char* kNamespace>
void rotary_and_cache_composition(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                                  const at::Tensor& value, at::Tensor& k_cache,
                                  at::Tensor& v_cache, const at::Tensor& slot_mapping,
                                  const std::optional<at::Tensor>& cos_sin_cache,
                                  const std::optional<at::Tensor>& q_norm,
                                  const std::optional<at::Tensor>& k_norm, double eps,
                                  bool is_neox, bool rotate_keys) {
  check_rotary_and_cache_inputs(positions, q, k, value, k_cache, v_cache, slot_mapping,
                                cos_sin_cache, q_norm, k_norm, eps);
  auto op = [](const char* name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(
        (std::string(kNamespace) + "::" + name).c_str(), "");
  };
  if (q_norm.has_value()) {
    static const auto rms_norm =
        op("rms_norm").template typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
    q.copy_(rms_norm.call(q, *q_norm, eps));
    k.copy_(rms_norm.call(k, *k_norm, eps));
  }
  if (cos_sin_cache.has_value()) {
    static const auto rotary =
        op("rotary_embedding")
            .template typed<void(const at::Tensor&, at::Tensor&, const std::optional<at::Tensor>&,
                        const at::Tensor&, bool, std::optional<int64_t>)>();
    rotary.call(positions, q, rotate_keys ? std::optional<at::Tensor>(k) : std::nullopt,
                *cos_sin_cache, is_neox, std::nullopt);
  }
  static const auto cache_write =
      op("reshape_and_cache")
          .template typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                      const at::Tensor&)>();
  cache_write.call(k, value, k_cache, v_cache, slot_mapping);
}

constexpr char kFastllm[] = "fastllm";
constexpr char kFastllmComposite[] = "fastllm_composite";

TORCH_LIBRARY_IMPL(fastllm, CompositeExplicitAutograd, m) {
  m.impl("rotary_embedding", &rotary_embedding_composite);
  m.impl("rotary_and_cache", &rotary_and_cache_composition<kFastllm>);
}

TORCH_LIBRARY_IMPL(fastllm_composite, CompositeExplicitAutograd, m) {
  m.impl("rotary_embedding", &rotary_embedding_composite);
  m.impl("rotary_and_cache", &rotary_and_cache_composition<kFastllmComposite>);
}

}  // namespace fastllm
