// Sampling on CUDA, free of torch headers (nvcc compiles it alone in the tests): the filters and
// the draw of sampling_cpu.cpp, one thread block per row, without sorting the vocabulary.
//
// Every filter keeps an upper set of the row's values, so each is a threshold, found by radix
// select: a pass over the row adds each member's count (or mass) to a shared-memory histogram
// of 11 bits of an order-preserving uint32 key, a block scan of the histogram from the top
// picks the bin where the running total reaches the target, and the next pass looks inside
// that bin only (bits 31-21, 20-10, 9-0: three passes give the exact key).
// - top-k: the k-th largest logit (ties kept); its first histogram rides along pass 1, which
//   finds the maximum, the first argmax (greedy rows) and NaN / +inf / no finite value;
// - top-p: over the top-k survivors' float32 weights w = exp((x - max) / T), the smallest w*
//   whose strictly-larger mass is below top_p * total (tied weights stay together); the last
//   pass keeps each bin's least logit, so x* = the least logit with w >= w*;
// - min-p: max + T * log(min_p), in logit space.
// The draw: every kept token's weight as an integer of 2^-40 units, summed per segment of 256
// tokens (one warp each); a block scan over the segments finds the one where the running mass
// passes u * kept (u = philox_uniform(seed, offset)), and one warp walks it in vocabulary order
// to the first token whose running mass exceeds the target. Integer sums are exact in any
// order, so a token depends on its row, controls, seed and offset only. It equals the CPU's
// (double sums of the same float32 weights) except when the target falls within rounding error
// of a cumulative boundary (the fixed point rounds each weight by at most 2^-40, and CUDA's
// expf / logf may differ from glibc's in the last bit or two), and a token's top-p or min-p
// fate likewise when it lies within rounding error of the threshold.
// sample_with_logprobs: the top n by (logit desc, id asc) among the tokens with probability, by
// radix select of the n-th value (and of the last id among ties at it), a gather and a bitonic
// sort, in shared memory for n <= 2048 and in the output rows beyond.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/cuda_types.cuh"
#include "sampling/philox.h"

namespace fastllm {
namespace cuda {

constexpr int kSampleThreads = 1024;
constexpr int kSampleWarps = kSampleThreads / 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
// A warp reads a segment of 256 consecutive tokens at once, 8 per lane (16 would spill registers
// in the top-p passes at 1024 threads).
constexpr int kSegment = 256;
constexpr int kPerLane = kSegment / 32;
// Segments are summed into at most this many slots for the draw's block scan.
constexpr int kMaxSlots = 2 * kSampleThreads;
// Radix select: 11, 11 and 10 bits of the key.
constexpr int kRadixBins = 2048;
constexpr int kLastLevelBins = 1024;
// sample_with_logprobs sorts up to this many entries in shared memory.
constexpr int kRankedCapacity = 2048;
// Masses are integers of 2^-40 (a weight is at most 1): vocab * 2^40 must fit in 64 bits.
constexpr float kMassScale = 0x1p40f;
constexpr int kMaxVocab = 1 << 24;

// Per-row status the kernel reports: a logits error (at most one, in the CPU's order of
// precedence), plus whether the controls are out of range.
constexpr int kRowNaN = 1;
constexpr int kRowPosInf = 2;
constexpr int kRowNoFinite = 4;
constexpr int kRowBadControls = 8;

using Mass = unsigned long long;

struct SampleArgs {
  const float* temperature;
  const int32_t* top_k;
  const float* top_p;
  const float* min_p;
  const int64_t* seeds;
  const int64_t* offsets;
  int vocab;
  int64_t* tokens;
  int32_t* status;
  float* token_logprobs;  // null: no log-probabilities (the sample op)
  int64_t* top_ids;
  float* top_logprobs;
  int64_t num_logprobs;
};

// A radix histogram of masses: 64-bit sums kept as two 32-bit words, so that every shared-memory
// atomic is a native 32-bit one.
struct MassBins {
  uint32_t low[kRadixBins];
  uint32_t high[kRadixBins];
};

struct RankedBuffer {
  float value[kRankedCapacity];
  int32_t id[kRankedCapacity];
};

struct SampleShared {
  union {  // one phase at a time
    uint32_t count[kRadixBins];
    MassBins mass;
    Mass slot_mass[kMaxSlots];
    RankedBuffer ranked;
  };
  uint32_t least_key[kLastLevelBins];  // top-p's last level: the least logit key per bin
  Mass scan[kSampleWarps];
  double sum[kSampleWarps];
  float best_value[kSampleWarps];
  int best_index[kSampleWarps];
  int ints[kSampleWarps];
  // Broadcasts of one thread's finding.
  int selected_bin;
  Mass selected_above, selected_at;
  int found_slot;
  Mass found_base;
  int token;
  int gathered;
};

__device__ __forceinline__ int lane_id() { return threadIdx.x % 32; }
__device__ __forceinline__ int warp_id() { return threadIdx.x / 32; }

// ---------------------------------------------------------------------------------------------
// Keys, weights and masses

// Order-preserving: x < y <=> key(x) < key(y). -0 and +0 compare equal as floats, so they share
// the key of +0 (adding +0 turns -0 into +0).
__device__ __forceinline__ uint32_t ordered_key(float x) {
  const uint32_t bits = __float_as_uint(__fadd_rn(x, 0.f));
  return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

__device__ __forceinline__ float key_value(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? key & 0x7FFFFFFFu : ~key);
}

// The CPU's weight, in the same float32 operations: at most 1, 0 for -inf.
__device__ __forceinline__ float token_weight(float x, float max, float inv_t) {
  return expf((x - max) * inv_t);
}

// A weight w in (0, 1] as an integer of 2^-40 (2^40 w is exact in float32), at least 1 so that
// every kept token has mass.
__device__ __forceinline__ Mass fixed_mass(float w) {
  const Mass m = __float2ull_rn(w * kMassScale);
  return m > 0 ? m : 1;
}

// The CPU's log-probability: a float32 difference, scaled, minus a double normalizer.
__device__ __forceinline__ float log_probability(float x, float max, float scale,
                                                 double log_norm) {
  return float(double((x - max) * scale) - log_norm);
}

// ---------------------------------------------------------------------------------------------
// Reading a row: warp w takes segments w, w + 32, ...; in a segment, lane l loads kVec
// consecutive tokens at a time (16-byte vectors, or kVec = 1 where the host found the rows
// unaligned), 8 tokens in all.

// The token of a segment's j-th value in lane `lane`; increasing with (j / kVec, lane, j % kVec).
template <int kVec>
__device__ __forceinline__ int segment_token(int segment, int lane, int j) {
  return segment * kSegment + (j / kVec) * (32 * kVec) + lane * kVec + j % kVec;
}

template <int kVec, typename scalar_t>
__device__ __forceinline__ void load_segment(const scalar_t* __restrict__ row, int vocab,
                                             int segment, float (&x)[kPerLane]) {
  static_assert(kPerLane % kVec == 0, "a lane's tokens are whole vectors");
  const int lane = lane_id();
#pragma unroll
  for (int v = 0; v < kPerLane / kVec; ++v) {
    const int first = segment_token<kVec>(segment, lane, v * kVec);
    if (first >= vocab) {  // vocab is a multiple of kVec: a vector is all in or all out
#pragma unroll
      for (int c = 0; c < kVec; ++c) x[v * kVec + c] = -INFINITY;
      continue;
    }
    if constexpr (kVec == 1) {
      x[v] = to_float(row[first]);
    } else {
      static_assert(kVec * sizeof(scalar_t) == 16, "a vector is 16 bytes");
      const uint4 raw = *reinterpret_cast<const uint4*>(row + first);
      scalar_t values[kVec];
      memcpy(values, &raw, sizeof(raw));
#pragma unroll
      for (int c = 0; c < kVec; ++c) x[v * kVec + c] = to_float(values[c]);
    }
  }
}

// f(segment, x) for each segment, called by all 32 lanes of a warp together (warp collectives
// are allowed); values past the vocabulary are -inf and must be skipped by token index.
template <int kVec, typename scalar_t, typename F>
__device__ __forceinline__ void for_each_segment(const scalar_t* __restrict__ row, int vocab,
                                                 F&& f) {
  const int segments = (vocab + kSegment - 1) / kSegment;
  for (int segment = warp_id(); segment < segments; segment += kSampleWarps) {
    float x[kPerLane];
    load_segment<kVec>(row, vocab, segment, x);
    f(segment, x);
  }
}

// f(token, x) for each token of the row, in no particular order across threads.
template <int kVec, typename scalar_t, typename F>
__device__ __forceinline__ void for_each_token(const scalar_t* __restrict__ row, int vocab,
                                               F&& f) {
  const int lane = lane_id();
  for_each_segment<kVec>(row, vocab, [&](int segment, const float (&x)[kPerLane]) {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int token = segment_token<kVec>(segment, lane, j);
      if (token < vocab) f(token, x[j]);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Block collectives: every thread of the block calls them and gets the same result.

template <typename V, typename Op>
__device__ __forceinline__ V warp_reduce(V v, Op op) {
#pragma unroll
  for (int d = 16; d > 0; d /= 2) v = op(v, __shfl_xor_sync(kFullMask, v, d));
  return v;
}

// Warp totals combined in warp order, so floating-point results are the same in every thread.
template <typename V, typename Op>
__device__ V block_reduce(V v, Op op, V* scratch) {
  v = warp_reduce(v, op);
  if (lane_id() == 0) scratch[warp_id()] = v;
  __syncthreads();
  V total = scratch[0];
  for (int w = 1; w < kSampleWarps; ++w) total = op(total, scratch[w]);
  __syncthreads();
  return total;
}

struct Plus {
  template <typename V>
  __device__ V operator()(V a, V b) const { return a + b; }
};
struct BitOr {
  __device__ int operator()(int a, int b) const { return a | b; }
};

__device__ __forceinline__ Mass warp_inclusive_sum(Mass v) {
  const int lane = lane_id();
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const Mass other = __shfl_up_sync(kFullMask, v, d);
    if (lane >= d) v += other;
  }
  return v;
}

// The sum of `v` over the threads before this one (in threadIdx order), and the block's total.
__device__ Mass block_exclusive_sum(Mass v, SampleShared& sh, Mass& total) {
  const Mass inclusive = warp_inclusive_sum(v);
  if (lane_id() == 31) sh.scan[warp_id()] = inclusive;
  __syncthreads();
  Mass before = 0;
  total = 0;
  for (int w = 0; w < kSampleWarps; ++w) {
    const Mass s = sh.scan[w];
    if (w < warp_id()) before += s;
    total += s;
  }
  __syncthreads();
  return before + inclusive - v;
}

struct ArgMax {
  float value;
  int index;
};

// The largest value, the lowest index among its ties.
__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
  return (b.value > a.value || (b.value == a.value && b.index < a.index)) ? b : a;
}

__device__ ArgMax block_argmax(ArgMax v, SampleShared& sh) {
#pragma unroll
  for (int d = 16; d > 0; d /= 2)
    v = better(v, {__shfl_xor_sync(kFullMask, v.value, d), __shfl_xor_sync(kFullMask, v.index, d)});
  if (lane_id() == 0) {
    sh.best_value[warp_id()] = v.value;
    sh.best_index[warp_id()] = v.index;
  }
  __syncthreads();
  ArgMax best = {sh.best_value[0], sh.best_index[0]};
  for (int w = 1; w < kSampleWarps; ++w) best = better(best, {sh.best_value[w], sh.best_index[w]});
  __syncthreads();
  return best;
}

// ---------------------------------------------------------------------------------------------
// Radix select

struct Selection {
  uint32_t key;       // the selected member's key
  Mass above;         // total weight of the members with a larger key
  Mass at;            // total weight of the members with this key
  uint32_t least;     // the least `aux` among the members with this key (kTrackLeast)
};

// Histogram bins of counts (Count = uint32_t) or masses (Count = Mass).
template <typename Count>
__device__ __forceinline__ void clear_bin(SampleShared& sh, int bin) {
  if constexpr (std::is_same_v<Count, Mass>) {
    sh.mass.low[bin] = 0;
    sh.mass.high[bin] = 0;
  } else {
    sh.count[bin] = 0;
  }
}

template <typename Count>
__device__ __forceinline__ void add_to_bin(SampleShared& sh, int bin, Count weight) {
  if constexpr (std::is_same_v<Count, Mass>) {
    const uint32_t low = uint32_t(weight);
    const uint32_t before = atomicAdd(&sh.mass.low[bin], low);
    const uint32_t high = uint32_t(weight >> 32) + (before + low < before ? 1u : 0u);  // carry
    if (high != 0) atomicAdd(&sh.mass.high[bin], high);
  } else {
    atomicAdd(&sh.count[bin], weight);
  }
}

template <typename Count>
__device__ __forceinline__ Mass bin_total(const SampleShared& sh, int bin) {
  if constexpr (std::is_same_v<Count, Mass>)
    return Mass(sh.mass.high[bin]) << 32 | sh.mass.low[bin];
  else
    return sh.count[bin];
}

// The key K of a weighted set at `target` from the top: members with a key above K weigh less
// than the target, members with a key at or above K at least as much. member(token, x, key,
// weight, aux) says whether a token belongs to the set and gives its key, weight (> 0) and aux
// value. target_of(total) turns the set's total weight into the target, which must lie in
// (0, total]. With level0_ready, sh's count histogram of the keys' top 11 bits is already there
// (pass 1 built it).
template <int kVec, typename Count, bool kTrackLeast, typename scalar_t, typename Member,
          typename TargetOf>
__device__ Selection radix_select(const scalar_t* __restrict__ row, int vocab, SampleShared& sh,
                                  bool level0_ready, Member member, TargetOf target_of) {
  uint32_t prefix = 0, prefix_mask = 0, least = 0xFFFFFFFFu;
  Mass above = 0, at = 0;
  double target = 0;
#pragma unroll
  for (int level = 0; level < 3; ++level) {
    const int shift = level == 0 ? 21 : level == 1 ? 10 : 0;
    const int bins = level == 2 ? kLastLevelBins : kRadixBins;
    const bool last = level == 2;
    if (level > 0 || !level0_ready) {
      for (int b = threadIdx.x; b < bins; b += kSampleThreads) {
        clear_bin<Count>(sh, b);
        if (kTrackLeast && last) sh.least_key[b] = 0xFFFFFFFFu;
      }
      __syncthreads();
      for_each_token<kVec>(row, vocab, [&](int token, float x) {
        uint32_t key, aux;
        Count weight;
        if (!member(token, x, key, weight, aux) || (key & prefix_mask) != prefix) return;
        const int bin = int(key >> shift) & (bins - 1);
        add_to_bin<Count>(sh, bin, weight);
        if constexpr (kTrackLeast)
          if (last) atomicMin(&sh.least_key[bin], aux);
      });
      __syncthreads();
    }
    // Thread t holds bins in descending order, from bins - 1 - t * per.
    const int per = (bins + kSampleThreads - 1) / kSampleThreads;
    Mass mine = 0;
    for (int j = 0; j < per; ++j) {
      const int position = threadIdx.x * per + j;
      if (position < bins) mine += bin_total<Count>(sh, bins - 1 - position);
    }
    if (threadIdx.x == 0) {  // never left unset, even if the target were out of range
      sh.selected_bin = 0;
      sh.selected_above = above;
      sh.selected_at = 0;
    }
    Mass total;
    Mass running = above + block_exclusive_sum(mine, sh, total);
    if (level == 0) target = target_of(total);
    for (int j = 0; j < per; ++j) {
      const int position = threadIdx.x * per + j;
      if (position >= bins) break;
      const int bin = bins - 1 - position;
      const Mass weight = bin_total<Count>(sh, bin);
      // Exactly one bin: the running totals are exact, so these intervals tile (0, total].
      if (double(running) < target && target <= double(running + weight)) {
        sh.selected_bin = bin;
        sh.selected_above = running;
        sh.selected_at = weight;
      }
      running += weight;
    }
    __syncthreads();
    const int bin = sh.selected_bin;
    above = sh.selected_above;
    at = sh.selected_at;
    if constexpr (kTrackLeast)
      if (last) least = sh.least_key[bin];
    __syncthreads();  // before the next level (or caller) overwrites the histogram
    prefix |= uint32_t(bin) << shift;
    prefix_mask |= uint32_t(bins - 1) << shift;
  }
  return {prefix, above, at, least};
}

// ---------------------------------------------------------------------------------------------
// Log-probabilities

__device__ __forceinline__ bool ranks_before(float value_a, int64_t id_a, float value_b,
                                             int64_t id_b) {
  return value_a > value_b || (value_a == value_b && id_a < id_b);
}

// Sorts (value, id)[0, m) most likely first, ties by lower id: bitonic, every merge ascending
// (its first step compares mirrored positions), so positions past m act as last-ranked padding
// that never moves and their comparisons are skipped. Works on shared or global memory.
template <typename Id>
__device__ void bitonic_sort(float* value, Id* id, int m) {
  int size = 1;
  while (size < m) size *= 2;
  for (int k = 2; k <= size; k *= 2) {
    for (int j = k / 2; j > 0; j /= 2) {
      for (int q = threadIdx.x; q < size / 2; q += kSampleThreads) {
        const int lo = (q / j) * 2 * j + q % j;
        const int hi = j == k / 2 ? (lo / k) * k + k - 1 - lo % k : lo + j;
        if (hi < m && ranks_before(value[hi], id[hi], value[lo], id[lo])) {
          const float v = value[lo];
          value[lo] = value[hi];
          value[hi] = v;
          const Id i = id[lo];
          id[lo] = id[hi];
          id[hi] = i;
        }
      }
      __syncthreads();
    }
  }
}

// Gathers the m members that rank first into (value, id), sorts them and writes the row's n
// outputs: the m entries, then -1 / -inf.
template <int kVec, typename Id, typename scalar_t, typename InSet>
__device__ void gather_and_write(const scalar_t* __restrict__ row, int vocab, SampleShared& sh,
                                 InSet in_set, int m, uint32_t cut_key, uint32_t last_id,
                                 float* value, Id* id, int64_t n, float max, float scale,
                                 double log_norm, int64_t* out_ids, float* out_logprobs) {
  if (threadIdx.x == 0) sh.gathered = 0;
  __syncthreads();
  for_each_token<kVec>(row, vocab, [&](int token, float x) {
    if (!in_set(token, x)) return;
    const uint32_t key = ordered_key(x);
    if (key > cut_key || (key == cut_key && uint32_t(token) <= last_id)) {
      const int slot = atomicAdd(&sh.gathered, 1);
      if (slot < m) {
        value[slot] = x;
        id[slot] = Id(token);
      }
    }
  });
  __syncthreads();
  bitonic_sort(value, id, m);
  // In place where (value, id) are the output rows: each entry is read and written by one thread.
  for (int64_t j = threadIdx.x; j < n; j += kSampleThreads) {
    if (j < m) {
      const float x = value[j];
      const int64_t token = int64_t(id[j]);
      out_ids[j] = token;
      out_logprobs[j] = log_probability(x, max, scale, log_norm);
    } else {
      out_ids[j] = -1;
      out_logprobs[j] = -INFINITY;
    }
  }
}

// The n most likely members of in_set (the tokens with probability; set_size of them), most
// likely first with ties by lower id, as (id, logprob); -1 / -inf past them.
template <int kVec, typename scalar_t, typename InSet>
__device__ void write_top_logprobs(const scalar_t* __restrict__ row, int vocab, SampleShared& sh,
                                   InSet in_set, int set_size, int64_t n, float max, float scale,
                                   double log_norm, int64_t* out_ids, float* out_logprobs) {
  const int m = int(n < set_size ? n : set_size);
  if (m == 0) {
    for (int64_t j = threadIdx.x; j < n; j += kSampleThreads) {
      out_ids[j] = -1;
      out_logprobs[j] = -INFINITY;
    }
    return;
  }
  // The m-th largest value, then, when more tokens tie at it than fit, the last id that fits.
  const Selection cut = radix_select<kVec, uint32_t, false>(
      row, vocab, sh, false,
      [&](int token, float x, uint32_t& key, uint32_t& weight, uint32_t& aux) {
        if (!in_set(token, x)) return false;
        key = ordered_key(x);
        weight = 1;
        aux = 0;
        return true;
      },
      [&](Mass) { return double(m); });
  const int tied_needed = m - int(cut.above);
  uint32_t last_id = uint32_t(vocab);
  if (Mass(tied_needed) < cut.at) {
    const Selection by_id = radix_select<kVec, uint32_t, false>(
        row, vocab, sh, false,
        [&](int token, float x, uint32_t& key, uint32_t& weight, uint32_t& aux) {
          if (!in_set(token, x) || ordered_key(x) != cut.key) return false;
          key = ~uint32_t(token);  // the largest key is the lowest id
          weight = 1;
          aux = 0;
          return true;
        },
        [&](Mass) { return double(tied_needed); });
    last_id = ~by_id.key;
  }
  if (m <= kRankedCapacity)
    gather_and_write<kVec>(row, vocab, sh, in_set, m, cut.key, last_id, sh.ranked.value,
                           sh.ranked.id, n, max, scale, log_norm, out_ids, out_logprobs);
  else  // sorted in the output rows themselves
    gather_and_write<kVec>(row, vocab, sh, in_set, m, cut.key, last_id, out_logprobs, out_ids, n,
                           max, scale, log_norm, out_ids, out_logprobs);
}

// ---------------------------------------------------------------------------------------------
// The sampling kernel

struct RowControls {
  float temperature, inv_t, top_p, min_p;
  int top_k;  // 0 = off
  bool greedy;
  bool bad;  // out of range: rejected on the host unless it could not look (graph capture)
};

// A row's controls; out-of-range ones are replaced by the nearest valid (or off) setting so that
// the row still samples sanely when the host could not check them.
__device__ RowControls row_controls(const SampleArgs& a, int r) {
  const float t = a.temperature[r], p = a.top_p[r], m = a.min_p[r];
  const int k = a.top_k[r];
  const bool t_ok = t >= 0.f && t < INFINITY, p_ok = p > 0.f && p <= 1.f,
             m_ok = m >= 0.f && m <= 1.f;
  RowControls c;
  c.bad = !(t_ok && p_ok && m_ok);
  c.temperature = t_ok ? t : 0.f;
  c.top_p = p_ok ? p : 1.f;
  c.min_p = m_ok ? m : 0.f;
  c.inv_t = c.temperature > 0.f ? 1.f / c.temperature : 0.f;
  // A temperature so small that 1 / T overflows leaves only the maximum: greedy.
  c.greedy = !(c.temperature > 0.f) || !(c.inv_t < INFINITY);
  c.top_k = k > 0 && k < a.vocab ? k : 0;
  return c;
}

// A row with NaN, +inf or no finite logit: an error the host raises when it can look; otherwise
// (graph capture, fastllm.ops.trusted_inputs) token -1, which no caller can take for a token,
// and no log-probabilities.
__device__ void write_unusable_row(const SampleArgs& a, int r) {
  if (threadIdx.x == 0) {
    a.tokens[r] = -1;
    if (a.token_logprobs != nullptr) a.token_logprobs[r] = __int_as_float(0x7FC00000);  // NaN
  }
  if (a.token_logprobs == nullptr) return;
  for (int64_t j = threadIdx.x; j < a.num_logprobs; j += kSampleThreads) {
    a.top_ids[r * a.num_logprobs + j] = -1;
    a.top_logprobs[r * a.num_logprobs + j] = -INFINITY;
  }
}

// One block of kSampleThreads per row. kVec: tokens per 16-byte load, or 1 where the rows are
// not 16-byte aligned. Writes tokens[r], status[r] and, with token_logprobs, the log-probabilities.
template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kSampleThreads)
    sample_kernel(const scalar_t* __restrict__ logits, SampleArgs a) {
  __shared__ SampleShared sh;
  const int r = blockIdx.x, vocab = a.vocab;
  const scalar_t* row = logits + int64_t(r) * vocab;
  const RowControls c = row_controls(a, r);
  const bool want_logprobs = a.token_logprobs != nullptr;
  int64_t* out_ids = want_logprobs ? a.top_ids + r * a.num_logprobs : nullptr;
  float* out_logprobs = want_logprobs ? a.top_logprobs + r * a.num_logprobs : nullptr;

  // Pass 1: maximum, first argmax, NaN / +inf, finite count, and top-k's first histogram.
  const bool top_k_histogram = !c.greedy && c.top_k > 0;
  if (top_k_histogram) {
    for (int b = threadIdx.x; b < kRadixBins; b += kSampleThreads) sh.count[b] = 0;
    __syncthreads();
  }
  ArgMax best = {-INFINITY, INT_MAX};
  int flags = 0, finite = 0;
  for_each_token<kVec>(row, vocab, [&](int token, float x) {
    if (x != x) flags |= kRowNaN;
    else if (x == INFINITY) flags |= kRowPosInf;
    else finite += x > -INFINITY;
    best = better(best, {x, token});  // NaN never wins a comparison
    if (top_k_histogram) atomicAdd(&sh.count[ordered_key(x) >> 21], 1u);
  });
  best = block_argmax(best, sh);
  flags = block_reduce(flags, BitOr{}, sh.ints);
  finite = block_reduce(finite, Plus{}, sh.ints);
  const float max = best.value;
  const int status = (flags & kRowNaN)      ? kRowNaN
                     : (flags & kRowPosInf) ? kRowPosInf
                     : max == -INFINITY     ? kRowNoFinite
                                            : 0;
  if (threadIdx.x == 0) a.status[r] = status | (c.bad ? kRowBadControls : 0);
  if (status != 0) {
    write_unusable_row(a, r);
    return;
  }

  if (c.greedy) {
    if (threadIdx.x == 0) a.tokens[r] = best.index;
    if (!want_logprobs) return;
    // log_softmax of the raw logits: float32 exponentials, a double sum.
    double sum = 0;
    for_each_token<kVec>(row, vocab, [&](int, float x) { sum += expf(x - max); });
    const double log_norm = log(block_reduce(sum, Plus{}, sh.sum));
    if (threadIdx.x == 0) a.token_logprobs[r] = float(-log_norm);
    write_top_logprobs<kVec>(
        row, vocab, sh, [](int, float x) { return x > -INFINITY; }, finite, a.num_logprobs, max,
        1.f, log_norm, out_ids, out_logprobs);
    return;
  }

  // Thresholds in logit space.
  const float inv_t = c.inv_t;
  float k_threshold = -INFINITY;
  if (c.top_k > 0) {
    const Selection kth = radix_select<kVec, uint32_t, false>(
        row, vocab, sh, true,
        [](int, float x, uint32_t& key, uint32_t& weight, uint32_t& aux) {
          key = ordered_key(x);
          weight = 1;
          aux = 0;
          return true;
        },
        [&](Mass) { return double(c.top_k); });
    k_threshold = key_value(kth.key);
  }
  // As the CPU writes it: max + T * log(min_p), each operation rounded (no fused multiply-add).
  const float min_p_threshold =
      c.min_p > 0.f ? __fadd_rn(max, __fmul_rn(c.temperature, logf(c.min_p))) : -INFINITY;
  float threshold = fmaxf(k_threshold, min_p_threshold);
  if (c.top_p < 1.f) {
    // Over the top-k survivors with a nonzero weight (min-p does not prune top-p's mass).
    const Selection w_star = radix_select<kVec, Mass, true>(
        row, vocab, sh, false,
        [&](int, float x, uint32_t& key, Mass& weight, uint32_t& aux) {
          if (!(x >= k_threshold)) return false;
          const float w = token_weight(x, max, inv_t);
          if (!(w > 0.f)) return false;
          key = __float_as_uint(w);  // w > 0: the bits are ordered
          weight = fixed_mass(w);
          aux = ordered_key(x);
          return true;
        },
        [&](Mass total) { return double(c.top_p) * double(total); });
    // The least logit whose weight is w* is the least with a weight >= w*, as w grows with x
    // (up to expf's last-bit error, which could only matter for logits an ulp apart).
    threshold = fmaxf(key_value(w_star.least), threshold);
  }

  // Kept tokens: x >= threshold with a nonzero weight. Their mass per slot (a run of `group`
  // segments), their double sum (the CPU's normalizer) and their count.
  const int segments = (vocab + kSegment - 1) / kSegment;
  const int group = (segments + kMaxSlots - 1) / kMaxSlots;
  const int slots = (segments + group - 1) / group;
  for (int s = threadIdx.x; s < slots; s += kSampleThreads) sh.slot_mass[s] = 0;
  __syncthreads();
  double kept_sum = 0;
  int kept_count = 0;
  for_each_segment<kVec>(row, vocab, [&](int segment, const float (&x)[kPerLane]) {
    Mass lane_mass = 0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (segment_token<kVec>(segment, lane_id(), j) >= vocab || !(x[j] >= threshold)) continue;
      const float w = token_weight(x[j], max, inv_t);
      if (!(w > 0.f)) continue;
      lane_mass += fixed_mass(w);
      kept_sum += w;
      ++kept_count;
    }
    const Mass segment_mass = warp_reduce(lane_mass, Plus{});
    if (lane_id() == 0 && segment_mass > 0) atomicAdd(&sh.slot_mass[segment / group], segment_mass);
  });
  __syncthreads();

  // The slot where the running mass passes the target: thread t holds slots 2t and 2t + 1.
  constexpr int kSlotsPerThread = kMaxSlots / kSampleThreads;
  Mass mine = 0;
  for (int j = 0; j < kSlotsPerThread; ++j) {
    const int s = threadIdx.x * kSlotsPerThread + j;
    if (s < slots) mine += sh.slot_mass[s];
  }
  if (threadIdx.x == 0) {
    sh.found_slot = -1;
    sh.token = best.index;  // always kept; stands only if the search below found nothing
  }
  Mass kept_mass;
  Mass running = block_exclusive_sum(mine, sh, kept_mass);
  // u < 1, so target < kept_mass: some slot's interval [running, running + mass) holds it.
  const double target =
      philox_uniform(uint64_t(a.seeds[r]), uint64_t(a.offsets[r])) * double(kept_mass);
  for (int j = 0; j < kSlotsPerThread; ++j) {
    const int s = threadIdx.x * kSlotsPerThread + j;
    if (s >= slots) break;
    const Mass mass = sh.slot_mass[s];
    if (double(running) <= target && target < double(running + mass)) {
      sh.found_slot = s;
      sh.found_base = running;
    }
    running += mass;
  }
  __syncthreads();

  // Warp 0 walks the slot's segments in vocabulary order to the first token whose running mass
  // exceeds the target: it exists, since the slot's mass takes the running total past it.
  const int slot = sh.found_slot;
  if (warp_id() == 0 && slot >= 0) {
    const int lane = lane_id();
    Mass base = sh.found_base;
    const int end = min(segments, (slot + 1) * group);
    bool found = false;  // warp-uniform
    for (int segment = slot * group; segment < end && !found; ++segment) {
      float x[kPerLane];
      load_segment<kVec>(row, vocab, segment, x);
      for (int v = 0; v < kPerLane / kVec && !found; ++v) {
        Mass mass[kVec];
        Mass lane_total = 0;
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const int j = v * kVec + e;
          mass[e] = 0;
          if (segment_token<kVec>(segment, lane, j) < vocab && x[j] >= threshold) {
            const float w = token_weight(x[j], max, inv_t);
            if (w > 0.f) mass[e] = fixed_mass(w);
          }
          lane_total += mass[e];
        }
        const Mass inclusive = warp_inclusive_sum(lane_total);
        const Mass step_total = __shfl_sync(kFullMask, inclusive, 31);
        if (double(base + step_total) > target) {
          const unsigned crossed = __ballot_sync(kFullMask, double(base + inclusive) > target);
          if (lane == __ffs(crossed) - 1) {
            Mass acc = base + inclusive - lane_total;
#pragma unroll
            for (int e = 0; e < kVec; ++e) {
              acc += mass[e];
              if (mass[e] > 0 && double(acc) > target) {
                sh.token = segment_token<kVec>(segment, lane, v * kVec + e);
                break;
              }
            }
          }
          found = true;
        } else {
          base += step_total;
        }
      }
    }
  }
  __syncthreads();
  const int token = sh.token;
  if (threadIdx.x == 0) a.tokens[r] = token;
  if (!want_logprobs) return;

  const double log_norm = log(block_reduce(kept_sum, Plus{}, sh.sum));
  kept_count = block_reduce(kept_count, Plus{}, sh.ints);
  if (threadIdx.x == 0)
    a.token_logprobs[r] = log_probability(to_float(row[token]), max, inv_t, log_norm);
  write_top_logprobs<kVec>(
      row, vocab, sh,
      [&](int, float x) { return x >= threshold && token_weight(x, max, inv_t) > 0.f; },
      kept_count, a.num_logprobs, max, inv_t, log_norm, out_ids, out_logprobs);
}

// ---------------------------------------------------------------------------------------------
// Penalties

// Thread (x, y) of the grid: token blockIdx.x * blockDim.x + threadIdx.x of rows blockIdx.y,
// blockIdx.y + gridDim.y, ... The logits have any strides; the other [batch, vocab] inputs are
// contiguous. The CPU's formula and order, in float32.
template <typename scalar_t>
__global__ void apply_penalties_kernel(
    scalar_t* __restrict__ logits, int64_t stride_row, int64_t stride_token,
    const bool* __restrict__ prompt_mask, const int32_t* __restrict__ output_counts,
    const float* __restrict__ repetition_penalty, const float* __restrict__ frequency_penalty,
    const float* __restrict__ presence_penalty, const float* __restrict__ logit_bias,
    int64_t batch, int64_t vocab) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= vocab) return;
  for (int64_t r = blockIdx.y; r < batch; r += gridDim.y) {
    const int64_t dense = r * vocab + t;
    scalar_t& slot = logits[r * stride_row + t * stride_token];
    const int32_t count = output_counts[dense];
    float v = to_float(slot);
    if (logit_bias != nullptr) v += logit_bias[dense];
    if (prompt_mask[dense] || count > 0) {
      const float penalty = repetition_penalty[r];
      v = v > 0.f ? v / penalty : v * penalty;
    }
    v -= frequency_penalty[r] * float(count) + (count > 0 ? presence_penalty[r] : 0.f);
    slot = from_float<scalar_t>(v);
  }
}

}  // namespace cuda
}  // namespace fastllm

#ifdef FASTLLM_KERNEL_COMPILE_CHECK
#define FASTLLM_INSTANTIATE_SAMPLE(T, VEC)                                                  \
  template __global__ void fastllm::cuda::sample_kernel<T, VEC>(const T*,                   \
                                                                fastllm::cuda::SampleArgs);
FASTLLM_INSTANTIATE_SAMPLE(float, 1)
FASTLLM_INSTANTIATE_SAMPLE(float, 4)
FASTLLM_INSTANTIATE_SAMPLE(__half, 1)
FASTLLM_INSTANTIATE_SAMPLE(__half, 8)
FASTLLM_INSTANTIATE_SAMPLE(__nv_bfloat16, 1)
FASTLLM_INSTANTIATE_SAMPLE(__nv_bfloat16, 8)
#undef FASTLLM_INSTANTIATE_SAMPLE
#define FASTLLM_INSTANTIATE_PENALTIES(T)                                                     \
  template __global__ void fastllm::cuda::apply_penalties_kernel<T>(                         \
      T*, int64_t, int64_t, const bool*, const int32_t*, const float*, const float*,         \
      const float*, const float*, int64_t, int64_t);
FASTLLM_INSTANTIATE_PENALTIES(float)
FASTLLM_INSTANTIATE_PENALTIES(__half)
FASTLLM_INSTANTIATE_PENALTIES(__nv_bfloat16)
#undef FASTLLM_INSTANTIATE_PENALTIES
#endif
