// Rotary embedding written with ATen ops: what a device without a native kernel runs (MPS).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/composite.h"
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

FASTLLM_COMPOSITE_IMPL(m) { m.impl("rotary_embedding", &rotary_embedding_composite); }

}  // namespace fastllm
