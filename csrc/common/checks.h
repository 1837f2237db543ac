// Input checks shared by every op and device. They read tensor metadata only: no data, no sync.
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

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

// A KV cache against the activations it serves (q, or the key/value written into it): the same
// dtype, or bfloat16/float16 under float32 activations (vLLM's kv_cache_dtype: converted as it
// is written, read back as float32). A cache wider than the activations is refused.
inline void check_kv_cache_dtype(const at::Tensor& cache, const char* name, const at::Tensor& act,
                                 const char* act_name) {
  const auto dt = cache.scalar_type(), act_dt = act.scalar_type();
  const bool narrower = act_dt == at::kFloat && (dt == at::kBFloat16 || dt == at::kHalf);
  TORCH_CHECK_TYPE(dt == act_dt || narrower, name, " has dtype ", dtype_name(dt), " but ",
                   act_name, " has dtype ", dtype_name(act_dt), "; a cache of another dtype "
                   "than ", act_name, "'s must be torch.bfloat16 or torch.float16 under "
                   "torch.float32 ", act_name);
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

// Whether some element of t is reached through several indices. ATen answers for dense and
// expanded tensors; for other strides, t counts as overlapping unless each dim (by increasing
// stride) steps past everything the smaller dims reach, which every slice or permutation of a
// dense tensor does.
inline bool has_overlapping_elements(const at::Tensor& t) {
  const at::MemOverlap aten = at::has_internal_overlap(t);
  if (aten != at::MemOverlap::TooHard) return aten == at::MemOverlap::Yes;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims of size > 1
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;  // the largest offset the smaller dims reach
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) return true;
    reach += (size - 1) * stride;
  }
  return false;
}

// A tensor written in place must not address one element through several indices (an expanded
// tensor): the op would update that element several times.
inline void check_no_internal_overlap(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(!has_overlapping_elements(t), name,
                    " must not have overlapping elements (e.g. an expanded tensor), got shape ",
                    t.sizes(), " and strides ", t.strides());
}

namespace detail {

inline int64_t floor_div(int64_t a, int64_t b) {
  return a / b - (a % b != 0 && (a < 0) != (b < 0));
}
inline int64_t ceil_div(int64_t a, int64_t b) { return -floor_div(-a, b); }

// One term of sum(x_t * stride_t) over integers x_t in [lo, hi].
struct Term {
  int64_t stride, lo, hi;
};

// Whether terms[t:] (decreasing strides) reach `target`; reach_lo / reach_hi[t] are the least
// and largest sums of terms[t:]. Each term tries only the values that leave the rest able to
// reach what remains (at most two when every stride steps past the smaller terms' reach, as a
// slice of a dense tensor's do). True once `budget` steps are spent: an answer of "maybe".
inline bool reaches(const std::vector<Term>& terms, size_t t, int64_t target,
                    const std::vector<int64_t>& reach_lo, const std::vector<int64_t>& reach_hi,
                    int64_t& budget) {
  if (t == terms.size()) return target == 0;
  if (--budget < 0) return true;
  const Term& term = terms[t];
  const int64_t lo = std::max(term.lo, ceil_div(target - reach_hi[t + 1], term.stride));
  const int64_t hi = std::min(term.hi, floor_div(target - reach_lo[t + 1], term.stride));
  for (int64_t x = lo; x <= hi; ++x)
    if (reaches(terms, t + 1, target - x * term.stride, reach_lo, reach_hi, budget)) return true;
  return false;
}

}  // namespace detail

// Whether a and b address a common byte: a byte of a, at offset
// oa + sum(i_d * stride_d) + u (u < its element size), equals one of b iff the differences of
// their indices solve one linear equation, which a bounded search answers; exactly for the
// layouts ops see (dense tensors, their slices and permutations: q and k as column slices of
// one fused projection, K and V interleaved in one pool), "yes" when the search runs out.
inline bool may_share_memory(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || !a.storage().is_alias_of(b.storage())) return false;
  std::vector<detail::Term> terms;  // in bytes: a's indices minus b's
  auto add = [&](const at::Tensor& t, int64_t sign) {
    const int64_t item = t.element_size();
    for (int64_t d = 0; d < t.dim(); ++d)
      if (t.size(d) > 1 && t.stride(d) != 0) {
        const int64_t n = t.size(d) - 1;
        terms.push_back({t.stride(d) * item, sign > 0 ? 0 : -n, sign > 0 ? n : 0});
      }
    terms.push_back({1, sign > 0 ? 0 : -(item - 1), sign > 0 ? item - 1 : 0});  // within one
  };
  add(a, 1);
  add(b, -1);
  // Terms of one stride add up to one term over the sum of their ranges.
  std::sort(terms.begin(), terms.end(),
            [](const detail::Term& x, const detail::Term& y) { return x.stride > y.stride; });
  std::vector<detail::Term> merged;
  for (const auto& term : terms) {
    if (!merged.empty() && merged.back().stride == term.stride) {
      merged.back().lo += term.lo;
      merged.back().hi += term.hi;
    } else {
      merged.push_back(term);
    }
  }
  std::vector<int64_t> reach_lo(merged.size() + 1, 0), reach_hi(merged.size() + 1, 0);
  for (size_t t = merged.size(); t-- > 0;) {
    reach_lo[t] = reach_lo[t + 1] + merged[t].lo * merged[t].stride;
    reach_hi[t] = reach_hi[t + 1] + merged[t].hi * merged[t].stride;
  }
  const int64_t target = (b.storage_offset() * b.element_size()) -
                         (a.storage_offset() * a.element_size());
  int64_t budget = 4096;
  return detail::reaches(merged, 0, target, reach_lo, reach_hi, budget);
}

// Two tensors an op writes (or writes one and reads the other) must not share memory.
inline void check_no_shared_memory(const at::Tensor& a, const char* a_name, const at::Tensor& b,
                                   const char* b_name) {
  TORCH_CHECK_VALUE(!may_share_memory(a, b), a_name, " and ", b_name,
                    " must not share memory (", a_name, " is written in place)");
}

}  // namespace fastllm
