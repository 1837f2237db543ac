#include "attention/attention.h"

#include <cmath>
#include <limits>

#include <ATen/MemoryOverlap.h>

#include "common/checks.h"

namespace fastllm {

namespace {

// What q must satisfy against keys of n_kv_heads heads of key_head_dim channels: shared by the
// packed and the paged layouts.
void check_query_against_keys(const at::Tensor& q, int64_t n_kv_heads, int64_t key_head_dim,
                              int64_t window_left, double softcap) {
  check_float_storage(q, "q");
  TORCH_CHECK_VALUE(q.size(2) == key_head_dim, "q and k must have the same head_dim, got ",
                    q.size(2), " and ", key_head_dim);
  TORCH_CHECK_VALUE(q.size(2) > 0, "head_dim must be positive, got ", q.size(2));
  TORCH_CHECK_VALUE(q.size(1) > 0 && n_kv_heads > 0, "q and k need at least one head, got n_heads=",
                    q.size(1), " and n_kv_heads=", n_kv_heads);
  TORCH_CHECK_VALUE(q.size(1) % n_kv_heads == 0,
                    "n_heads must be a multiple of n_kv_heads, got n_heads=", q.size(1),
                    " and n_kv_heads=", n_kv_heads);
  TORCH_CHECK_VALUE(window_left >= -1, "window_left must be -1 (no window) or >= 0, got ",
                    window_left);
  check_softcap(softcap);
}

void check_int32_vector(const at::Tensor& t, const char* name, const char* layout,
                        const at::Tensor& q) {
  check_same_device(t, name, q, "q");
  check_dtype(t, at::kInt, name);
  check_rank(t, 1, name, layout);
}

}  // namespace

AttentionDims check_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& cu_seqlens_q,
                                     const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                     int64_t max_seqlen_k, int64_t window_left,
                                     double softcap) {
  check_rank(q, 3, "q", "[total_q, n_heads, head_dim]");
  check_rank(k, 3, "k", "[total_k, n_kv_heads, head_dim]");
  check_rank(v, 3, "v", "[total_k, n_kv_heads, head_dim]");
  check_float_storage(q, "q");
  check_same_dtype(k, "k", q, "q");
  check_same_dtype(v, "v", q, "q");
  check_same_device(k, "k", q, "q");
  check_same_device(v, "v", q, "q");
  check_int32_vector(cu_seqlens_q, "cu_seqlens_q", "[batch + 1]", q);
  check_int32_vector(cu_seqlens_k, "cu_seqlens_k", "[batch + 1]", q);
  TORCH_CHECK_VALUE(cu_seqlens_q.size(0) >= 1, "cu_seqlens_q must hold at least one offset (0)");
  TORCH_CHECK_VALUE(cu_seqlens_q.size(0) == cu_seqlens_k.size(0),
                    "cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got ",
                    cu_seqlens_q.size(0), " and ", cu_seqlens_k.size(0));
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "k and v must have the same shape, got ", k.sizes(),
                    " and ", v.sizes());
  check_query_against_keys(q, k.size(1), k.size(2), window_left, softcap);
  TORCH_CHECK_VALUE(max_seqlen_q >= 0, "max_seqlen_q must be >= 0, got ", max_seqlen_q);
  TORCH_CHECK_VALUE(max_seqlen_k >= 0, "max_seqlen_k must be >= 0, got ", max_seqlen_k);
  return {cu_seqlens_q.size(0) - 1, q.size(1), k.size(1), q.size(2)};
}

AttentionDims check_paged_attention_inputs(const at::Tensor& q, const at::Tensor& k_cache,
                                           const at::Tensor& v_cache,
                                           const at::Tensor& block_tables,
                                           const at::Tensor& seq_lens,
                                           const at::Tensor& cu_seqlens_q, int64_t max_seqlen_q,
                                           int64_t window_left, double softcap) {
  check_rank(q, 3, "q", "[total_q, n_heads, head_dim]");
  check_float_storage(q, "q");
  for (const auto& [cache, name] :
       {std::pair(&k_cache, "k_cache"), std::pair(&v_cache, "v_cache")}) {
    check_float_storage(*cache, name);
    check_kv_cache_dtype(*cache, name, q, "q");
    check_same_device(*cache, name, q, "q");
  }
  check_paged_caches(k_cache, v_cache);
  check_query_against_keys(q, k_cache.size(2), k_cache.size(3), window_left, softcap);
  check_int32_vector(cu_seqlens_q, "cu_seqlens_q", "[batch + 1]", q);
  check_int32_vector(seq_lens, "seq_lens", "[batch]", q);
  check_same_device(block_tables, "block_tables", q, "q");
  check_dtype(block_tables, at::kInt, "block_tables");
  check_rank(block_tables, 2, "block_tables", "[batch, max_blocks_per_seq]");
  const int64_t batch = seq_lens.size(0);
  TORCH_CHECK_VALUE(cu_seqlens_q.size(0) == batch + 1, "cu_seqlens_q must have batch + 1 = ",
                    batch + 1, " entries (seq_lens has ", batch, "), got ", cu_seqlens_q.size(0));
  TORCH_CHECK_VALUE(block_tables.size(0) == batch, "block_tables has ", block_tables.size(0),
                    " rows but seq_lens has ", batch);
  TORCH_CHECK_VALUE(max_seqlen_q >= 0, "max_seqlen_q must be >= 0, got ", max_seqlen_q);
  return {batch, q.size(1), k_cache.size(2), q.size(2)};
}

void check_block_table_values(const at::Tensor& block_tables_cpu, const at::Tensor& seq_lens_cpu,
                              int64_t num_blocks, int64_t block_size) {
  const int32_t* tables = block_tables_cpu.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens_cpu.const_data_ptr<int32_t>();
  const int64_t max_blocks = block_tables_cpu.size(1);
  for (int64_t b = 0; b < seq_lens_cpu.numel(); ++b) {
    TORCH_CHECK_VALUE(lens[b] >= 0, "seq_lens[", b, "]=", lens[b], " must be >= 0");
    const int64_t needed = (int64_t(lens[b]) + block_size - 1) / block_size;
    TORCH_CHECK_VALUE(needed <= max_blocks, "seq_lens[", b, "]=", lens[b], " needs ", needed,
                      " blocks of ", block_size, " but block_tables has ", max_blocks, " columns");
    for (int64_t i = 0; i < needed; ++i) {
      const int32_t block = tables[b * max_blocks + i];
      TORCH_CHECK_VALUE(block >= 0 && block < num_blocks, "block_tables[", b, "][", i, "]=", block,
                        " is not a block of the cache (num_blocks=", num_blocks, ")");
    }
  }
}

int64_t check_key_rotary(const std::optional<at::Tensor>& rotary_cos_sin_cache,
                         const at::Tensor& k_cache) {
  if (!rotary_cos_sin_cache.has_value()) return 0;
  const at::Tensor& table = *rotary_cos_sin_cache;
  check_rank(table, 2, "rotary_cos_sin_cache", "[max_position, rotary_dim] (cos | sin halves)");
  // Rotation happens in float32 inside the kernel: a float32 table is read as is, never copied.
  check_dtype(table, at::kFloat, "rotary_cos_sin_cache");
  check_same_device(table, "rotary_cos_sin_cache", k_cache, "k_cache");
  const int64_t rot = table.size(1);
  TORCH_CHECK_VALUE(rot > 0 && rot % 2 == 0, "rotary_cos_sin_cache.shape[1] (rotary_dim) must be "
                    "even and positive, got ", rot);
  TORCH_CHECK_VALUE(rot <= k_cache.size(3), "rotary_dim ", rot, " exceeds head_dim ",
                    k_cache.size(3));
  return rot;
}

void check_key_rotary_positions(const at::Tensor& rotary_cos_sin_cache,
                                const at::Tensor& seq_lens_cpu) {
  const int32_t* lens = seq_lens_cpu.const_data_ptr<int32_t>();
  for (int64_t b = 0; b < seq_lens_cpu.numel(); ++b)
    TORCH_CHECK_VALUE(lens[b] <= rotary_cos_sin_cache.size(0), "seq_lens[", b, "]=", lens[b],
                      " reaches past rotary_cos_sin_cache, which covers positions [0, ",
                      rotary_cos_sin_cache.size(0), ")");
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

void check_softcap(double softcap) {
  // The kernels compute in float32 with softcap and 1 / softcap: both finite and nonzero.
  constexpr double kMin = std::numeric_limits<float>::min();
  constexpr double kMax = std::numeric_limits<float>::max();
  TORCH_CHECK_VALUE(softcap == 0.0 || (softcap >= kMin && softcap <= kMax),
                    "softcap must be 0 (no soft-capping) or a positive number in float32's normal "
                    "range [", kMin, ", ", kMax, "], got ", softcap);
}

}  // namespace fastllm
