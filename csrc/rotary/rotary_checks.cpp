#include "rotary/rotary.h"

#include <ATen/Dispatch.h>

#include "common/checks.h"
#include "kv_cache/cache_write.h"
#include "norm/norm.h"

namespace fastllm {

int64_t check_rotary_inputs(const at::Tensor& positions, const at::Tensor& q,
                            const std::optional<at::Tensor>& k, const at::Tensor& cos_sin_cache,
                            std::optional<int64_t> rotary_dim) {
  check_rank(positions, 1, "positions", "[tokens]");
  TORCH_CHECK_TYPE(positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt,
                   "positions must be torch.int64 or torch.int32, got ",
                   dtype_name(positions.scalar_type()));
  check_rank(q, 3, "q", "[tokens, n_heads, head_dim]");
  check_float_storage(q, "q");
  check_same_device(positions, "positions", q, "q");
  check_rank(cos_sin_cache, 2, "cos_sin_cache", "[max_position, rotary_dim] (cos | sin halves)");
  check_float_storage(cos_sin_cache, "cos_sin_cache");
  check_same_device(cos_sin_cache, "cos_sin_cache", q, "q");
  TORCH_CHECK_VALUE(positions.size(0) == q.size(0), "positions has ", positions.size(0),
                    " tokens but q has ", q.size(0));
  const int64_t rot = cos_sin_cache.size(1);
  TORCH_CHECK_VALUE(rot > 0 && rot % 2 == 0, "cos_sin_cache.shape[1] (rotary_dim) must be even and "
                    "positive, got ", rot);
  TORCH_CHECK_VALUE(!rotary_dim.has_value() || *rotary_dim == rot, "rotary_dim=",
                    rotary_dim.value_or(-1), " does not match cos_sin_cache.shape[1]=", rot);
  TORCH_CHECK_VALUE(rot <= q.size(2), "rotary_dim ", rot, " exceeds head_dim ", q.size(2));
  // Rotated in place: an element reached twice would be rotated twice.
  check_no_internal_overlap(q, "q");
  if (k.has_value()) {
    check_no_internal_overlap(*k, "k");
    check_no_shared_memory(q, "q", *k, "k");
    check_rank(*k, 3, "k", "[tokens, n_kv_heads, head_dim]");
    check_same_dtype(*k, "k", q, "q");
    check_same_device(*k, "k", q, "q");
    TORCH_CHECK_VALUE(k->size(0) == q.size(0), "k has ", k->size(0), " tokens but q has ",
                      q.size(0));
    TORCH_CHECK_VALUE(k->size(2) == q.size(2), "q and k must have the same head_dim, got ",
                      q.size(2), " and ", k->size(2));
  }
  return rot;
}

void check_position_values(const at::Tensor& positions_cpu, int64_t max_position) {
  AT_DISPATCH_INDEX_TYPES(positions_cpu.scalar_type(), "fastllm::rotary_positions", [&] {
    const index_t* p = positions_cpu.const_data_ptr<index_t>();
    for (int64_t t = 0; t < positions_cpu.numel(); ++t)
      TORCH_CHECK_VALUE(p[t] >= 0 && p[t] < max_position, "positions[", t, "]=", p[t],
                        " is outside the cos_sin_cache, which covers positions [0, ",
                        max_position, ")");
  });
}

int64_t check_rotary_and_cache_inputs(
    const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k, const at::Tensor& value,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
    const std::optional<at::Tensor>& cos_sin_cache, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double eps) {
  check_cache_write_inputs(k, value, k_cache, v_cache, slot_mapping);
  check_rank(q, 3, "q", "[tokens, n_heads, head_dim]");
  check_same_dtype(q, "q", k, "key");
  check_same_device(q, "q", k, "key");
  TORCH_CHECK_VALUE(q.size(0) == k.size(0) && q.size(2) == k.size(2), "q ", q.sizes(),
                    " and key ", k.sizes(), " must have the same tokens and head_dim");
  check_rank(positions, 1, "positions", "[tokens]");
  check_same_device(positions, "positions", q, "q");
  TORCH_CHECK_VALUE(positions.size(0) == q.size(0), "positions has ", positions.size(0),
                    " tokens but q has ", q.size(0));
  TORCH_CHECK_VALUE(q_norm.has_value() == k_norm.has_value(),
                    "q_norm and k_norm must be given together");
  if (q_norm.has_value()) {
    check_rms_norm_inputs(q, *q_norm, eps);
    check_rms_norm_inputs(k, *k_norm, eps);
  }
  // q and k are written in place and value is read beside them (slices of one projection).
  check_no_internal_overlap(q, "q");
  check_no_internal_overlap(k, "key");
  check_no_shared_memory(q, "q", k, "key");
  check_no_shared_memory(q, "q", value, "value");
  check_no_shared_memory(k, "key", value, "value");
  for (const auto& [cache, name] : {std::pair(&k_cache, "k_cache"), std::pair(&v_cache, "v_cache")})
    check_no_shared_memory(*cache, name, q, "q");
  if (!cos_sin_cache.has_value()) {
    TORCH_CHECK_TYPE(positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt,
                     "positions must be torch.int64 or torch.int32, got ",
                     dtype_name(positions.scalar_type()));
    return 0;
  }
  return check_rotary_inputs(positions, q, k, *cos_sin_cache, std::nullopt);
}

}  // namespace fastllm
