// paged_attention on CUDA: checks, device guard, stream, the choice of shape and key splits;
// the kernels are in paged_attention_kernels.cuh.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "attention/attention.h"
#include "attention/attention_launch.cuh"
#include "attention/paged_attention_kernels.cuh"
#include "common/checks.h"
#include "common/cuda_host.h"
#include "common/cuda_launch.cuh"
#include "common/dispatch.h"

namespace fastllm {
namespace {

// Up to this many rows (queries x GQA group) per sequence use the decode shape (8 rows per
// block); more use the prefill shape, whose K/V tiles serve 64-128 rows.
constexpr int64_t kMaxDecodeShapeRows = 2 * cuda::kPagedDecodeRows;

// The caches' rows can be copied 16 bytes at a time: dense head_dim, and every row and chunk
// start 16-byte aligned.
bool rows_copy_in_16_bytes(const at::Tensor& cache, int64_t head_dim) {
  const int64_t vec = 16 / cache.element_size();
  return cache.stride(3) == 1 && head_dim % vec == 0 && cache.stride(0) % vec == 0 &&
         cache.stride(1) % vec == 0 && cache.stride(2) % vec == 0 &&
         reinterpret_cast<uintptr_t>(cache.const_data_ptr()) % 16 == 0;
}

// Key splits per sequence, from metadata only (the host never reads seq_lens): the smallest
// count whose last wave of blocks is nearly as full as the best count's (flash-attention's
// rule), for `base_blocks` blocks before splitting and `slots` blocks resident at once.
int choose_split_target(int64_t base_blocks, int64_t slots) {
  auto efficiency = [&](int64_t splits) {
    const double waves = double(base_blocks * splits) / double(slots);
    return waves / std::ceil(waves);
  };
  double best = 0.0;
  for (int s = 1; s <= cuda::kPagedMaxSplits; ++s) best = std::max(best, efficiency(s));
  for (int s = 1; s <= cuda::kPagedMaxSplits; ++s)
    if (efficiency(s) >= 0.85 * best) return s;
  return 1;
}

template <typename T, int kHeadDim, int kRows, bool kSoftcap>
void launch_paged_attention(cuda::PagedAttentionParams<T> params, int64_t max_queries,
                            int64_t n_kv_heads, int64_t max_keys, const at::Tensor& q) {
  using Shape = cuda::PagedShape<T, kHeadDim, kRows>;
  const auto kernel = &cuda::paged_attention_kernel<T, kHeadDim, kRows, kSoftcap>;
  const int device = q.get_device();
  int max_smem = 0, sm_count = 0, blocks_per_sm = 0;
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  TORCH_CHECK(Shape::kSmemBytes <= max_smem, "paged_attention needs ", Shape::kSmemBytes,
              " bytes of shared memory per block (head_dim ", params.head_dim,
              "), the device allows ", max_smem);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      Shape::kSmemBytes));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &blocks_per_sm, kernel, Shape::kThreads, Shape::kSmemBytes));

  const int64_t row_tiles = ceil_div(max_queries * params.group, kRows);
  const int64_t seq_tiles = params.batch * row_tiles;
  TORCH_CHECK_VALUE(seq_tiles <= std::numeric_limits<int32_t>::max(),
                    "paged_attention: batch * ceil(max_seqlen_q * n_heads / n_kv_heads / ",
                    kRows, ") = ", seq_tiles, " blocks exceed the CUDA grid");
  const int64_t base_blocks = seq_tiles * n_kv_heads;
  const int split_target =
      choose_split_target(base_blocks, int64_t(sm_count) * std::max(blocks_per_sm, 1));
  // No sequence has more keys than its block table row holds (checked on the host outside
  // graph capture), so no sequence needs more splits than this.
  const int64_t grid_splits =
      std::min<int64_t>(split_target, ceil_div(max_keys, Shape::kMinKeysPerSplit));
  params.row_tiles = int(row_tiles);

  at::Tensor partial_out, partial_stats;
  if (grid_splits > 1) {
    const auto floats = q.options().dtype(at::kFloat);
    partial_out =
        at::empty({grid_splits, params.total_q, params.n_heads, params.head_dim}, floats);
    partial_stats = at::empty({grid_splits, params.total_q, params.n_heads, 2}, floats);
    params.partial_out = partial_out.mutable_data_ptr<float>();
    params.partial_stats = partial_stats.mutable_data_ptr<float>();
    params.split_target = split_target;
  } else {
    params.split_target = 1;  // every block sees all its keys and writes the output
  }

  const dim3 grid(unsigned(seq_tiles), unsigned(n_kv_heads),
                  unsigned(std::max<int64_t>(grid_splits, 1)));
  launch_kernel(kernel, grid, Shape::kThreads, Shape::kSmemBytes, params);
  if (grid_splits > 1) {
    const int64_t rows = int64_t(params.total_q) * params.n_heads;
    launch_kernel(&cuda::paged_attention_combine_kernel<T>,
                  unsigned(ceil_div(rows, cuda::kPagedCombineWarps)),
                  cuda::kPagedCombineWarps * 32, 0, params.partial_out, params.partial_stats,
                  params.out, rows, params.head_dim, int(grid_splits));
  }
}

// The shape for head_dim (padded to 64 / 128 / 256) and the rows per sequence: decode, or
// prefill (head_dim <= 128 only) where the queries times the group exceed two decode tiles (what
// paged_prefill_on_tensor_cores leaves: float32 and pre-RoPE caches).
template <typename T, bool kSoftcap>
void launch_paged_shape(const cuda::PagedAttentionParams<T>& params, int64_t query_rows,
                        int64_t n_kv_heads, int64_t max_keys, const at::Tensor& q) {
  const int64_t head_dim = params.head_dim;
  const bool prefill_shape = head_dim <= 128 && query_rows * params.group > kMaxDecodeShapeRows;
  constexpr int kDecodeRows = cuda::kPagedDecodeRows;
  if (head_dim <= 64) {
    if (prefill_shape)
      launch_paged_attention<T, 64, cuda::paged_prefill_rows(64), kSoftcap>(
          params, query_rows, n_kv_heads, max_keys, q);
    else
      launch_paged_attention<T, 64, kDecodeRows, kSoftcap>(params, query_rows, n_kv_heads,
                                                           max_keys, q);
  } else if (head_dim <= 128) {
    if (prefill_shape)
      launch_paged_attention<T, 128, cuda::paged_prefill_rows(128), kSoftcap>(
          params, query_rows, n_kv_heads, max_keys, q);
    else
      launch_paged_attention<T, 128, kDecodeRows, kSoftcap>(params, query_rows, n_kv_heads,
                                                            max_keys, q);
  } else {
    launch_paged_attention<T, 256, kDecodeRows, kSoftcap>(params, query_rows, n_kv_heads,
                                                          max_keys, q);
  }
}

// Chunked prefill in 16 bits over keys cached after RoPE runs the tensor-core varlen kernel with
// its K/V rows read through the block tables: many query rows against a cached prefix are a
// matmul, several times slower on the paged kernel's CUDA cores. False where the kernel does not
// take the call (float32, pre-RoPE keys, decode-sized rows, caches without a unit dim stride,
// or no configuration fitting the device); the paged kernels run it then.
template <typename T>
bool paged_prefill_on_tensor_cores(const at::Tensor& q_rows, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                                   const at::Tensor& lens, const at::Tensor& cu_q,
                                   const at::Tensor& out, const AttentionDims& dims,
                                   int64_t query_rows, bool causal, int64_t window_left,
                                   double sm_scale, double softcap, int64_t rotary_dim) {
  if constexpr (std::is_same_v<T, float>) {
    return false;
  } else {
    const int64_t group = dims.n_heads / dims.n_kv_heads;
    if (rotary_dim > 0 || query_rows * group <= kMaxDecodeShapeRows || k_cache.stride(3) != 1 ||
        v_cache.stride(3) != 1)
      return false;
    auto params = query_params<T>(q_rows, out, cu_q, dims.batch, dims.n_heads, dims.n_kv_heads,
                                  causal, sm_scale, softcap);
    params.k = reinterpret_cast<const T*>(k_cache.const_data_ptr());
    params.v = reinterpret_cast<const T*>(v_cache.const_data_ptr());
    params.k_stride_token = k_cache.stride(1);
    params.k_stride_head = k_cache.stride(2);
    params.k_stride_block = k_cache.stride(0);
    params.v_stride_token = v_cache.stride(1);
    params.v_stride_head = v_cache.stride(2);
    params.v_stride_block = v_cache.stride(0);
    // A window wider than any int32 key count excludes nothing: the same as none.
    params.window_left = window_left < 0 || window_left > std::numeric_limits<int32_t>::max()
                             ? -1
                             : int(window_left);
    params.vector_loads = has_16_byte_rows(q_rows) &&
                          rows_copy_in_16_bytes(k_cache, dims.head_dim) &&
                          rows_copy_in_16_bytes(v_cache, dims.head_dim);
    params.block_tables = block_tables.const_data_ptr<int32_t>();
    params.seq_lens = lens.const_data_ptr<int32_t>();
    params.table_stride_seq = block_tables.stride(0);
    params.table_stride_block = block_tables.stride(1);
    params.num_blocks = k_cache.size(0);
    params.max_blocks = int(std::min<int64_t>(block_tables.size(1),
                                              std::numeric_limits<int32_t>::max()));
    params.block_size = int(k_cache.size(1));
    const int max_smem = max_shared_memory_per_block();
    return softcap > 0.0
               ? launch_tensor_core_attention<T, true, true>(params, query_rows, max_smem)
               : launch_tensor_core_attention<T, false, true>(params, query_rows, max_smem);
  }
}

at::Tensor paged_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                                int64_t max_seqlen_q, bool causal, std::optional<double> scale,
                                int64_t window_left,
                                const std::optional<at::Tensor>& rotary_cos_sin_cache,
                                bool rotary_is_neox, double softcap) {
  const AttentionDims dims =
      check_paged_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                                   max_seqlen_q, window_left, softcap);
  // The kernels stage K/V tiles in q's storage type; a cache of another dtype runs on the CPU
  // (and in the composite), not here.
  TORCH_CHECK_TYPE(k_cache.scalar_type() == q.scalar_type(),
                   "paged_attention on CUDA needs caches of q's dtype, got k_cache ",
                   dtype_name(k_cache.scalar_type()), " and q ", dtype_name(q.scalar_type()),
                   "; caches of another dtype are read on the CPU only");
  if (dims.head_dim > cuda::kPagedMaxHeadDim) {
    // No kernel shape holds such rows; the ATen composition is exact, if slow (and reads
    // seq_lens on the host, so it cannot be captured in a CUDA graph).
    return paged_attention_composite(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                                     max_seqlen_q, causal, scale, window_left,
                                     rotary_cos_sin_cache, rotary_is_neox, softcap);
  }
  const int64_t rotary_dim = check_key_rotary(rotary_cos_sin_cache, k_cache);
  // Before the value checks too: whether the stream is being captured is asked of the current
  // device.
  const c10::cuda::CUDAGuard guard(q.device());
  if (can_check_values()) {
    check_cu_seqlens_values(host_copy(cu_seqlens_q), q.size(0), max_seqlen_q, "cu_seqlens_q");
    const auto lens = host_copy(seq_lens);
    check_block_table_values(host_copy(block_tables), lens, k_cache.size(0), k_cache.size(1));
    if (rotary_dim > 0) check_key_rotary_positions(*rotary_cos_sin_cache, lens);
  }
  const double sm_scale = resolve_attention_scale(scale, dims.head_dim);
  TORCH_CHECK_VALUE(q.size(0) <= std::numeric_limits<int32_t>::max(),
                    "paged_attention on CUDA takes at most 2^31 - 1 query tokens, got ",
                    q.size(0));
  TORCH_CHECK_VALUE(dims.n_kv_heads <= 65535,
                    "paged_attention on CUDA takes at most 65535 kv heads, got ", dims.n_kv_heads);

  auto out = at::empty_like(q, at::MemoryFormat::Contiguous);
  // No sequence has more queries than max_seqlen_q (checked above) nor than all of q.
  const int64_t query_rows = std::min(max_seqlen_q, q.size(0));
  if (query_rows == 0 || dims.batch == 0) return out;

  // The kernel reads q rows densely; the caches are used in place whatever their strides.
  const auto q_rows = q.stride(2) == 1 ? q : q.contiguous();
  const auto lens = seq_lens.contiguous();
  const auto cu_q = cu_seqlens_q.contiguous();
  at::Tensor rotary_table;
  if (rotary_dim > 0) rotary_table = rotary_cos_sin_cache->contiguous();
  const int64_t group = dims.n_heads / dims.n_kv_heads;
  const int64_t max_keys = block_tables.size(1) * k_cache.size(1);
  const int64_t head_dim = dims.head_dim;

  FASTLLM_DISPATCH_FLOAT_TYPES(q.scalar_type(), "fastllm::paged_attention_cuda", [&] {
    using T = cuda_storage_t<scalar_t>;
    if (paged_prefill_on_tensor_cores<T>(q_rows, k_cache, v_cache, block_tables, lens, cu_q, out,
                                         dims, query_rows, causal, window_left, sm_scale,
                                         softcap, rotary_dim))
      return;
    cuda::PagedAttentionParams<T> params{};
    params.q = cuda_ptr<scalar_t>(q_rows);
    params.q_stride_token = q_rows.stride(0);
    params.q_stride_head = q_rows.stride(1);
    params.k_cache = cuda_ptr<scalar_t>(k_cache);
    params.v_cache = cuda_ptr<scalar_t>(v_cache);
    params.k_stride_block = k_cache.stride(0);
    params.k_stride_slot = k_cache.stride(1);
    params.k_stride_head = k_cache.stride(2);
    params.k_stride_dim = k_cache.stride(3);
    params.v_stride_block = v_cache.stride(0);
    params.v_stride_slot = v_cache.stride(1);
    params.v_stride_head = v_cache.stride(2);
    params.v_stride_dim = v_cache.stride(3);
    params.k_vector_loads = rows_copy_in_16_bytes(k_cache, head_dim);
    params.v_vector_loads = rows_copy_in_16_bytes(v_cache, head_dim);
    params.block_tables = block_tables.const_data_ptr<int32_t>();
    params.table_stride_seq = block_tables.stride(0);
    params.table_stride_block = block_tables.stride(1);
    params.max_blocks = int(std::min<int64_t>(block_tables.size(1),
                                              std::numeric_limits<int32_t>::max()));
    params.num_blocks = k_cache.size(0);
    params.block_size = int(k_cache.size(1));
    params.seq_lens = lens.const_data_ptr<int32_t>();
    params.cu_seqlens_q = cu_q.const_data_ptr<int32_t>();
    params.rotary_cos_sin = rotary_dim > 0 ? rotary_table.const_data_ptr<float>() : nullptr;
    params.rotary_dim = int(rotary_dim);
    params.rotary_max_position = rotary_dim > 0 ? rotary_table.size(0) : 0;
    params.rotary_is_neox = rotary_is_neox;
    params.out = cuda_mutable_ptr<scalar_t>(out);
    params.partial_out = nullptr;
    params.partial_stats = nullptr;
    params.total_q = int(q.size(0));
    params.batch = int(dims.batch);
    params.n_heads = int(dims.n_heads);
    params.group = int(group);
    params.head_dim = int(head_dim);
    params.causal = causal;
    params.window_left = window_left;
    params.scale_log2 = float(sm_scale * kLog2e);
    params.softcap = float(softcap);
    params.softcap_inv_log2 = softcap > 0.0 ? float(1.0 / (softcap * kLog2e)) : 0.f;
    if (softcap > 0.0)
      launch_paged_shape<T, true>(params, query_rows, dims.n_kv_heads, max_keys, q);
    else
      launch_paged_shape<T, false>(params, query_rows, dims.n_kv_heads, max_keys, q);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CUDA, m) { m.impl("paged_attention", &paged_attention_cuda); }

}  // namespace fastllm
