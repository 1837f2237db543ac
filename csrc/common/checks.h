// Input checks shared by every op and device. They read tensor metadata only: no data, no sync.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>

namespace fastllm {

// "torch.float32", as Python users spell it.
inline std::string dtype_name(at::ScalarType dtype) {
  return "torch." + std::string(c10::getDtypeNames(dtype).first);
}

inline void check_rank(const at::Tensor& t, int64_t rank, const char* name, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == rank, name, " must be ", layout, ", got shape ", t.sizes());
}

inline void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& ref,
                              const char* ref_name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), name, " is on ", t.device(), " but ", ref_name,
                    " is on ", ref.device(), "; all inputs must be on one device");
}

inline void check_same_dtype(const at::Tensor& t, const char* name, const at::Tensor& ref,
                             const char* ref_name) {
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), name, " has dtype ", dtype_name(t.scalar_type()),
                   " but ", ref_name, " has dtype ", dtype_name(ref.scalar_type()));
}

inline void check_dtype(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must be ", dtype_name(dtype), ", got ",
                   dtype_name(t.scalar_type()));
}

inline void check_float_storage(const at::Tensor& t, const char* name) {
  const auto dt = t.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, name,
                   " must be torch.float32, torch.bfloat16 or torch.float16, got ", dtype_name(dt));
}

// An optional linear-layer bias [out_features] of x's dtype and device.
inline void check_linear_bias(const std::optional<at::Tensor>& bias, const at::Tensor& x,
                              int64_t out_features) {
  if (!bias.has_value()) return;
  check_rank(*bias, 1, "bias", "[out_features]");
  check_same_dtype(*bias, "bias", x, "x");
  check_same_device(*bias, "bias", x, "x");
  TORCH_CHECK_VALUE(bias->size(0) == out_features, "bias has ", bias->size(0),
                    " elements but weight has ", out_features, " output features");
}

// Paged K/V pools: [num_blocks, block_size, n_kv_heads, head_dim] each, float storage, one shape,
// dtype and device, blocks of at least one token.
inline void check_paged_caches(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  constexpr const char* kLayout = "[num_blocks, block_size, n_kv_heads, head_dim]";
  check_rank(k_cache, 4, "k_cache", kLayout);
  check_rank(v_cache, 4, "v_cache", kLayout);
  check_float_storage(k_cache, "k_cache");
  check_same_dtype(v_cache, "v_cache", k_cache, "k_cache");
  check_same_device(v_cache, "v_cache", k_cache, "k_cache");
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes(),
                    "k_cache and v_cache must have the same shape, got ", k_cache.sizes(),
                    " and ", v_cache.sizes());
  TORCH_CHECK_VALUE(k_cache.size(1) > 0, "block_size must be positive, got ", k_cache.size(1));
}

}  // namespace fastllm
