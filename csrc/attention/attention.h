// Shared by the attention implementations of every device.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

namespace fastllm {

// log2(e): the CUDA kernels' softmax takes powers of 2, so their host code scales the scores by it.
constexpr double kLog2e = 1.4426950408889634;

struct AttentionDims {
  int64_t batch;
  int64_t n_heads;
  int64_t n_kv_heads;
  int64_t head_dim;
};

// Checks q/k/v/cu_seqlens metadata (ranks, dtypes, devices, head counts), the window and the
// soft-cap, and returns the dims.
AttentionDims check_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& cu_seqlens_q,
                                     const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                     int64_t max_seqlen_k, int64_t window_left, double softcap);

// Metadata checks of paged attention: q as in attention, caches [num_blocks, block_size,
// n_kv_heads, head_dim] of q's dtype or, under float32 q, of bfloat16 / float16 (read back as
// float32), block_tables int32 [batch, max_blocks], seq_lens int32 [batch].
AttentionDims check_paged_attention_inputs(const at::Tensor& q, const at::Tensor& k_cache,
                                           const at::Tensor& v_cache,
                                           const at::Tensor& block_tables,
                                           const at::Tensor& seq_lens,
                                           const at::Tensor& cu_seqlens_q, int64_t max_seqlen_q,
                                           int64_t window_left, double softcap);

// Checks CPU block tables against the sequence lengths: every block a sequence reads exists.
void check_block_table_values(const at::Tensor& block_tables_cpu, const at::Tensor& seq_lens_cpu,
                              int64_t num_blocks, int64_t block_size);

// Position-independent (pre-RoPE) caches hold keys before rotary embedding; paged attention
// rotates key j of a sequence by position j as it reads it. Checks the float32 cos|sin table
// [max_position, rotary_dim] against the caches and returns rotary_dim (0 without a table).
int64_t check_key_rotary(const std::optional<at::Tensor>& rotary_cos_sin_cache,
                         const at::Tensor& k_cache);
// Checks that the table covers every key position the CPU seq_lens reach.
void check_key_rotary_positions(const at::Tensor& rotary_cos_sin_cache,
                                const at::Tensor& seq_lens_cpu);

// Checks the values of a CPU int32 cu_seqlens: starts at 0, non-decreasing, ends at `total`,
// no sequence longer than `max_seqlen`.
void check_cu_seqlens_values(const at::Tensor& cu_seqlens_cpu, int64_t total, int64_t max_seqlen,
                             const char* name);

// Checks that `out` can take the op's result: q's shape, dtype and device (any strides, but no
// element written twice and no memory shared with the inputs).
void check_attention_out(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v);

double resolve_attention_scale(std::optional<double> scale, int64_t head_dim);

// Logit soft-capping (Gemma 2): with softcap > 0 a score s (q . k times the scale) becomes
// softcap * tanh(s / softcap) before the mask and the softmax; 0 leaves scores as they are.
// Checks that softcap is 0 or a positive float32 normal number (finite, with a finite
// reciprocal).
void check_softcap(double softcap);

// A device's attention_out: checks its inputs and writes the result into `out`.
using AttentionOutImpl = void (*)(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                  int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                                  std::optional<double> scale, int64_t window_left,
                                  at::Tensor& out, double softcap);

// The attention op around a device's attention_out: allocates the output it writes.
template <AttentionOutImpl impl>
at::Tensor attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                        int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                        std::optional<double> scale, int64_t window_left, double softcap) {
  auto out = at::empty_like(q, at::MemoryFormat::Contiguous);
  impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
       window_left, out, softcap);
  return out;
}

// ATen composition of the op, registered for devices without a native kernel (MPS).
at::Tensor paged_attention_composite(const at::Tensor& q, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                                     int64_t max_seqlen_q, bool causal,
                                     std::optional<double> scale, int64_t window_left,
                                     const std::optional<at::Tensor>& rotary_cos_sin_cache,
                                     bool rotary_is_neox, double softcap);
void attention_out_composite(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                             int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                             std::optional<double> scale, int64_t window_left, at::Tensor& out,
                             double softcap);

}  // namespace fastllm
