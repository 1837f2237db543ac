// Varlen (packed) prefill attention on CUDA, free of torch headers (nvcc compiles it alone in the
// tests). Same semantics as attention_cpu.cpp: bottom-right causal mask, optional sliding window,
// optional logit soft-cap, GQA by index, float32 softmax and accumulation, queries that see no
// key give exactly 0.
//
// Soft-cap (Gemma 2): kernels instantiated with kSoftcap turn each scaled score s into
// softcap * tanh(s / softcap) (attention_detail::soft_cap, on the log2-domain scores) before the
// mask; the kSoftcap = false instantiations are the kernels without it, unchanged.
//
// Work split. One thread block of 4 warps per (query tile, head, sequence), flattened into
// blockIdx.x as ((reversed query tile * batch) + sequence) * n_heads + head: the last query tiles
// of every sequence, which see the most keys under a causal mask, are launched first. Key blocks
// outside the keys a tile can see are never visited; the mask is evaluated (from indices) only in
// blocks where some row of the tile does not see every key: the diagonal, the window's edge, the
// end of the sequence. Sequence bounds are clamped to [0, total], so bad cu_seqlens (not checked
// during CUDA-graph capture) never make a kernel read or write out of bounds.
//
// Paged K/V (the tensor-core kernel's kPaged instantiations, paged_attention's 16-bit chunked
// prefill): the K and V rows come from paged caches through the block tables. Before a tile's
// loads are issued, one thread per key writes its (block id, slot) to shared memory, a tile
// ahead of the K load (double-buffered; V reuses its tile's), so each row's address is a shared
// read rather than a table read and a division.
//
// Tensor-core kernel (bfloat16 / float16, head_dim <= 256), FlashAttention-2 style:
// - head_dim is padded with zeros to kHeadDim in {64, 80, 96, 128, 256}; rows of Q (kBlockM), K
//   and V (kBlockN = 64 keys) sit in shared memory kHeadDim + 8 elements apart, so the eight 16-byte
//   rows of every 8x8 ldmatrix load fall in distinct bank groups ((kHeadDim + 8) / 8 is odd).
// - Each warp owns kRowsPerWarp query rows (32, or 16 for kHeadDim 256 to bound registers):
//   S = Q K^T and O += P V are mma.sync.m16n8k16 with float32 accumulators; the online softmax
//   runs on the S fragments in registers, and P is re-packed as the A operand of P V without
//   leaving registers.
// - Pipeline (one buffer each for Q, K, V; loads are cp.async 16-byte copies with zero fill, or
//   plain element loads when rows are not 16-byte aligned):
//     wait, barrier | issue V[n] | S = Q K[n]^T | wait, barrier | issue K[n-1] | softmax, O += P V[n]
//   so the K load overlaps the softmax and P V, the V load overlaps Q K^T.
// - The output is normalized, staged in the warp's own Q rows and stored in 16-byte chunks.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), with
// g = lane / 4 and c = lane % 4; each .b32 register holds two 16-bit elements, lower column first:
//   A 16x16 (row): a[0] = A[g][2c, 2c+1]  a[1] = A[g+8][2c, 2c+1]
//                  a[2] = A[g][2c+8, +9]  a[3] = A[g+8][2c+8, +9]
//   B 16x8 (col):  b[0] = B[2c, 2c+1][g]  b[1] = B[2c+8, 2c+9][g]
//   C 16x8 f32:    c[0], c[1] = C[g][2c, 2c+1]  c[2], c[3] = C[g+8][2c, 2c+1]
// ldmatrix.x4 reads four 8x8 matrices whose row addresses come from lanes 0-7, 8-15, 16-23,
// 24-31; for matrix i, register i of lane l holds row l / 4, columns 2(l % 4), +1 (with .trans,
// the transposed matrix). Hence:
//   Q (row-major [row][dim]) as A: lane l points at row (l % 16), column 8 (l / 16).
//   K ([key][dim]) is B = K^T "col": lane l points at key (l % 8) + 8 (l / 16), column
//     8 ((l / 8) % 2); registers {0, 1} are b[0], b[1] of keys n..n+7, {2, 3} of keys n+8..n+15.
//   V ([key][dim]) is B of P V, read with .trans: lane l points at key (l % 8) + 8 ((l / 8) % 2),
//     column 8 (l / 16); registers {0, 1} serve dims d..d+7, {2, 3} dims d+8..d+15.
//   The S accumulators of key tiles 2k and 2k+1 are exactly the A fragment of P for keys
//     16k..16k+15: a = {S[2k][0,1], S[2k][2,3], S[2k+1][0,1], S[2k+1][2,3]}.
// Rows of a C fragment are spread over the 4 lanes of a quad: row max and sum are reduced with
// __shfl_xor_sync over lane masks 1 and 2.
//
// SIMT kernel (float32, and the fallback of any dtype): blocks of 16 query rows (4 per warp)
// against 32-key blocks held in shared memory as float; lane j scores key j against its warp's 4
// rows, then every lane accumulates P V for its head dims d = lane + 32 i.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "common/cuda_ptx.cuh"
#include "common/cuda_types.cuh"

namespace fastllm {
namespace cuda {

constexpr int kAttentionThreads = 128;  // 4 warps, in both kernels

template <typename scalar_t>
struct VarlenAttentionParams {
  const scalar_t* q;  // [total_q, n_heads, head_dim], unit head_dim stride
  const scalar_t* k;  // [total_k, n_kv_heads, head_dim], unit head_dim stride
  const scalar_t* v;
  scalar_t* out;  // q's shape, any strides
  const int32_t* cu_seqlens_q;  // [batch + 1]
  const int32_t* cu_seqlens_k;
  int64_t q_stride_token, q_stride_head;
  int64_t k_stride_token, k_stride_head;
  int64_t v_stride_token, v_stride_head;
  int64_t out_stride_token, out_stride_head, out_stride_dim;
  int total_q, total_k;
  int batch, n_heads, group, head_dim;  // group = n_heads / n_kv_heads
  int query_tiles;  // query tiles per (sequence, head) in the grid
  int window_left;  // -1: no window
  bool causal;
  bool vector_loads;   // q/k/v rows and strides allow 16-byte copies (tensor-core kernel)
  bool vector_stores;  // out rows and strides allow 16-byte stores (tensor-core kernel)
  float scale_log2;    // softmax scale * log2(e): probabilities are exp2(score * scale_log2 - max)
  float softcap;           // > 0 in kSoftcap kernels: the soft-cap
  float softcap_inv_log2;  // 1 / (softcap * log2(e)): log2-domain score -> score / softcap
  // Paged K/V (the kPaged tensor-core kernel: paged_attention's chunked prefill): k and v are the
  // caches [num_blocks, block_size, n_kv_heads, head_dim] and k/v_stride_token their slot
  // strides; key j of sequence b is slot j % block_size of block block_tables[b][j / block_size],
  // and the sequence has max(seq_lens[b], 0) keys (cu_seqlens_k and total_k are not read). As in
  // the paged kernel, block ids outside [0, num_blocks) and table columns past max_blocks read as
  // zero rows.
  const int32_t* block_tables;  // [batch, max_blocks], any strides
  const int32_t* seq_lens;      // [batch]
  int64_t table_stride_seq, table_stride_block;
  int64_t k_stride_block, v_stride_block;
  int64_t num_blocks;
  int max_blocks, block_size;
};

// Tile shape of the tensor-core kernel for a padded head_dim; the host reads it too.
template <int kHeadDim>
struct TensorCoreShape {
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "head_dim is padded to a multiple of 16");
  static constexpr int kRowsPerWarp = kHeadDim <= 128 ? 32 : 16;
  static constexpr int kBlockM = 4 * kRowsPerWarp;  // query rows per thread block
  static constexpr int kBlockN = 64;                // keys per block
  static constexpr int kStride = kHeadDim + 8;      // shared-memory row stride, in elements
  static constexpr int kSmemBytes = (kBlockM + 2 * kBlockN) * kStride * 2;
  // Paged K/V add two tiles' (block id, slot) per key.
  static constexpr int kPagedSmemBytes = kSmemBytes + 2 * kBlockN * 8;
};

// Tile shape of the SIMT kernel: each lane holds kDimsPerLane head dims of 4 query rows.
template <int kDimsPerLane>
struct SimtShape {
  static constexpr int kRowsPerWarp = 4;
  static constexpr int kBlockM = 4 * kRowsPerWarp;
  static constexpr int kBlockN = 32;  // one key per lane
  static constexpr int kDims = 32 * kDimsPerLane;
  // float4 reads of lane j's key row: a stride of 4 mod 32 words keeps 8 lanes on 8 bank groups.
  static constexpr int kKeyStride = kDims + 4;
  static constexpr int kSmemBytes = (kBlockM * kDims + kBlockN * kKeyStride + kBlockN * kDims) * 4;
};

namespace attention_detail {

// Two floats rounded into one register, `low` in the lower 16 bits (the lower column).
template <typename scalar_t>
__device__ __forceinline__ uint32_t pack_pair(float low, float high);

template <>
__device__ __forceinline__ uint32_t pack_pair<__nv_bfloat16>(float low, float high) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

template <>
__device__ __forceinline__ uint32_t pack_pair<__half>(float low, float high) {
  const __half2 pair = __floats2half2_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// A log2-domain score s * log2(e), soft-capped: softcap * tanh(s / softcap) * log2(e), in this
// order (softcap * log2(e) itself would overflow for a softcap above FLT_MAX / log2(e)).
__device__ __forceinline__ float soft_cap(float score_log2, float softcap,
                                          float softcap_inv_log2) {
  return softcap * tanhf(score_log2 * softcap_inv_log2) * CUDART_L2E_F;
}

// Keys [begin, end) that query position i of a sequence sees: causal keys j <= i + len_k - len_q
// (bottom-right aligned), with a window also j >= i + len_k - len_q - window_left. begin is in
// [0, len_k], end in [0, len_k]; begin >= end means none.
struct KeySpan {
  int begin, end;
};

__device__ __forceinline__ KeySpan visible_keys(int i, int len_q, int len_k, bool causal,
                                                int window_left) {
  const int64_t diagonal = int64_t(i) + len_k - len_q;
  int64_t end = causal && diagonal + 1 < len_k ? diagonal + 1 : len_k;
  int64_t begin = window_left >= 0 ? diagonal - window_left : 0;
  end = end < 0 ? 0 : end;
  begin = begin < 0 ? 0 : begin > len_k ? len_k : begin;
  return {int(begin), int(end)};
}

// Mask thresholds relative to a lane's block columns lie in a small range of interest (columns
// 0..63 minus row offsets 0..24); clamping them keeps every comparison and fits an int.
constexpr int kThresholdLimit = 1024;

__device__ __forceinline__ int clamp_threshold(int64_t value) {
  return value < -kThresholdLimit ? -kThresholdLimit
         : value > kThresholdLimit ? kThresholdLimit
                                   : int(value);
}

// What one thread block works on, decoded from blockIdx.x (see the top comment).
struct QueryTile {
  int head, seq;
  int q_begin, len_q;  // the sequence's queries: packed rows [q_begin, q_begin + len_q)
  int k_begin, len_k;  // and keys
  int first_row;       // the tile's first query position within the sequence
  int rows;            // query rows of the tile inside the sequence (<= 0: nothing to do)
  int key_begin, key_end;    // keys some row of the tile sees
  int full_begin, full_end;  // keys every row of the tile sees (key blocks inside need no mask)
};

__device__ __forceinline__ int clamp_offset(int value, int low, int high) {
  return value < low ? low : value > high ? high : value;
}

template <bool kPaged = false, typename scalar_t>
__device__ __forceinline__ QueryTile locate_query_tile(const VarlenAttentionParams<scalar_t>& p,
                                                       int block_m) {
  QueryTile t;
  const int flat = int(blockIdx.x);
  t.head = flat % p.n_heads;
  const int rest = flat / p.n_heads;
  const int seq = rest % p.batch;
  t.seq = seq;
  const int query_tile = p.query_tiles - 1 - rest / p.batch;
  t.q_begin = clamp_offset(p.cu_seqlens_q[seq], 0, p.total_q);
  t.len_q = clamp_offset(p.cu_seqlens_q[seq + 1], t.q_begin, p.total_q) - t.q_begin;
  if constexpr (kPaged) {
    t.k_begin = 0;
    t.len_k = p.seq_lens[seq] > 0 ? p.seq_lens[seq] : 0;
  } else {
    t.k_begin = clamp_offset(p.cu_seqlens_k[seq], 0, p.total_k);
    t.len_k = clamp_offset(p.cu_seqlens_k[seq + 1], t.k_begin, p.total_k) - t.k_begin;
  }
  t.first_row = query_tile * block_m;
  t.rows = t.len_q - t.first_row < block_m ? t.len_q - t.first_row : block_m;
  if (t.rows <= 0) return t;
  const KeySpan first = visible_keys(t.first_row, t.len_q, t.len_k, p.causal, p.window_left);
  const KeySpan last =
      visible_keys(t.first_row + t.rows - 1, t.len_q, t.len_k, p.causal, p.window_left);
  t.key_begin = first.begin;
  t.key_end = last.end;
  t.full_begin = last.begin;
  t.full_end = first.end;
  return t;
}

// Copies rows [0, kRows) of a [kRows, kHeadDim] tile into shared memory (row stride
// kHeadDim + 8), row r from src + r * stride_token; rows >= valid_rows and dims >= head_dim become
// zeros. Vector copies are asynchronous (cp.async), element copies are plain stores; both are
// visible to the block after cp_async_wait_all() and __syncthreads(). A thread copies one 16-byte
// column of every 8th row, so its source moves by a single increment (few live registers).
template <int kRows, int kHeadDim, typename scalar_t>
__device__ __forceinline__ void load_tile(scalar_t* smem, const scalar_t* src,
                                          int64_t stride_token, int valid_rows, int head_dim,
                                          bool vector_loads) {
  constexpr int kStride = kHeadDim + 8;
  constexpr int kColumnThreads = 16;  // threads per row: 16 chunks of 8 elements
  constexpr int kRowStep = kAttentionThreads / kColumnThreads;
  static_assert(kRows % kRowStep == 0, "rows split evenly over the threads");
  const int first_row = threadIdx.x / kColumnThreads;
  const int64_t step = kRowStep * stride_token;
#pragma unroll
  for (int column = (threadIdx.x % kColumnThreads) * 8; column < kHeadDim;
       column += kColumnThreads * 8) {
    const scalar_t* from = src + first_row * stride_token + column;
    scalar_t* to = smem + first_row * kStride + column;
    if (vector_loads) {  // head_dim % 8 == 0: a chunk is all inside or all outside head_dim
#pragma unroll
      for (int row = first_row; row < kRows; row += kRowStep) {
        const bool inside = row < valid_rows && column < head_dim;
        cp_async_16(smem_address(to), inside ? from : src, inside);
        from += step;
        to += kRowStep * kStride;
      }
    } else {
      const int n = head_dim - column < 8 ? head_dim - column : 8;  // dims of the chunk inside
      // Not unrolled: the K load runs while S and O fill the registers; 8 values in flight.
#pragma unroll 1
      for (int row = first_row; row < kRows; row += kRowStep) {
#pragma unroll
        for (int d = 0; d < 8; ++d)
          to[d] = row < valid_rows && d < n ? from[d] : from_float<scalar_t>(0.f);
        from += step;
        to += kRowStep * kStride;
      }
    }
  }
}

// The K or V rows of one (sequence, kv head): packed, key j at base + j * stride; or paged
// (table set), key j in slot j % block_size (`stride` apart) of block table[j / block_size]
// (`stride_block` apart).
template <typename scalar_t>
struct KeyRows {
  const scalar_t* base;
  int64_t stride;
  const int32_t* table;  // the sequence's block table row (paged only)
  int64_t table_stride, stride_block, num_blocks;
  int max_blocks, block_size;
};

template <bool kPaged, typename scalar_t>
__device__ __forceinline__ KeyRows<scalar_t> key_rows(const VarlenAttentionParams<scalar_t>& p,
                                                      const QueryTile& tile, int kv_head,
                                                      const scalar_t* data, int64_t stride_token,
                                                      int64_t stride_head, int64_t stride_block) {
  KeyRows<scalar_t> rows{};
  rows.stride = stride_token;
  if constexpr (kPaged) {
    rows.base = data + int64_t(kv_head) * stride_head;
    rows.table = p.block_tables + int64_t(tile.seq) * p.table_stride_seq;
    rows.table_stride = p.table_stride_block;
    rows.stride_block = stride_block;
    rows.num_blocks = p.num_blocks;
    rows.max_blocks = p.max_blocks;
    rows.block_size = p.block_size;
  } else {
    rows.base = data + int64_t(tile.k_begin) * stride_token + int64_t(kv_head) * stride_head;
  }
  return rows;
}

// Paged K/V: threads c < kBlockN write where key key0 + c of a tile is, (block id, slot), to
// located[c]; id -1 where the key is past the tile's valid_rows, its table column past
// max_blocks or its block id outside [0, num_blocks) (a row of zeros). K and V share it.
template <int kBlockN, typename scalar_t>
__device__ __forceinline__ void locate_tile_keys(int2* located, const KeyRows<scalar_t>& rows,
                                                 int key0, int valid_rows) {
  const int c = int(threadIdx.x);
  if (c >= kBlockN) return;
  int2 where = make_int2(-1, 0);
  if (c < valid_rows) {
    const int key = key0 + c, column = key / rows.block_size;
    if (column < rows.max_blocks) {
      const int32_t id = rows.table[column * rows.table_stride];
      if (id >= 0 && id < rows.num_blocks) where = make_int2(id, key - column * rows.block_size);
    }
  }
  located[c] = where;
}

// load_tile for keys [key0, key0 + kRows) of `rows` (valid_rows of them inside the sequence);
// paged rows from where `located` (locate_tile_keys) puts them.
template <int kRows, int kHeadDim, bool kPaged, typename scalar_t>
__device__ __forceinline__ void load_key_tile(scalar_t* smem, const KeyRows<scalar_t>& rows,
                                              const int2* located, int key0, int valid_rows,
                                              int head_dim, bool vector_loads) {
  if constexpr (!kPaged) {
    load_tile<kRows, kHeadDim>(smem, rows.base + int64_t(key0) * rows.stride, rows.stride,
                               valid_rows, head_dim, vector_loads);
  } else {
    constexpr int kStride = kHeadDim + 8;
    constexpr int kColumnThreads = 16;
    constexpr int kRowStep = kAttentionThreads / kColumnThreads;
    static_assert(kRows % kRowStep == 0, "rows split evenly over the threads");
    const int first_column = (threadIdx.x % kColumnThreads) * 8;
#pragma unroll
    for (int row = threadIdx.x / kColumnThreads; row < kRows; row += kRowStep) {
      const int2 where = located[row];
      const scalar_t* from =
          where.x >= 0 ? rows.base + where.x * rows.stride_block + int64_t(where.y) * rows.stride
                       : nullptr;
      scalar_t* to = smem + row * kStride;
#pragma unroll
      for (int column = first_column; column < kHeadDim; column += kColumnThreads * 8) {
        if (vector_loads) {
          const bool inside = from != nullptr && column < head_dim;
          cp_async_16(smem_address(to + column), inside ? from + column : rows.base, inside);
        } else {
#pragma unroll
          for (int d = 0; d < 8; ++d)
            to[column + d] = from != nullptr && column + d < head_dim ? from[column + d]
                                                                      : from_float<scalar_t>(0.f);
        }
      }
    }
  }
}

}  // namespace attention_detail

// kPaged: K/V from paged caches (see VarlenAttentionParams), otherwise packed.
template <typename scalar_t, int kHeadDim, bool kSoftcap, bool kPaged>
__global__ void __launch_bounds__(kAttentionThreads)
    attention_tensor_core_kernel(const VarlenAttentionParams<scalar_t> params) {
  using namespace attention_detail;
  using Shape = TensorCoreShape<kHeadDim>;
  constexpr int kRowsPerWarp = Shape::kRowsPerWarp;
  constexpr int kBlockM = Shape::kBlockM;
  constexpr int kBlockN = Shape::kBlockN;
  constexpr int kStride = Shape::kStride;
  constexpr int kRowTiles = kRowsPerWarp / 16;  // m16 tiles per warp
  constexpr int kKeyTiles = kBlockN / 8;        // n8 tiles of S
  constexpr int kDimTiles = kHeadDim / 8;       // n8 tiles of O
  constexpr int kBytes = sizeof(scalar_t);

  const QueryTile tile = locate_query_tile<kPaged>(params, kBlockM);
  if (tile.rows <= 0) return;  // the whole block: past the end of its sequence

  scalar_t* q_smem = reinterpret_cast<scalar_t*>(dynamic_shared_memory());
  scalar_t* k_smem = q_smem + kBlockM * kStride;
  scalar_t* v_smem = k_smem + kBlockN * kStride;
  // Paged: where the keys of two tiles are, [2][kBlockN], tile `block` in buffer block % 2.
  int2* located = reinterpret_cast<int2*>(v_smem + kBlockN * kStride);

  const int head_dim = params.head_dim;
  const bool vector_loads = params.vector_loads;
  const bool causal = params.causal;
  const int window_left = params.window_left;
  const float scale_log2 = params.scale_log2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int quad_row = lane / 4, quad_col = lane % 4;  // g and c of the fragment layouts
  const int kv_head = tile.head / params.group;
  const KeyRows<scalar_t> k_rows =
      key_rows<kPaged>(params, tile, kv_head, params.k, params.k_stride_token,
                       params.k_stride_head, params.k_stride_block);
  const KeyRows<scalar_t> v_rows =
      key_rows<kPaged>(params, tile, kv_head, params.v, params.v_stride_token,
                       params.v_stride_head, params.v_stride_block);

  float o[kRowTiles][kDimTiles][4];
  float row_max[kRowTiles][2];  // running max of the scaled scores (log2 domain)
  float row_sum[kRowTiles][2];  // running sum of this lane's probabilities of the row
#pragma unroll
  for (int mt = 0; mt < kRowTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDimTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_max[mt][r] = -CUDART_INF_F;
      row_sum[mt][r] = 0.f;
    }
  }

  if (tile.key_begin < tile.key_end) {
    const int first_block = tile.key_begin / kBlockN;
    const int last_block = (tile.key_end - 1) / kBlockN;
    const scalar_t* q_rows = params.q + int64_t(tile.q_begin + tile.first_row) * params.q_stride_token +
                             int64_t(tile.head) * params.q_stride_head;
    load_tile<kBlockM, kHeadDim>(q_smem, q_rows, params.q_stride_token, tile.rows, head_dim,
                                 vector_loads);
    if constexpr (kPaged) {
      locate_tile_keys<kBlockN>(located + (last_block % 2) * kBlockN, k_rows,
                                last_block * kBlockN, tile.len_k - last_block * kBlockN);
      __syncthreads();
    }
    load_key_tile<kBlockN, kHeadDim, kPaged>(k_smem, k_rows, located + (last_block % 2) * kBlockN,
                                             last_block * kBlockN,
                                             tile.len_k - last_block * kBlockN, head_dim,
                                             vector_loads);

    // Per-lane ldmatrix row addresses (see the top comment); fragments step from there.
    const uint32_t q_address =
        smem_address(q_smem + (warp * kRowsPerWarp + lane % 16) * kStride + (lane / 16) * 8);
    const uint32_t k_address =
        smem_address(k_smem + (lane % 8 + (lane / 16) * 8) * kStride + ((lane / 8) % 2) * 8);
    const uint32_t v_address =
        smem_address(v_smem + (lane % 8 + ((lane / 8) % 2) * 8) * kStride + (lane / 16) * 8);

    // Mask thresholds relative to this lane (see the masked branch), less the block's key0.
    const int64_t lane_diagonal = int64_t(tile.first_row) + warp * kRowsPerWarp + quad_row +
                                  tile.len_k - tile.len_q - 2 * quad_col;
    const int lane_keys = tile.len_k - 2 * quad_col;

    // Last block first: the diagonal (masked) block comes before the full ones.
    for (int block = last_block; block >= first_block; --block) {
      const int key0 = block * kBlockN;
      cp_async_wait_all();
      __syncthreads();  // K[block] (and Q) landed; every warp is done reading V[block + 1]
      load_key_tile<kBlockN, kHeadDim, kPaged>(v_smem, v_rows, located + (block % 2) * kBlockN,
                                               key0, tile.len_k - key0, head_dim, vector_loads);
      // Paged: locate the next K tile's keys (read after the next barrier); the buffer last
      // held tile block + 1's, whose V load every thread issued before the barrier above.
      if constexpr (kPaged) {
        if (block > first_block)
          locate_tile_keys<kBlockN>(located + ((block - 1) % 2) * kBlockN, k_rows,
                                    key0 - kBlockN, kBlockN);
      }

      float s[kRowTiles][kKeyTiles][4];
#pragma unroll
      for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        uint32_t a[kRowTiles][4];
#pragma unroll
        for (int mt = 0; mt < kRowTiles; ++mt)
          ldmatrix_x4(a[mt], q_address + (mt * 16 * kStride + ks * 16) * kBytes);
#pragma unroll
        for (int np = 0; np < kKeyTiles / 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, k_address + (np * 16 * kStride + ks * 16) * kBytes);
#pragma unroll
          for (int mt = 0; mt < kRowTiles; ++mt) {
            mma_m16n8k16<scalar_t>(s[mt][2 * np], a[mt], b[0], b[1]);
            mma_m16n8k16<scalar_t>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
          }
        }
      }

      cp_async_wait_all();
      __syncthreads();  // V[block] landed; every warp is done reading K[block]
      if (block > first_block)
        load_key_tile<kBlockN, kHeadDim, kPaged>(k_smem, k_rows,
                                                 located + ((block - 1) % 2) * kBlockN,
                                                 key0 - kBlockN, kBlockN, head_dim, vector_loads);

      // Scores to the log2 domain; in blocks some row does not fully see, keys it does not see
      // become -inf. The lane holds rows quad_row and quad_row + 8 of each m16 tile, and block
      // columns nt * 8 + 2 * quad_col + {0, 1} (keys key0 + column).
      const bool masked = key0 < tile.full_begin || key0 + kBlockN > tile.full_end;
#pragma unroll
      for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] *= scale_log2;
      if constexpr (kSoftcap) {
#pragma unroll
        for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
          for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              s[mt][nt][e] = soft_cap(s[mt][nt][e], params.softcap, params.softcap_inv_log2);
      }
      if (masked) {
        // Lane-relative thresholds, so each element compares compile-time offsets with three
        // registers: block column c of row offset o (query position lane_row + o) is key
        // key0 + 2 * quad_col + c, visible iff c - o <= causal_last (key <= diagonal),
        // c - o >= window_first (key >= diagonal - window_left) and c < keys_left (key < len_k).
        const int causal_last = causal ? clamp_threshold(lane_diagonal - key0) : kThresholdLimit;
        const int window_first = window_left >= 0
                                     ? clamp_threshold(lane_diagonal - window_left - key0)
                                     : -kThresholdLimit;
        const int keys_left = clamp_threshold(lane_keys - key0);
#pragma unroll
        for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
          for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int column = nt * 8 + (e % 2), row_offset = mt * 16 + (e / 2) * 8;
              if (column - row_offset > causal_last || column - row_offset < window_first ||
                  column >= keys_left)
                s[mt][nt][e] = -CUDART_INF_F;
            }
      }

      // Online softmax, one row at a time.
#pragma unroll
      for (int mt = 0; mt < kRowTiles; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float block_max = -CUDART_INF_F;
#pragma unroll
          for (int nt = 0; nt < kKeyTiles; ++nt)
            block_max = fmaxf(block_max, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
          block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 1));
          block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 2));
          const float new_max = fmaxf(row_max[mt][r], block_max);
          // A row that has seen no key yet keeps max -inf; subtracting 0 keeps its zeros NaN-free.
          const float base = new_max == -CUDART_INF_F ? 0.f : new_max;
          const float alpha = fast_exp2(row_max[mt][r] - base);
          row_max[mt][r] = new_max;
          float block_sum = 0.f;
#pragma unroll
          for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float prob = fast_exp2(s[mt][nt][2 * r + e] - base);
              s[mt][nt][2 * r + e] = prob;
              block_sum += prob;
            }
          row_sum[mt][r] = row_sum[mt][r] * alpha + block_sum;
#pragma unroll
          for (int dt = 0; dt < kDimTiles; ++dt) {
            o[mt][dt][2 * r] *= alpha;
            o[mt][dt][2 * r + 1] *= alpha;
          }
        }
      }

      // O += P V[block], 16 keys at a time.
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t p[kRowTiles][4];
#pragma unroll
        for (int mt = 0; mt < kRowTiles; ++mt) {
          p[mt][0] = pack_pair<scalar_t>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          p[mt][1] = pack_pair<scalar_t>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          p[mt][2] = pack_pair<scalar_t>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          p[mt][3] = pack_pair<scalar_t>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < kDimTiles / 2; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_address + (kk * 16 * kStride + dp * 16) * kBytes);
#pragma unroll
          for (int mt = 0; mt < kRowTiles; ++mt) {
            mma_m16n8k16<scalar_t>(o[mt][2 * dp], p[mt], b[0], b[1]);
            mma_m16n8k16<scalar_t>(o[mt][2 * dp + 1], p[mt], b[2], b[3]);
          }
        }
      }
    }
  }

  // Normalize and stage the warp's rows in its own Q rows (only this warp ever read them), then
  // store them as whole rows. Rows that saw no key have sum 0 and output 0.
#pragma unroll
  for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = row_sum[mt][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      scalar_t* staged =
          q_smem + (warp * kRowsPerWarp + mt * 16 + quad_row + 8 * r) * kStride + 2 * quad_col;
#pragma unroll
      for (int dt = 0; dt < kDimTiles; ++dt)
        *reinterpret_cast<uint32_t*>(staged + dt * 8) =
            pack_pair<scalar_t>(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
    }
  __syncwarp();

  constexpr int kChunks = kHeadDim / 8;
  const int64_t out_stride_token = params.out_stride_token;
  const int64_t out_stride_dim = params.out_stride_dim;
  scalar_t* out_rows = params.out + int64_t(tile.q_begin + tile.first_row) * out_stride_token +
                       int64_t(tile.head) * params.out_stride_head;
  for (int e = lane; e < kRowsPerWarp * kChunks; e += 32) {
    const int row = warp * kRowsPerWarp + e / kChunks, column = (e % kChunks) * 8;
    if (row >= tile.rows || column >= head_dim) continue;
    const scalar_t* from = q_smem + row * kStride + column;
    scalar_t* to = out_rows + row * out_stride_token;
    if (params.vector_stores) {
      *reinterpret_cast<uint4*>(to + column) = *reinterpret_cast<const uint4*>(from);
    } else {
      const int n = head_dim - column < 8 ? head_dim - column : 8;
      for (int d = 0; d < n; ++d) to[(column + d) * out_stride_dim] = from[d];
    }
  }
}

template <typename scalar_t, int kDimsPerLane, bool kSoftcap>
__global__ void __launch_bounds__(kAttentionThreads)
    attention_simt_kernel(const VarlenAttentionParams<scalar_t> params) {
  using namespace attention_detail;
  using Shape = SimtShape<kDimsPerLane>;
  constexpr int kRowsPerWarp = Shape::kRowsPerWarp;
  constexpr int kBlockM = Shape::kBlockM;
  constexpr int kBlockN = Shape::kBlockN;
  constexpr int kDims = Shape::kDims;
  constexpr int kKeyStride = Shape::kKeyStride;
  constexpr int kWarps = kAttentionThreads / 32;

  const QueryTile tile = locate_query_tile(params, kBlockM);
  if (tile.rows <= 0) return;

  float* q_smem = reinterpret_cast<float*>(dynamic_shared_memory());  // [kBlockM][kDims], pre-scaled
  float* k_smem = q_smem + kBlockM * kDims;                  // [kBlockN][kKeyStride]
  float* v_smem = k_smem + kBlockN * kKeyStride;             // [kBlockN][kDims]

  const int head_dim = params.head_dim;
  const bool causal = params.causal;
  const int window_left = params.window_left;
  const int64_t k_stride = params.k_stride_token, v_stride = params.v_stride_token;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kv_head = tile.head / params.group;

  float o[kRowsPerWarp][kDimsPerLane];
  float row_max[kRowsPerWarp], row_sum[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    row_max[r] = -CUDART_INF_F;
    row_sum[r] = 0.f;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) o[r][i] = 0.f;
  }

  if (tile.key_begin < tile.key_end) {
    const scalar_t* q_rows = params.q +
                             int64_t(tile.q_begin + tile.first_row) * params.q_stride_token +
                             int64_t(tile.head) * params.q_stride_head;
    // The scale (in the log2 domain) is folded into q once.
    for (int row = warp; row < kBlockM; row += kWarps)
      for (int d = lane; d < kDims; d += 32)
        q_smem[row * kDims + d] =
            row < tile.rows && d < head_dim
                ? to_float(q_rows[row * params.q_stride_token + d]) * params.scale_log2
                : 0.f;
    const scalar_t* k_rows = params.k + int64_t(tile.k_begin) * k_stride +
                             int64_t(kv_head) * params.k_stride_head;
    const scalar_t* v_rows = params.v + int64_t(tile.k_begin) * v_stride +
                             int64_t(kv_head) * params.v_stride_head;

    for (int key0 = tile.key_begin / kBlockN * kBlockN; key0 < tile.key_end; key0 += kBlockN) {
      __syncthreads();  // every warp is done with the previous block (and q is written)
      for (int c = warp; c < kBlockN; c += kWarps) {
        const bool inside = key0 + c < tile.len_k;
        const scalar_t* k_row = inside ? k_rows + int64_t(key0 + c) * k_stride : nullptr;
        const scalar_t* v_row = inside ? v_rows + int64_t(key0 + c) * v_stride : nullptr;
        for (int d = lane; d < kDims; d += 32) {
          const bool load = inside && d < head_dim;
          k_smem[c * kKeyStride + d] = load ? to_float(k_row[d]) : 0.f;
          v_smem[c * kDims + d] = load ? to_float(v_row[d]) : 0.f;
        }
      }
      __syncthreads();

      // Lane `lane` scores key key0 + lane against the warp's rows.
      float s[kRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) s[r] = 0.f;
      const float* k_row = k_smem + lane * kKeyStride;
#pragma unroll 4
      for (int d = 0; d < kDims; d += 4) {
        const float4 kv = *reinterpret_cast<const float4*>(k_row + d);
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          const float4 qv =
              *reinterpret_cast<const float4*>(q_smem + (warp * kRowsPerWarp + r) * kDims + d);
          s[r] = fmaf(qv.x, kv.x, fmaf(qv.y, kv.y, fmaf(qv.z, kv.z, fmaf(qv.w, kv.w, s[r]))));
        }
      }

      const int key = key0 + lane;
      float prob[kRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const int row = tile.first_row + warp * kRowsPerWarp + r;
        const KeySpan span = visible_keys(row, tile.len_q, tile.len_k, causal, window_left);
        if constexpr (kSoftcap) s[r] = soft_cap(s[r], params.softcap, params.softcap_inv_log2);
        const float score = key >= span.begin && key < span.end ? s[r] : -CUDART_INF_F;
        float block_max = score;
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2)
          block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, offset));
        const float new_max = fmaxf(row_max[r], block_max);
        const float base = new_max == -CUDART_INF_F ? 0.f : new_max;
        const float alpha = fast_exp2(row_max[r] - base);
        row_max[r] = new_max;
        prob[r] = fast_exp2(score - base);
        row_sum[r] = row_sum[r] * alpha + prob[r];
#pragma unroll
        for (int i = 0; i < kDimsPerLane; ++i) o[r][i] *= alpha;
      }

#pragma unroll 4
      for (int c = 0; c < kBlockN; ++c) {
        float v[kDimsPerLane];
#pragma unroll
        for (int i = 0; i < kDimsPerLane; ++i) v[i] = v_smem[c * kDims + lane + 32 * i];
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          const float p = __shfl_sync(0xffffffffu, prob[r], c);
#pragma unroll
          for (int i = 0; i < kDimsPerLane; ++i) o[r][i] = fmaf(p, v[i], o[r][i]);
        }
      }
    }
  }

  const int64_t out_stride_dim = params.out_stride_dim;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    float sum = row_sum[r];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
      sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;  // a row that saw no key outputs 0
    const int row = warp * kRowsPerWarp + r;
    if (row >= tile.rows) continue;
    scalar_t* out_row = params.out +
                        int64_t(tile.q_begin + tile.first_row + row) * params.out_stride_token +
                        int64_t(tile.head) * params.out_stride_head;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < head_dim) out_row[d * out_stride_dim] = from_float<scalar_t>(o[r][i] * inv);
    }
  }
}

}  // namespace cuda
}  // namespace fastllm

#ifdef FASTLLM_KERNEL_COMPILE_CHECK
// Every configuration attention_cuda.cu and paged_attention_cuda.cu launch.
#define FASTLLM_INSTANTIATE_TENSOR_CORE(T, D)                                               \
  template __global__ void fastllm::cuda::attention_tensor_core_kernel<T, D, false, false>( \
      const fastllm::cuda::VarlenAttentionParams<T>);                                       \
  template __global__ void fastllm::cuda::attention_tensor_core_kernel<T, D, true, false>(  \
      const fastllm::cuda::VarlenAttentionParams<T>);                                       \
  template __global__ void fastllm::cuda::attention_tensor_core_kernel<T, D, false, true>(  \
      const fastllm::cuda::VarlenAttentionParams<T>);                                       \
  template __global__ void fastllm::cuda::attention_tensor_core_kernel<T, D, true, true>(   \
      const fastllm::cuda::VarlenAttentionParams<T>);
#define FASTLLM_INSTANTIATE_SIMT(T, N)                                        \
  template __global__ void fastllm::cuda::attention_simt_kernel<T, N, false>( \
      const fastllm::cuda::VarlenAttentionParams<T>);                         \
  template __global__ void fastllm::cuda::attention_simt_kernel<T, N, true>(  \
      const fastllm::cuda::VarlenAttentionParams<T>);
#define FASTLLM_INSTANTIATE_TENSOR_CORE_DIMS(T) \
  FASTLLM_INSTANTIATE_TENSOR_CORE(T, 64)        \
  FASTLLM_INSTANTIATE_TENSOR_CORE(T, 80)        \
  FASTLLM_INSTANTIATE_TENSOR_CORE(T, 96)        \
  FASTLLM_INSTANTIATE_TENSOR_CORE(T, 128)       \
  FASTLLM_INSTANTIATE_TENSOR_CORE(T, 256)
#define FASTLLM_INSTANTIATE_SIMT_DIMS(T) \
  FASTLLM_INSTANTIATE_SIMT(T, 1)         \
  FASTLLM_INSTANTIATE_SIMT(T, 2)         \
  FASTLLM_INSTANTIATE_SIMT(T, 3)         \
  FASTLLM_INSTANTIATE_SIMT(T, 4)         \
  FASTLLM_INSTANTIATE_SIMT(T, 6)         \
  FASTLLM_INSTANTIATE_SIMT(T, 8)
FASTLLM_INSTANTIATE_TENSOR_CORE_DIMS(__half)
FASTLLM_INSTANTIATE_TENSOR_CORE_DIMS(__nv_bfloat16)
FASTLLM_INSTANTIATE_SIMT_DIMS(float)
FASTLLM_INSTANTIATE_SIMT_DIMS(__half)
FASTLLM_INSTANTIATE_SIMT_DIMS(__nv_bfloat16)
#undef FASTLLM_INSTANTIATE_SIMT_DIMS
#undef FASTLLM_INSTANTIATE_TENSOR_CORE_DIMS
#undef FASTLLM_INSTANTIATE_SIMT
#undef FASTLLM_INSTANTIATE_TENSOR_CORE
#endif
