// Paged attention on CUDA (decode and chunked prefill over a paged KV cache), free of torch
// headers (nvcc compiles it alone in the tests). Same semantics as the paged path of
// attention_cpu.cpp: key j of sequence b is slot j % block_size of block
// block_tables[b][j / block_size]; seq_lens[b] keys, the sequence's len_q queries being the last
// len_q of them; bottom-right causal mask, optional sliding window, GQA by index, float32 softmax
// and accumulation, queries that see no key give exactly 0; with a cos|sin table the cached keys
// are pre-RoPE and key j is rotated by position j as it is read (the queries are not rotated).
// Soft-cap (Gemma 2): the kSoftcap instantiations turn each scaled score s into
// softcap * tanh(s / softcap) as the softmax reads it; kSoftcap = false is the kernel without.
//
// Work split. One thread block of 4 warps per (row tile, kv head, key split). The rows of a
// (sequence, kv head) are its query positions times the GQA group's heads, position-major: row
// R is head kv_head * group + R % group of query R / group. A tile of kRows rows shares every
// K/V row it loads: decode (kRows = 8) reads each K/V element once for the whole group, chunked
// prefill (kRows = 8192 / head_dim; float32 and pre-RoPE caches, 16-bit ones run the tensor-core
// varlen kernel through the block tables) reuses each K/V tile for 64-128 rows. The keys some row of
// the tile sees, [key_lo, key_hi), are cut into splits of a fixed size per sequence, computed
// from the sequence's own key count and the host's split target (batch, heads, SM count), never
// from the block table's width: for the same batch, a table padded wider (CUDA-graph decode)
// gives the same bits.
// Each split streams its keys in tiles of kKeys through a kStages-deep cp.async pipeline.
//
// Per key tile:
//   wait, barrier | [rotate K in shared memory, barrier] | S = Q K^T partials, barrier |
//   online softmax per row, barrier | O += P V, barrier
// Shared memory (dynamic, 60-86 KB: every configuration fits the 99 KB of sm_86 / sm_89):
//   K/V stages: kStages x [K tile, V tile], rows kHeadDim + 16 bytes apart so lanes reading 8
//     consecutive rows hit 8 distinct bank groups; head_dim padding and missing keys are zeros
//   q^T [kHeadDim][kRows + 4] float32, scaled by scale * log2(e) (probabilities are exp2)
//   scores [kScoreDimSplits][kKeys][kRows + 4] float32; the softmax overwrites plane 0 with P
//   per row: the softmax rescale factor, final max and sum, output token and head
// After the key loop the O partials of the warps are summed through the (then dead) K/V, q^T and
// score space, and the rows are written out coalesced.
//
// Thread roles (kPagedThreads = 128):
//   scores: thread = (dim split, row group, key group); decode splits head_dim over threads
//     (all 8 rows, one key), prefill gives each thread a 2-8 row x 4 key block over all dims
//   softmax: kThreads / kRows lanes per row, reduced with __shfl_xor_sync
//   P V: thread = (key split, row group, dim group) with an 8 row x kOutDims float32 accumulator;
//     decode splits the keys over the 4 warps (partials summed at the end)
// Decode rows past the tile's valid rows are skipped in groups of 4, so GQA groups of 1-4 heads
// do half the arithmetic of 8.
//
// Key splits. With split_target > 1 every block of the grid's split dimension writes float32
// partials (unnormalized O, running max in the log2 domain, sum) of its rows, an empty split
// writing max = -inf; paged_attention_combine_kernel merges them. With split_target == 1 a
// block sees all its keys and writes the normalized output directly.
//
// Bad index values (unchecked under graph capture or trusted_inputs()) never cause an out of
// bounds access: cu_seqlens are clamped to [0, total_q], seq_lens below 0 count as 0, block ids
// outside [0, num_blocks) and table columns past max_blocks read as zero rows, positions past the
// rotary table are left unrotated.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "common/cuda_ptx.cuh"
#include "common/cuda_types.cuh"

namespace fastllm {
namespace cuda {

constexpr int kPagedThreads = 128;  // 4 warps, in the attention kernel
constexpr int kPagedDecodeRows = 8;  // rows per block of the decode shape: GQA groups up to 8
constexpr int kPagedMaxHeadDim = 256;
constexpr int kPagedMaxSplits = 128;
constexpr int kPagedCombineWarps = 4;  // one (token, head) per warp

// Rows per block of the prefill shape for a padded head_dim: q^T stays at 32 KB.
constexpr int paged_prefill_rows(int head_dim) { return 8192 / head_dim; }

template <typename scalar_t>
struct PagedAttentionParams {
  const scalar_t* q;  // [total_q, n_heads, head_dim], unit head_dim stride
  int64_t q_stride_token, q_stride_head;
  const scalar_t* k_cache;  // [num_blocks, block_size, n_kv_heads, head_dim], any strides
  const scalar_t* v_cache;
  int64_t k_stride_block, k_stride_slot, k_stride_head, k_stride_dim;
  int64_t v_stride_block, v_stride_slot, v_stride_head, v_stride_dim;
  bool k_vector_loads;  // unit dim stride, 16-byte aligned rows: 16-byte cp.async copies
  bool v_vector_loads;
  const int32_t* block_tables;  // [batch, max_blocks], any strides
  int64_t table_stride_seq, table_stride_block;
  int max_blocks;
  int64_t num_blocks;
  int block_size;
  const int32_t* seq_lens;      // [batch]: keys of each sequence, its queries included
  const int32_t* cu_seqlens_q;  // [batch + 1]
  const float* rotary_cos_sin;  // [rotary_max_position, rotary_dim], contiguous; null: none
  int rotary_dim;
  int64_t rotary_max_position;
  bool rotary_is_neox;
  scalar_t* out;          // [total_q, n_heads, head_dim], contiguous: written when not split
  float* partial_out;     // [splits, total_q, n_heads, head_dim], or null (no split)
  float* partial_stats;   // [splits, total_q, n_heads, 2]: max (log2 domain), sum
  int total_q, batch, n_heads, group, head_dim;  // group = n_heads / n_kv_heads
  int row_tiles;     // row tiles per (sequence, kv head) in the grid
  int split_target;  // a sequence's keys are cut into at most this many splits
  bool causal;
  int64_t window_left;  // -1: no window
  float scale_log2;     // softmax scale * log2(e)
  float softcap;           // > 0 in kSoftcap kernels: the soft-cap
  float softcap_inv_log2;  // 1 / (softcap * log2(e)): log2-domain score -> score / softcap
};

constexpr int paged_clamp(int value, int low, int high) {
  return value < low ? low : value > high ? high : value;
}
constexpr int paged_max(int a, int b) { return a > b ? a : b; }

// Tile shape and thread roles of one configuration; the host reads kSmemBytes.
template <typename scalar_t, int kHeadDim, int kRows>
struct PagedShape {
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256,
                "head_dim is padded to 64, 128 or 256");
  static constexpr bool kDecode = kRows == kPagedDecodeRows;
  static_assert(kDecode || kRows == paged_prefill_rows(kHeadDim), "decode or prefill rows");
  static constexpr int kThreads = kPagedThreads;
  static constexpr int kBytes = sizeof(scalar_t);
  static constexpr int kVec = 16 / kBytes;  // elements per 16-byte copy
  // Keys per tile: about 8 KB of K (and of V) per stage.
  static constexpr int kKeys = paged_clamp(8192 / (kHeadDim * kBytes), 16, kDecode ? 64 : 32);
  // A split covers at least this many keys (whole tiles). Decode splits only where sequences
  // are too few to fill the GPU, so they may be short: two tiles keep a block's copies
  // pipelined, and more blocks stream one sequence's keys at once. Prefill tiles are
  // arithmetic-bound: fewer keys would spend more on partials and the merge than they save.
  static constexpr int kMinKeysPerSplit = kDecode ? 2 * kKeys : 256;
  static constexpr int kKeyStride = kHeadDim + kVec;  // elements: 16 bytes of padding per row
  static constexpr int kStageElems = 2 * kKeys * kKeyStride;  // K tile, then V tile
  // Decode streams memory: as many stages as ~54 KB allow (2 or 3 blocks per SM on A100 and
  // H100). Prefill is bound by arithmetic: double buffering.
  static constexpr int kStages =
      kDecode ? paged_clamp(55296 / (kStageElems * kBytes), 2, 4) : 2;
  static constexpr int kRowStride = kRows + 4;  // floats, in q^T and scores: 16-byte rows

  // Scores: thread = (dim split, row group, key group), key group fastest.
  static constexpr int kScoreKeysPerThread = kDecode ? 1 : 4;
  static constexpr int kScoreKeyGroups = kKeys / kScoreKeysPerThread;
  static constexpr int kScoreRowGroups = kDecode ? 1 : kThreads / kScoreKeyGroups;
  static constexpr int kScoreDimSplits = kThreads / (kScoreKeyGroups * kScoreRowGroups);
  static constexpr int kScoreRows = kRows / kScoreRowGroups;  // rows per thread
  static constexpr int kScoreRowVec = kScoreRows < 4 ? kScoreRows : 4;
  static constexpr int kScoreDims = kHeadDim / kScoreDimSplits;  // dims per thread
  static_assert(kScoreKeyGroups * kScoreRowGroups * kScoreDimSplits == kThreads, "score roles");
  static_assert(kScoreRows % kScoreRowVec == 0 && kScoreDims % kVec == 0, "score blocks");

  // Softmax: kSoftmaxLanes consecutive lanes per row.
  static constexpr int kSoftmaxLanes = kThreads / kRows;
  static constexpr int kSoftmaxKeys = kKeys / kSoftmaxLanes;
  static_assert(kSoftmaxLanes * kRows == kThreads && kSoftmaxLanes <= 32, "softmax roles");
  static_assert(kSoftmaxKeys * kSoftmaxLanes == kKeys, "softmax keys");

  // P V: thread = (key split, row group, dim group), dim group fastest; 8 rows per thread.
  static constexpr int kOutRows = 8;
  static constexpr int kOutKeySplits = kDecode ? 4 : 1;
  static constexpr int kOutRowGroups = kRows / kOutRows;
  static constexpr int kOutDimGroups = kThreads / (kOutKeySplits * kOutRowGroups);
  static constexpr int kOutDims = kHeadDim / kOutDimGroups;  // dims per thread
  static_assert(kOutDimGroups * kOutDims == kHeadDim && kKeys % kOutKeySplits == 0, "P V roles");
  static_assert(kOutDims * kBytes % 4 == 0, "V reads are whole 32-bit words");

  // The cp.async copies of a K or V tile: whole rounds of all threads.
  static constexpr int kChunks = kHeadDim / kVec;
  static constexpr int kCopyRounds = kKeys * kChunks / kThreads;
  static_assert(kCopyRounds * kThreads == kKeys * kChunks, "copy rounds");

  // Shared memory, in bytes. The final reduction reuses the K/V, q^T and score space.
  static constexpr int kKvBytes = kStages * kStageElems * kBytes;
  static constexpr int kQBytes = kHeadDim * kRowStride * 4;
  static constexpr int kScoreBytes = kScoreDimSplits * kKeys * kRowStride * 4;
  static constexpr int kReduceBytes = kOutKeySplits * kRows * kHeadDim * 4;
  static constexpr int kRowInfoOffset =
      paged_max(kKvBytes + kQBytes + kScoreBytes, kReduceBytes);
  // Per row: softmax rescale factor, final max, final sum (float), output token, head (int).
  static constexpr int kSmemBytes = kRowInfoOffset + kRows * 5 * 4;
  static_assert(kKvBytes % 16 == 0 && kQBytes % 16 == 0 && kRowInfoOffset % 16 == 0,
                "16-byte aligned sections");
};

namespace paged_detail {

// Unpacks one 32-bit word of storage elements into float32 (lower address first).
template <typename scalar_t>
struct StorageWord;
template <>
struct StorageWord<float> {
  static constexpr int kElems = 1;
  __device__ __forceinline__ static void unpack(uint32_t word, float* out) {
    out[0] = __uint_as_float(word);
  }
};
template <>
struct StorageWord<__nv_bfloat16> {
  static constexpr int kElems = 2;
  __device__ __forceinline__ static void unpack(uint32_t word, float* out) {
    out[0] = __uint_as_float(word << 16);  // a bfloat16 is the top half of a float32
    out[1] = __uint_as_float(word & 0xffff0000u);
  }
};
template <>
struct StorageWord<__half> {
  static constexpr int kElems = 2;
  __device__ __forceinline__ static void unpack(uint32_t word, float* out) {
    out[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(word & 0xffffu)));
    out[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(word >> 16)));
  }
};

// n elements of shared memory as float32, read in 16-, 8- or 4-byte words; src is aligned to
// the read (min(16, n * sizeof) bytes).
template <int kN, typename scalar_t>
__device__ __forceinline__ void load_as_float(const scalar_t* src, float* out) {
  constexpr int kBytes = kN * int(sizeof(scalar_t));
  constexpr int kPer = StorageWord<scalar_t>::kElems;
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      const uint4 w = reinterpret_cast<const uint4*>(src)[i];
      StorageWord<scalar_t>::unpack(w.x, out + (4 * i + 0) * kPer);
      StorageWord<scalar_t>::unpack(w.y, out + (4 * i + 1) * kPer);
      StorageWord<scalar_t>::unpack(w.z, out + (4 * i + 2) * kPer);
      StorageWord<scalar_t>::unpack(w.w, out + (4 * i + 3) * kPer);
    }
  } else if constexpr (kBytes == 8) {
    const uint2 w = *reinterpret_cast<const uint2*>(src);
    StorageWord<scalar_t>::unpack(w.x, out);
    StorageWord<scalar_t>::unpack(w.y, out + kPer);
  } else {
    static_assert(kBytes == 4, "reads of 4, 8 or a multiple of 16 bytes");
    StorageWord<scalar_t>::unpack(*reinterpret_cast<const uint32_t*>(src), out);
  }
}

// kN consecutive float32 of shared memory, src aligned to min(16, 4 kN) bytes.
template <int kN>
__device__ __forceinline__ void load_floats(const float* src, float* out) {
  if constexpr (kN % 4 == 0) {
#pragma unroll
    for (int i = 0; i < kN / 4; ++i) {
      const float4 v = reinterpret_cast<const float4*>(src)[i];
      out[4 * i] = v.x;
      out[4 * i + 1] = v.y;
      out[4 * i + 2] = v.z;
      out[4 * i + 3] = v.w;
    }
  } else {
    static_assert(kN == 2, "reads of 2 or a multiple of 4 floats");
    const float2 v = *reinterpret_cast<const float2*>(src);
    out[0] = v.x;
    out[1] = v.y;
  }
}

template <int kN>
__device__ __forceinline__ void store_floats(float* dst, const float* in) {
  if constexpr (kN % 4 == 0) {
#pragma unroll
    for (int i = 0; i < kN / 4; ++i)
      reinterpret_cast<float4*>(dst)[i] =
          make_float4(in[4 * i], in[4 * i + 1], in[4 * i + 2], in[4 * i + 3]);
  } else {
    static_assert(kN == 2, "writes of 2 or a multiple of 4 floats");
    *reinterpret_cast<float2*>(dst) = make_float2(in[0], in[1]);
  }
}

// Max / sum over groups of kLanes consecutive lanes (every lane of the warp takes part).
template <int kLanes>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

template <int kLanes>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2)
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Keys [begin, end) that query position `position` of a sequence sees: causal keys
// j <= position + len_k - len_q (bottom-right aligned), with a window also
// j >= position + len_k - len_q - window_left. 0 <= begin <= end <= len_k.
struct KeyRange {
  int begin, end;
};

__device__ __forceinline__ KeyRange visible_keys(int64_t position, int len_q, int len_k,
                                                 bool causal, int64_t window_left) {
  const int64_t diagonal = position + len_k - len_q;
  int64_t end = causal && diagonal + 1 < len_k ? diagonal + 1 : len_k;
  end = end < 0 ? 0 : end;
  int64_t begin = window_left >= 0 ? diagonal - window_left : 0;
  begin = begin < 0 ? 0 : begin > end ? end : begin;
  return {int(begin), int(end)};
}

__device__ __forceinline__ int clamp_offset(int value, int low, int high) {
  return value < low ? low : value > high ? high : value;
}

// Copies kVec elements [d0, d0 + kVec) of one K or V row into shared memory: 16 bytes by
// cp.async, or element by element for other layouts. Dims past head_dim and absent rows become
// zeros.
template <int kVec, typename scalar_t>
__device__ __forceinline__ void copy_row_chunk(scalar_t* dst, const scalar_t* cache,
                                               int64_t row_offset, int64_t stride_dim,
                                               bool vector_loads, bool present, int d0,
                                               int head_dim) {
  if (vector_loads) {  // head_dim % kVec == 0: a chunk is all inside or all outside head_dim
    const bool inside = present && d0 < head_dim;
    cp_async_16(smem_address(dst), inside ? cache + row_offset + d0 : cache, inside);
  } else {
    const scalar_t zero = from_float<scalar_t>(0.f);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int d = d0 + i;
      dst[i] = present && d < head_dim ? cache[row_offset + d * stride_dim] : zero;
    }
  }
}

// Starts loading keys [tile_start, tile_start + tile_keys) of the sequence (table_row is its
// block table row) into a K and a V tile; the rest of the tiles becomes zeros. Copies are
// chunk-fastest, so a warp reads whole rows (coalesced).
template <typename Shape, typename scalar_t>
__device__ __forceinline__ void load_key_tile(const PagedAttentionParams<scalar_t>& p,
                                              const int32_t* table_row, int kv_head,
                                              int tile_start, int tile_keys, scalar_t* k_tile,
                                              scalar_t* v_tile) {
  constexpr int kChunks = Shape::kChunks;
#pragma unroll
  for (int round = 0; round < Shape::kCopyRounds; ++round) {
    const int e = int(threadIdx.x) + round * Shape::kThreads;
    const int c = e / kChunks, d0 = (e % kChunks) * Shape::kVec;
    bool present = false;
    int64_t block = 0;
    int slot = 0;
    if (c < tile_keys) {
      const int key = tile_start + c;
      const int column = key / p.block_size;
      if (column < p.max_blocks) {
        const int32_t id = table_row[column * p.table_stride_block];
        if (id >= 0 && id < p.num_blocks) {
          present = true;
          block = id;
          slot = key - column * p.block_size;
        }
      }
    }
    const int64_t k_row =
        block * p.k_stride_block + slot * p.k_stride_slot + kv_head * p.k_stride_head;
    const int64_t v_row =
        block * p.v_stride_block + slot * p.v_stride_slot + kv_head * p.v_stride_head;
    copy_row_chunk<Shape::kVec>(k_tile + c * Shape::kKeyStride + d0, p.k_cache, k_row,
                                p.k_stride_dim, p.k_vector_loads, present, d0, p.head_dim);
    copy_row_chunk<Shape::kVec>(v_tile + c * Shape::kKeyStride + d0, p.v_cache, v_row,
                                p.v_stride_dim, p.v_vector_loads, present, d0, p.head_dim);
  }
}

// Pre-RoPE caches: rotates the landed K tile in place, key c by its position tile_start + c
// (neox pairs channel i with i + rotary_dim / 2, interleaved 2i with 2i + 1; channels past
// rotary_dim stay). In float32, rounded back to the storage type.
template <typename Shape, typename scalar_t>
__device__ __forceinline__ void rotate_key_tile(const PagedAttentionParams<scalar_t>& p,
                                                int tile_start, int tile_keys,
                                                scalar_t* k_tile) {
  const int half = p.rotary_dim / 2;
  for (int e = threadIdx.x; e < tile_keys * half; e += Shape::kThreads) {
    const int c = e / half, i = e - c * half;
    const int64_t position = int64_t(tile_start) + c;
    if (position >= p.rotary_max_position) continue;  // rejected on the host unless capturing
    const float* cos_sin = p.rotary_cos_sin + position * p.rotary_dim;
    const float cos = cos_sin[i], sin = cos_sin[half + i];
    const int d1 = p.rotary_is_neox ? i : 2 * i;
    const int d2 = p.rotary_is_neox ? i + half : 2 * i + 1;
    scalar_t* key = k_tile + c * Shape::kKeyStride;
    const float x1 = to_float(key[d1]), x2 = to_float(key[d2]);
    key[d1] = from_float<scalar_t>(x1 * cos - x2 * sin);
    key[d2] = from_float<scalar_t>(x2 * cos + x1 * sin);
  }
}

}  // namespace paged_detail

// One block per (row tile, kv head, key split); see the top comment. Grid: x = (reversed row
// tile) * batch + sequence (the last rows, which see the most keys, start first), y = kv head,
// z = split. kHeadDim is head_dim padded to 64 / 128 / 256, kRows the rows per block, kSoftcap
// whether scores are soft-capped.
template <typename scalar_t, int kHeadDim, int kRows, bool kSoftcap>
__global__ void __launch_bounds__(kPagedThreads)
    paged_attention_kernel(const PagedAttentionParams<scalar_t> p) {
  using namespace paged_detail;
  using Shape = PagedShape<scalar_t, kHeadDim, kRows>;
  constexpr int kThreads = Shape::kThreads;
  constexpr int kKeys = Shape::kKeys;
  constexpr int kKeyStride = Shape::kKeyStride;
  constexpr int kStages = Shape::kStages;
  constexpr int kRowStride = Shape::kRowStride;
  constexpr int kVec = Shape::kVec;
  const float kNegInf = -CUDART_INF_F;
  const int tid = threadIdx.x;

  // Which rows, kv head and keys this block has.
  const int seq = int(blockIdx.x) % p.batch;
  const int row_tile = p.row_tiles - 1 - int(blockIdx.x) / p.batch;
  const int kv_head = blockIdx.y;
  const int split = blockIdx.z;
  const int group = p.group;
  const int q_begin = clamp_offset(p.cu_seqlens_q[seq], 0, p.total_q);
  const int len_q = clamp_offset(p.cu_seqlens_q[seq + 1], q_begin, p.total_q) - q_begin;
  const int len_k = p.seq_lens[seq] < 0 ? 0 : p.seq_lens[seq];
  const int64_t seq_rows = int64_t(len_q) * group;
  const int64_t row0 = int64_t(row_tile) * kRows;
  if (row0 >= seq_rows) return;  // the whole block: past the end of its sequence
  const int n_rows = seq_rows - row0 < kRows ? int(seq_rows - row0) : kRows;
  // Rows' key ranges only grow with the row: the tile sees [first row's begin, last row's end).
  const int key_lo = visible_keys(row0 / group, len_q, len_k, p.causal, p.window_left).begin;
  const int key_hi =
      visible_keys((row0 + n_rows - 1) / group, len_q, len_k, p.causal, p.window_left).end;
  // Splits of a fixed size per sequence, whole tiles each (the last one excepted).
  const int64_t span = key_hi - key_lo;
  int64_t per_split = (span + p.split_target - 1) / p.split_target;
  per_split = (per_split + kKeys - 1) / kKeys * kKeys;
  per_split = per_split < Shape::kMinKeysPerSplit ? Shape::kMinKeysPerSplit : per_split;
  const int64_t first_key = key_lo + split * per_split;
  const int split_begin = first_key < key_hi ? int(first_key) : key_hi;
  const int split_end = first_key + per_split < key_hi ? int(first_key + per_split) : key_hi;
  const int n_tiles = (split_end - split_begin + kKeys - 1) / kKeys;
  const bool direct = p.partial_out == nullptr;
  const int64_t split_rows = int64_t(split) * p.total_q * p.n_heads;  // partials before ours

  if (n_tiles == 0 && !direct) {  // a split past the tile's keys: an empty partial
    if (tid < n_rows) {
      const int64_t row = row0 + tid;
      const int64_t out_row =
          int64_t(q_begin + row / group) * p.n_heads + kv_head * group + row % group;
      p.partial_stats[(split_rows + out_row) * 2] = kNegInf;
      p.partial_stats[(split_rows + out_row) * 2 + 1] = 0.f;
    }
    return;
  }

  unsigned char* smem = dynamic_shared_memory();
  scalar_t* kv_stages = reinterpret_cast<scalar_t*>(smem);
  float* q_t = reinterpret_cast<float*>(smem + Shape::kKvBytes);
  float* scores = reinterpret_cast<float*>(smem + Shape::kKvBytes + Shape::kQBytes);
  float* reduce = reinterpret_cast<float*>(smem);  // after the key loop only
  float* row_scale = reinterpret_cast<float*>(smem + Shape::kRowInfoOffset);
  float* row_max = row_scale + kRows;
  float* row_sum = row_max + kRows;
  int* row_token = reinterpret_cast<int*>(row_sum + kRows);
  int* row_head = row_token + kRows;

  const int32_t* table_row = p.block_tables + seq * p.table_stride_seq;
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_tiles) {
      const int start = split_begin + s * kKeys;
      scalar_t* k_tile = kv_stages + s * Shape::kStageElems;
      load_key_tile<Shape>(p, table_row, kv_head, start,
                           split_end - start < kKeys ? split_end - start : kKeys, k_tile,
                           k_tile + kKeys * kKeyStride);
    }
    cp_async_commit();  // possibly empty: one group per tile keeps the wait count fixed
  }

  if (tid < kRows) {
    const int64_t row = row0 + tid;
    row_token[tid] = tid < n_rows ? q_begin + int(row / group) : -1;
    row_head[tid] = kv_head * group + int(row % group);
  }
  __syncthreads();
  // q^T, scaled so that probabilities are exp2(score - max); zeros past head_dim and n_rows.
  for (int e = tid; e < kRows * kHeadDim; e += kThreads) {
    const int r = e / kHeadDim, d = e % kHeadDim;
    float value = 0.f;
    if (r < n_rows && d < p.head_dim)
      value = to_float(p.q[int64_t(row_token[r]) * p.q_stride_token +
                           int64_t(row_head[r]) * p.q_stride_head + d]) *
              p.scale_log2;
    q_t[d * kRowStride + r] = value;
  }

  // Softmax role: lanes soft_part of row soft_row keep its running max and sum.
  const int soft_row = tid / Shape::kSoftmaxLanes, soft_part = tid % Shape::kSoftmaxLanes;
  KeyRange soft_keys{0, 0};  // rows past n_rows see nothing
  if (soft_row < n_rows)
    soft_keys = visible_keys((row0 + soft_row) / group, len_q, len_k, p.causal, p.window_left);
  float run_max = kNegInf, run_sum = 0.f;

  // Score role.
  constexpr int kScoreRows = Shape::kScoreRows;
  constexpr int kScoreKeysPerThread = Shape::kScoreKeysPerThread;
  constexpr int kScoreRowVec = Shape::kScoreRowVec;
  const int score_key = tid % Shape::kScoreKeyGroups;
  const int score_r0 = (tid / Shape::kScoreKeyGroups) % Shape::kScoreRowGroups * kScoreRows;
  const int score_split = tid / (Shape::kScoreKeyGroups * Shape::kScoreRowGroups);
  const int score_d0 = score_split * Shape::kScoreDims;

  // P V role and its accumulator.
  constexpr int kOutRows = Shape::kOutRows;
  constexpr int kOutDims = Shape::kOutDims;
  const int out_d0 = tid % Shape::kOutDimGroups * kOutDims;
  const int out_r0 = (tid / Shape::kOutDimGroups) % Shape::kOutRowGroups * kOutRows;
  const int out_key_split = tid / (Shape::kOutDimGroups * Shape::kOutRowGroups);
  float acc[kOutRows][kOutDims];
#pragma unroll
  for (int i = 0; i < kOutRows; ++i)
#pragma unroll
    for (int j = 0; j < kOutDims; ++j) acc[i][j] = 0.f;

  for (int t = 0; t < n_tiles; ++t) {
    const int next = t + kStages - 1;
    if (next < n_tiles) {
      const int start = split_begin + next * kKeys;
      scalar_t* k_next = kv_stages + (next % kStages) * Shape::kStageElems;
      load_key_tile<Shape>(p, table_row, kv_head, start,
                           split_end - start < kKeys ? split_end - start : kKeys, k_next,
                           k_next + kKeys * kKeyStride);
    }
    cp_async_commit();
    cp_async_wait<kStages - 1>();  // this thread's copies of tile t have landed
    __syncthreads();               // everyone's have (and q^T on the first tile)

    const int tile_start = split_begin + t * kKeys;
    const int tile_keys = split_end - tile_start < kKeys ? split_end - tile_start : kKeys;
    scalar_t* k_tile = kv_stages + (t % kStages) * Shape::kStageElems;
    const scalar_t* v_tile = k_tile + kKeys * kKeyStride;
    if (p.rotary_dim > 0) {
      rotate_key_tile<Shape>(p, tile_start, tile_keys, k_tile);
      __syncthreads();
    }

    // S partials: this thread's rows x keys over its dims.
    {
      float s[kScoreRows][kScoreKeysPerThread];
#pragma unroll
      for (int i = 0; i < kScoreRows; ++i)
#pragma unroll
        for (int j = 0; j < kScoreKeysPerThread; ++j) s[i][j] = 0.f;
      const scalar_t* k_base = k_tile + score_d0;
      const float* q_base = q_t + score_d0 * kRowStride + score_r0;
#pragma unroll 2
      for (int d0 = 0; d0 < Shape::kScoreDims; d0 += kVec) {
        float k_vals[kScoreKeysPerThread][kVec];
#pragma unroll
        for (int j = 0; j < kScoreKeysPerThread; ++j)
          load_as_float<kVec>(
              k_base + (score_key + j * Shape::kScoreKeyGroups) * kKeyStride + d0, k_vals[j]);
#pragma unroll
        for (int dd = 0; dd < kVec; ++dd) {
          const float* q_col = q_base + (d0 + dd) * kRowStride;
#pragma unroll
          for (int g = 0; g < kScoreRows; g += kScoreRowVec) {
            if (score_r0 + g >= n_rows) continue;  // decode: rows past the group
            float q_vals[kScoreRowVec];
            load_floats<kScoreRowVec>(q_col + g, q_vals);
#pragma unroll
            for (int i = 0; i < kScoreRowVec; ++i)
#pragma unroll
              for (int j = 0; j < kScoreKeysPerThread; ++j)
                s[g + i][j] = fmaf(q_vals[i], k_vals[j][dd], s[g + i][j]);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kScoreKeysPerThread; ++j) {
        float column[kScoreRows];
#pragma unroll
        for (int i = 0; i < kScoreRows; ++i) column[i] = s[i][j];
        const int c = score_key + j * Shape::kScoreKeyGroups;
        store_floats<kScoreRows>(
            scores + (score_split * kKeys + c) * kRowStride + score_r0, column);
      }
    }
    __syncthreads();

    // Online softmax of the tile's scores, row by row; P replaces plane 0 of the scores.
    {
      constexpr int kLanes = Shape::kSoftmaxLanes;
      float vals[Shape::kSoftmaxKeys];
      float tile_max = kNegInf;
#pragma unroll
      for (int i = 0; i < Shape::kSoftmaxKeys; ++i) {
        const int c = soft_part + i * kLanes;
        float v = 0.f;
#pragma unroll
        for (int ds = 0; ds < Shape::kScoreDimSplits; ++ds)
          v += scores[(ds * kKeys + c) * kRowStride + soft_row];
        // Soft-capped as attention_kernels.cuh's soft_cap: softcap * tanh(s / softcap) * log2(e).
        if constexpr (kSoftcap) v = p.softcap * tanhf(v * p.softcap_inv_log2) * CUDART_L2E_F;
        const int key = tile_start + c;
        const bool visible = c < tile_keys && key >= soft_keys.begin && key < soft_keys.end;
        vals[i] = visible ? v : kNegInf;
        tile_max = fmaxf(tile_max, vals[i]);
      }
      tile_max = group_max<kLanes>(tile_max);
      const float new_max = fmaxf(run_max, tile_max);
      // 0 on the first visible tile; 1 while the row has seen nothing (avoids -inf - -inf).
      const float rescale = new_max == run_max ? 1.f : exp2f(run_max - new_max);
      float tile_sum = 0.f;
#pragma unroll
      for (int i = 0; i < Shape::kSoftmaxKeys; ++i) {
        const float prob = vals[i] == kNegInf ? 0.f : exp2f(vals[i] - new_max);
        scores[(soft_part + i * kLanes) * kRowStride + soft_row] = prob;
        tile_sum += prob;
      }
      tile_sum = group_sum<kLanes>(tile_sum);
      run_sum = run_sum * rescale + tile_sum;
      run_max = new_max;
      if (soft_part == 0) row_scale[soft_row] = rescale;
    }
    __syncthreads();

    // O = O * rescale + P V for this thread's rows x dims over its keys.
    {
#pragma unroll
      for (int g = 0; g < kOutRows; g += 4) {
        if (out_r0 + g >= n_rows) continue;
        float rescale[4];
        load_floats<4>(row_scale + out_r0 + g, rescale);
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < kOutDims; ++j) acc[g + i][j] *= rescale[i];
      }
#pragma unroll 4
      for (int c = out_key_split; c < kKeys; c += Shape::kOutKeySplits) {
        float v_vals[kOutDims];
        load_as_float<kOutDims>(v_tile + c * kKeyStride + out_d0, v_vals);
        const float* probs = scores + c * kRowStride + out_r0;
#pragma unroll
        for (int g = 0; g < kOutRows; g += 4) {
          if (out_r0 + g >= n_rows) continue;
          float prob[4];
          load_floats<4>(probs + g, prob);
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < kOutDims; ++j)
              acc[g + i][j] = fmaf(prob[i], v_vals[j], acc[g + i][j]);
        }
      }
    }
    __syncthreads();  // the stage and the scores are free for the next tile
  }

  // Sum the P V partials of the key splits, then write the rows out, dims fastest.
  cp_async_wait<0>();  // nothing is in flight past the loop; the space is about to be reused
  if (soft_part == 0) {
    row_max[soft_row] = run_max;
    row_sum[soft_row] = run_sum;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kOutRows; ++i)
    store_floats<kOutDims>(reduce + (out_key_split * kRows + out_r0 + i) * kHeadDim + out_d0,
                           acc[i]);
  __syncthreads();
  for (int e = tid; e < kRows * kHeadDim; e += kThreads) {
    const int r = e / kHeadDim, d = e % kHeadDim;
    if (r >= n_rows || d >= p.head_dim) continue;
    float value = 0.f;
#pragma unroll
    for (int ks = 0; ks < Shape::kOutKeySplits; ++ks)
      value += reduce[(ks * kRows + r) * kHeadDim + d];
    const int64_t out_row = int64_t(row_token[r]) * p.n_heads + row_head[r];
    if (direct) {
      // The same expression as the combine kernel's, so one split gives the same bits.
      const float inv_sum = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
      p.out[out_row * p.head_dim + d] = from_float<scalar_t>(value * inv_sum);
    } else {
      p.partial_out[(split_rows + out_row) * p.head_dim + d] = value;
    }
  }
  if (!direct && tid < n_rows) {
    const int64_t out_row = int64_t(row_token[tid]) * p.n_heads + row_head[tid];
    p.partial_stats[(split_rows + out_row) * 2] = row_max[tid];
    p.partial_stats[(split_rows + out_row) * 2 + 1] = row_sum[tid];
  }
}

// Merges the key splits of every (token, head): out = sum_s w_s o_s / sum_s w_s l_s with
// w_s = 2^(m_s - max_s m_s); splits with m_s = -inf (no visible key) weigh 0 and are not read,
// and a row no split saw outputs 0. One warp per row of `rows` = total_q * n_heads.
template <typename scalar_t>
__global__ void __launch_bounds__(kPagedCombineWarps * 32)
    paged_attention_combine_kernel(const float* __restrict__ partial_out,
                                   const float* __restrict__ partial_stats,
                                   scalar_t* __restrict__ out, int64_t rows, int head_dim,
                                   int splits) {
  __shared__ float weights[kPagedCombineWarps][kPagedMaxSplits];
  const float kNegInf = -CUDART_INF_F;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kPagedCombineWarps + warp;
  if (row >= rows) return;  // the whole warp

  float max_all = kNegInf;
  for (int s = lane; s < splits; s += 32)
    max_all = fmaxf(max_all, partial_stats[(s * rows + row) * 2]);
  max_all = paged_detail::group_max<32>(max_all);
  float sum_all = 0.f;
  for (int s = lane; s < splits; s += 32) {
    const float m = partial_stats[(s * rows + row) * 2];
    const float w = m == kNegInf ? 0.f : exp2f(m - max_all);
    weights[warp][s] = w;
    sum_all += w * partial_stats[(s * rows + row) * 2 + 1];
  }
  sum_all = paged_detail::group_sum<32>(sum_all);
  __syncwarp();
  const float inv_sum = sum_all > 0.f ? 1.f / sum_all : 0.f;
  // A lane's dims a few at a time, every split's partial of them loaded before any is summed:
  // the loads are independent, so they are in flight together rather than one L2 round trip
  // each. An empty split's partial was never written: its weight 0 selects nothing from it.
  constexpr int kDims = 4;
  for (int d0 = lane; d0 < head_dim; d0 += 32 * kDims) {
    float value[kDims] = {};
#pragma unroll 4
    for (int s = 0; s < splits; ++s) {
      const float w = weights[warp][s];
      const float* partial = partial_out + (s * rows + row) * head_dim;
#pragma unroll
      for (int i = 0; i < kDims; ++i) {
        const int d = d0 + 32 * i;
        const float o = d < head_dim ? partial[d] : 0.f;
        value[i] += w != 0.f ? w * o : 0.f;
      }
    }
#pragma unroll
    for (int i = 0; i < kDims; ++i) {
      const int d = d0 + 32 * i;
      if (d < head_dim) out[row * head_dim + d] = from_float<scalar_t>(value[i] * inv_sum);
    }
  }
}

}  // namespace cuda
}  // namespace fastllm

#ifdef FASTLLM_KERNEL_COMPILE_CHECK
// Every configuration paged_attention_cuda.cu launches: the decode shape for head_dim padded to
// 64 / 128 / 256, the prefill shape for 64 / 128, and the merge of splits.
#define FASTLLM_INSTANTIATE_PAGED(T, D, R)                                        \
  template __global__ void fastllm::cuda::paged_attention_kernel<T, D, R, false>( \
      const fastllm::cuda::PagedAttentionParams<T>);                              \
  template __global__ void fastllm::cuda::paged_attention_kernel<T, D, R, true>(  \
      const fastllm::cuda::PagedAttentionParams<T>);
#define FASTLLM_INSTANTIATE_PAGED_ALL(T)                                                \
  FASTLLM_INSTANTIATE_PAGED(T, 64, fastllm::cuda::kPagedDecodeRows)                     \
  FASTLLM_INSTANTIATE_PAGED(T, 128, fastllm::cuda::kPagedDecodeRows)                    \
  FASTLLM_INSTANTIATE_PAGED(T, 256, fastllm::cuda::kPagedDecodeRows)                    \
  FASTLLM_INSTANTIATE_PAGED(T, 64, fastllm::cuda::paged_prefill_rows(64))               \
  FASTLLM_INSTANTIATE_PAGED(T, 128, fastllm::cuda::paged_prefill_rows(128))             \
  template __global__ void fastllm::cuda::paged_attention_combine_kernel<T>(            \
      const float*, const float*, T*, int64_t, int, int);
FASTLLM_INSTANTIATE_PAGED_ALL(float)
FASTLLM_INSTANTIATE_PAGED_ALL(__half)
FASTLLM_INSTANTIATE_PAGED_ALL(__nv_bfloat16)
#undef FASTLLM_INSTANTIATE_PAGED_ALL
#undef FASTLLM_INSTANTIATE_PAGED
#endif
