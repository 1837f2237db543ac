// Attention written with ATen ops: what a device without a native kernel runs (MPS).
// Sequences are handled one at a time on the host; the GQA group is folded into the query rows
// so K and V are read by index, never repeated.
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "attention/attention.h"
#include "common/composite.h"
#include "rotary/rotary.h"

namespace fastllm {

void attention_out_composite(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                             int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                             std::optional<double> scale, int64_t window_left, at::Tensor& out,
                             double softcap) {
  const AttentionDims dims = check_attention_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                    max_seqlen_q, max_seqlen_k, window_left,
                                                    softcap);
  check_attention_out(out, q, k, v);
  const auto cu_q = cu_seqlens_q.to(at::kCPU);
  const auto cu_k = cu_seqlens_k.to(at::kCPU);
  check_cu_seqlens_values(cu_q, q.size(0), max_seqlen_q, "cu_seqlens_q");
  check_cu_seqlens_values(cu_k, k.size(0), max_seqlen_k, "cu_seqlens_k");
  const double sm_scale = resolve_attention_scale(scale, dims.head_dim);
  const int64_t Hkv = dims.n_kv_heads, G = dims.n_heads / Hkv, D = dims.head_dim;

  const int32_t* cq = cu_q.const_data_ptr<int32_t>();
  const int32_t* ck = cu_k.const_data_ptr<int32_t>();
  const auto index_opts = q.options().dtype(at::kLong);
  for (int64_t b = 0; b < dims.batch; ++b) {
    const int64_t len_q = cq[b + 1] - cq[b], len_k = ck[b + 1] - ck[b];
    if (len_q == 0) continue;
    auto out_b = out.narrow(0, cq[b], len_q);
    if (len_k == 0) {
      out_b.zero_();
      continue;
    }
    // [Hkv, G * len_q, D]: the group's query heads stacked as rows.
    auto qg = q.narrow(0, cq[b], len_q).to(at::kFloat).view({len_q, Hkv, G, D})
                  .permute({1, 2, 0, 3}).reshape({Hkv, G * len_q, D});
    auto kb = k.narrow(0, ck[b], len_k).to(at::kFloat).permute({1, 2, 0});  // [Hkv, D, len_k]
    auto vb = v.narrow(0, ck[b], len_k).to(at::kFloat).permute({1, 0, 2});  // [Hkv, len_k, D]
    auto scores = at::matmul(qg, kb).mul_(sm_scale).view({Hkv, G, len_q, len_k});
    // Gemma 2's soft-cap, HF's steps: divide, tanh, multiply, then the mask.
    if (softcap > 0.0) scores.div_(softcap).tanh_().mul_(softcap);

    auto diag = at::arange(len_q, index_opts).add_(len_k - len_q).unsqueeze(1);  // [len_q, 1]
    auto key = at::arange(len_k, index_opts).unsqueeze(0);                      // [1, len_k]
    auto visible = at::ones({len_q, len_k}, index_opts.dtype(at::kBool));
    if (causal) visible = visible.logical_and(key.le(diag));
    if (window_left >= 0) visible = visible.logical_and(key.ge(diag - window_left));
    scores.masked_fill_(visible.logical_not(), -std::numeric_limits<double>::infinity());
    // Rows that see no key give 0, as flash-attention does, instead of softmax's NaN.
    auto probs = at::softmax(scores, -1).masked_fill_(visible.logical_not(), 0.0);
    auto ob = at::matmul(probs.view({Hkv, G * len_q, len_k}), vb);  // [Hkv, G * len_q, D]
    out_b.copy_(ob.view({Hkv, G, len_q, D}).permute({2, 0, 1, 3}).reshape({len_q, dims.n_heads, D}));
  }
}

at::Tensor paged_attention_composite(const at::Tensor& q, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                                     int64_t max_seqlen_q, bool causal,
                                     std::optional<double> scale, int64_t window_left,
                                     const std::optional<at::Tensor>& rotary_cos_sin_cache,
                                     bool rotary_is_neox, double softcap) {
  const AttentionDims dims =
      check_paged_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                                   max_seqlen_q, window_left, softcap);
  const bool rotate_keys = check_key_rotary(rotary_cos_sin_cache, k_cache) > 0;
  const auto tables = block_tables.to(at::kCPU).contiguous();
  const auto lens = seq_lens.to(at::kCPU).contiguous();
  check_block_table_values(tables, lens, k_cache.size(0), k_cache.size(1));
  if (rotate_keys) check_key_rotary_positions(*rotary_cos_sin_cache, lens);
  // Gather each sequence's keys into the packed layout in q's dtype (a cache of another dtype
  // is read back exactly, as the CPU kernel reads it), then attend as usual.
  const int64_t block_size = k_cache.size(1);
  std::vector<at::Tensor> keys, values;
  std::vector<int32_t> cu_k{0};
  int64_t max_seqlen_k = 0;
  for (int64_t b = 0; b < dims.batch; ++b) {
    const int64_t len = lens.const_data_ptr<int32_t>()[b];
    const int64_t n_blocks = (len + block_size - 1) / block_size;
    const auto blocks = tables[b].narrow(0, 0, n_blocks).to(at::kLong).to(q.device());
    auto key = k_cache.index_select(0, blocks).flatten(0, 1).narrow(0, 0, len)
                   .to(q.scalar_type());
    if (rotate_keys) {  // pre-RoPE cache: key j sits at position j of its sequence
      const auto positions = at::arange(len, q.options().dtype(at::kLong));
      rotary_embedding_composite(positions, key, std::nullopt, *rotary_cos_sin_cache,
                                 rotary_is_neox, std::nullopt);
    }
    keys.push_back(key);
    values.push_back(
        v_cache.index_select(0, blocks).flatten(0, 1).narrow(0, 0, len).to(q.scalar_type()));
    cu_k.push_back(cu_k.back() + int32_t(len));
    max_seqlen_k = std::max(max_seqlen_k, len);
  }
  const auto cu_seqlens_k = at::tensor(cu_k, at::kInt).to(q.device());
  auto out = at::empty_like(q, at::MemoryFormat::Contiguous);
  auto cat = [&](const std::vector<at::Tensor>& parts) {
    return parts.empty() ? q.new_empty({0, dims.n_kv_heads, dims.head_dim}) : at::cat(parts);
  };
  attention_out_composite(q, cat(keys), cat(values), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, causal, scale, window_left, out, softcap);
  return out;
}

FASTLLM_COMPOSITE_IMPL(m) {
  m.impl("attention", &attention_op<attention_out_composite>);
  m.impl("attention_out", &attention_out_composite);
  m.impl("paged_attention", &paged_attention_composite);
}

}  // namespace fastllm
