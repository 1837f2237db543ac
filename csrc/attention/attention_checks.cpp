#include "attention/attention.h"

#include <cmath>

#include <ATen/MemoryOverlap.h>

#include "common/checks.h"

namespace fastllm {

AttentionDims check_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& cu_seqlens_q,
                                     const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                     int64_t max_seqlen_k, int64_t window_left) {
  check_rank(q, 3, "q", "[total_q, n_heads, head_dim]");
  check_rank(k, 3, "k", "[total_k, n_kv_heads, head_dim]");
  check_rank(v, 3, "v", "[total_k, n_kv_heads, head_dim]");
  check_float_storage(q, "q");
  check_same_dtype(k, "k", q, "q");
  check_same_dtype(v, "v", q, "q");
  check_same_device(k, "k", q, "q");
  check_same_device(v, "v", q, "q");
  check_same_device(cu_seqlens_q, "cu_seqlens_q", q, "q");
  check_same_device(cu_seqlens_k, "cu_seqlens_k", q, "q");
  check_dtype(cu_seqlens_q, at::kInt, "cu_seqlens_q");
  check_dtype(cu_seqlens_k, at::kInt, "cu_seqlens_k");
  check_rank(cu_seqlens_q, 1, "cu_seqlens_q", "[batch + 1]");
  check_rank(cu_seqlens_k, 1, "cu_seqlens_k", "[batch + 1]");
  TORCH_CHECK_VALUE(cu_seqlens_q.size(0) >= 1, "cu_seqlens_q must hold at least one offset (0)");
  TORCH_CHECK_VALUE(cu_seqlens_q.size(0) == cu_seqlens_k.size(0),
                    "cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got ",
                    cu_seqlens_q.size(0), " and ", cu_seqlens_k.size(0));
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "k and v must have the same shape, got ", k.sizes(),
                    " and ", v.sizes());
  TORCH_CHECK_VALUE(q.size(2) == k.size(2), "q and k must have the same head_dim, got ", q.size(2),
                    " and ", k.size(2));
  TORCH_CHECK_VALUE(q.size(2) > 0, "head_dim must be positive, got ", q.size(2));
  TORCH_CHECK_VALUE(q.size(1) > 0 && k.size(1) > 0, "q and k need at least one head, got n_heads=",
                    q.size(1), " and n_kv_heads=", k.size(1));
  TORCH_CHECK_VALUE(q.size(1) % k.size(1) == 0,
                    "n_heads must be a multiple of n_kv_heads, got n_heads=", q.size(1),
                    " and n_kv_heads=", k.size(1));
  TORCH_CHECK_VALUE(max_seqlen_q >= 0, "max_seqlen_q must be >= 0, got ", max_seqlen_q);
  TORCH_CHECK_VALUE(max_seqlen_k >= 0, "max_seqlen_k must be >= 0, got ", max_seqlen_k);
  TORCH_CHECK_VALUE(window_left >= -1, "window_left must be -1 (no window) or >= 0, got ",
                    window_left);
  return {cu_seqlens_q.size(0) - 1, q.size(1), k.size(1), q.size(2)};
}

void check_cu_seqlens_values(const at::Tensor& cu_seqlens_cpu, int64_t total, int64_t max_seqlen,
                             const char* name) {
  const auto cu = cu_seqlens_cpu.contiguous();
  const int32_t* p = cu.data_ptr<int32_t>();
  const int64_t n = cu.numel();
  TORCH_CHECK_VALUE(p[0] == 0, name, "[0] must be 0, got ", p[0]);
  for (int64_t i = 1; i < n; ++i) {
    const int64_t len = int64_t(p[i]) - p[i - 1];
    TORCH_CHECK_VALUE(len >= 0, name, " must be non-decreasing, but ", name, "[", i, "]=", p[i],
                      " < ", name, "[", i - 1, "]=", p[i - 1]);
    TORCH_CHECK_VALUE(len <= max_seqlen, "sequence ", i - 1, " has length ", len,
                      " (from ", name, "), more than its max_seqlen ", max_seqlen);
  }
  TORCH_CHECK_VALUE(p[n - 1] == total, name, "[-1]=", p[n - 1],
                    " must equal the number of packed tokens, ", total);
}

void check_attention_out(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v) {
  TORCH_CHECK_VALUE(out.sizes() == q.sizes(), "out must have q's shape ", q.sizes(), ", got ",
                    out.sizes());
  check_same_dtype(out, "out", q, "q");
  check_same_device(out, "out", q, "q");
  // Threads write disjoint elements of out; elements shared by several indices, or memory
  // shared with an input, would make the result depend on scheduling.
  TORCH_CHECK_VALUE(at::has_internal_overlap(out) != at::MemOverlap::Yes,
                    "out must not have overlapping elements (e.g. an expanded tensor), got strides ",
                    out.strides());
  for (const auto& [input, name] : {std::pair(&q, "q"), std::pair(&k, "k"), std::pair(&v, "v")}) {
    const auto status = at::get_overlap_status(out, *input);  // TooHard for any non-dense input
    const bool shared = status == at::MemOverlapStatus::Full ||
                        status == at::MemOverlapStatus::Partial ||
                        (status == at::MemOverlapStatus::TooHard &&
                         out.storage().is_alias_of(input->storage()));
    TORCH_CHECK_VALUE(!shared, "out must not share memory with ", name);
  }
}

double resolve_attention_scale(std::optional<double> scale, int64_t head_dim) {
  if (!scale.has_value()) return 1.0 / std::sqrt(double(head_dim));
  TORCH_CHECK_VALUE(std::isfinite(*scale), "scale must be finite, got ", *scale);
  return *scale;
}

}  // namespace fastllm
