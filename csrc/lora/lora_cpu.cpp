// Batched LoRA on the CPU: y[t] += lora_b[s] @ (lora_a[s] @ x[t]) for each token t of slot s.
// The slots are on the host, so the tokens are grouped by slot and each group runs two small
// matrix products against its adapter: the shrink takes tiles of a few tokens against a few of
// A's rank rows (dot products over in_features, accumulated in registers), the expand
// multiplies the group's shrink results by B transposed to float32 (register-blocked tiles). A
// token's sums take the same steps whatever group or tile it lands in, so its result does not
// depend on the rest of the batch.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/dispatch.h"
#include "common/vec.h"
#include "common/vec_gemm.h"
#include "lora/lora.h"

namespace fastllm {
namespace {

// Tokens of one slot per shrink task (their x rows converted to float32 in one buffer) and per
// expand task.
constexpr int64_t kShrinkTokens = 16;
constexpr int64_t kExpandTokens = 16;
// Output columns per expand task, a multiple of the SIMD width: its float32 sums stay in L1.
constexpr int64_t kExpandColumns = 256;
// A call of fewer multiply-adds runs on the calling thread: waking the thread pool would cost
// more than it saves.
constexpr int64_t kMinParallelWork = 1 << 16;

// The shrink's register tile: tokens x rank rows of float32 dot products.
constexpr int kShrinkTileTokens = 4;
constexpr int kShrinkTileRanks = 2;

// h[m * ldh + r] = x[m] . a[r] for M tokens (float32 rows `in` apart) and R rows of A (`in`
// apart). Each sum takes the same steps whatever M and R: whole vectors lane by lane, the lanes
// added in order, then the tail by fused multiply-adds.
template <int M, int R, typename scalar_t>
inline void shrink_tile(const float* x, const scalar_t* a, int64_t in, float* h, int64_t ldh) {
  constexpr int64_t W = VecF::size();
  VecF acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = VecF(0.f);
  int64_t k = 0;
  for (; k + W <= in; k += W) {
    VecF av[R];
    for (int r = 0; r < R; ++r) av[r] = load_as_float(a + r * in + k);
    for (int m = 0; m < M; ++m) {
      const VecF xv = VecF::loadu(x + m * in + k);
      for (int r = 0; r < R; ++r) acc[m][r] = at::vec::fmadd(xv, av[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      float lanes[W];
      acc[m][r].store(lanes);
      float sum = 0.f;
      for (int64_t l = 0; l < W; ++l) sum += lanes[l];
      for (int64_t j = k; j < in; ++j) sum = std::fma(x[m * in + j], float(a[r * in + j]), sum);
      h[m * ldh + r] = sum;
    }
  }
}

// One tile of M tokens against every rank row of A.
template <int M, typename scalar_t>
inline void shrink_token_tile(const float* x, const scalar_t* a, int64_t rank, int64_t in,
                              float* h) {
  int64_t r = 0;
  for (; r + kShrinkTileRanks <= rank; r += kShrinkTileRanks)
    shrink_tile<M, kShrinkTileRanks>(x, a + r * in, in, h + r, rank);
  for (; r < rank; ++r) shrink_tile<M, 1>(x, a + r * in, in, h + r, rank);
}

// h [count, rank] = x [count, in] (float32) times A [rank, in] transposed.
template <typename scalar_t>
void shrink_rows(const float* x, int64_t count, const scalar_t* a, int64_t rank, int64_t in,
                 float* h) {
  static_assert(kShrinkTileTokens == 4, "the tail below takes up to 3 tokens");
  int64_t m = 0;
  for (; m + kShrinkTileTokens <= count; m += kShrinkTileTokens)
    shrink_token_tile<kShrinkTileTokens>(x + m * in, a, rank, in, h + m * rank);
  switch (count - m) {
    case 3: shrink_token_tile<3>(x + m * in, a, rank, in, h + m * rank); break;
    case 2: shrink_token_tile<2>(x + m * in, a, rank, in, h + m * rank); break;
    case 1: shrink_token_tile<1>(x + m * in, a, rank, in, h + m * rank); break;
    default: break;
  }
}

// dst[r * ld_dst + j] = b[j * rank + r] as float32 for j < out, r < rank: B [out, rank]
// transposed, 8 x 8 blocks through SIMD registers.
template <typename scalar_t>
void transpose_to_float(const scalar_t* b, int64_t out, int64_t rank, float* dst,
                        int64_t ld_dst) {
  constexpr int kBlock = 8;
  const int64_t out_blocks = out / kBlock * kBlock, rank_blocks = rank / kBlock * kBlock;
  for (int64_t j = 0; j < out_blocks; j += kBlock) {
    for (int64_t r = 0; r < rank_blocks; r += kBlock) {
      if constexpr (std::is_same_v<scalar_t, float>) {
        at::vec::transpose_mxn<float, kBlock, kBlock>(b + j * rank + r, rank,
                                                      dst + r * ld_dst + j, ld_dst);
      } else {
        float block[kBlock * kBlock];
        for (int i = 0; i < kBlock; ++i)
          convert_to_float(b + (j + i) * rank + r, block + i * kBlock, kBlock);
        at::vec::transpose_mxn<float, kBlock, kBlock>(block, kBlock, dst + r * ld_dst + j,
                                                      ld_dst);
      }
    }
    for (int64_t r = rank_blocks; r < rank; ++r)
      for (int i = 0; i < kBlock; ++i) dst[r * ld_dst + j + i] = float(b[(j + i) * rank + r]);
  }
  for (int64_t j = out_blocks; j < out; ++j)
    for (int64_t r = 0; r < rank; ++r) dst[r * ld_dst + j] = float(b[j * rank + r]);
}

// The tokens of each slot: those of slot s are order[begin[s], begin[s + 1]), in token order.
struct SlotGroups {
  std::vector<int64_t> order;
  std::vector<int64_t> begin;
  std::vector<int64_t> used;  // the slots with tokens, ascending
};

// Slots were checked to be in [-1, num_slots); -1 tokens are left out.
SlotGroups group_by_slot(const int32_t* slots, int64_t tokens, int64_t num_slots) {
  SlotGroups groups;
  groups.begin.assign(num_slots + 1, 0);
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] >= 0) ++groups.begin[slots[t] + 1];
  for (int64_t s = 0; s < num_slots; ++s) {
    if (groups.begin[s + 1] > 0) groups.used.push_back(s);
    groups.begin[s + 1] += groups.begin[s];
  }
  groups.order.resize(groups.begin[num_slots]);
  std::vector<int64_t> next(groups.begin.begin(), groups.begin.end() - 1);
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] >= 0) groups.order[next[slots[t]]++] = t;
  return groups;
}

// A run of one used slot's tokens (groups.order[first, first + count)), and for the expand the
// first of its output columns. A shrink task with count 0 transposes the slot's B instead.
struct Task {
  int64_t used_index, first, count, column;
};

// y[0, n) += delta[0, n), each element rounded once to scalar_t.
template <typename scalar_t>
void add_to_row(scalar_t* y, const float* delta, int64_t n) {
  constexpr int64_t W = VecF::size();
  int64_t j = 0;
  for (; j + W <= n; j += W)
    store_from_float(load_as_float(y + j) + VecF::loadu(delta + j), y + j);
  for (; j < n; ++j) y[j] = scalar_t(float(y[j]) + delta[j]);
}

template <typename scalar_t>
void add_lora_groups(at::Tensor& y, const at::Tensor& x, const scalar_t* lora_a,
                     const scalar_t* lora_b, const SlotGroups& groups, int64_t rank) {
  const int64_t in = x.size(1), out = y.size(1), out_padded = round_up_to_vec(out);
  const int64_t active = int64_t(groups.order.size()), used = int64_t(groups.used.size());
  const scalar_t* x_data = x.const_data_ptr<scalar_t>();
  scalar_t* y_data = y.mutable_data_ptr<scalar_t>();
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  // h[i] = lora_a[slot] @ x[order[i]] summed in float32 and rounded to scalar_t, kept as float.
  std::vector<float> h(active * rank);
  // Each used slot's B transposed, [rank, out_padded] float32 (columns past out zero): the
  // expand's right-hand matrix.
  std::vector<float> b_t(used * rank * out_padded);
  const auto grain = [&](int64_t tasks) {
    return active * rank * (in + out) < kMinParallelWork ? tasks : int64_t(1);
  };

  // Each slot's transpose beside its shrinks, so that the threads' shares of the tasks even out.
  std::vector<Task> shrinks;
  for (int64_t u = 0; u < used; ++u) {
    const int64_t s = groups.used[u];
    shrinks.push_back({u, 0, 0, 0});
    for (int64_t first = groups.begin[s]; first < groups.begin[s + 1]; first += kShrinkTokens)
      shrinks.push_back({u, first, std::min(kShrinkTokens, groups.begin[s + 1] - first), 0});
  }
  at::parallel_for(0, int64_t(shrinks.size()), grain(shrinks.size()), [&](int64_t b, int64_t e) {
    std::vector<float> x_rows;
    for (int64_t i = b; i < e; ++i) {
      const Task& task = shrinks[i];
      const int64_t s = groups.used[task.used_index];
      if (task.count == 0) {
        float* dst = b_t.data() + task.used_index * rank * out_padded;
        transpose_to_float(lora_b + s * out * rank, out, rank, dst, out_padded);
        for (int64_t r = 0; r < rank; ++r)
          std::fill(dst + r * out_padded + out, dst + (r + 1) * out_padded, 0.f);
        continue;
      }
      x_rows.resize(task.count * in);
      for (int64_t m = 0; m < task.count; ++m)
        convert_to_float(x_data + groups.order[task.first + m] * ldx, x_rows.data() + m * in, in);
      float* h_rows = h.data() + task.first * rank;
      shrink_rows(x_rows.data(), task.count, lora_a + s * rank * in, rank, in, h_rows);
      if constexpr (!std::is_same_v<scalar_t, float>) {
        for (int64_t j = 0; j < task.count * rank; ++j) h_rows[j] = float(scalar_t(h_rows[j]));
      }
    }
  });

  std::vector<Task> expands;
  for (int64_t u = 0; u < used; ++u) {
    const int64_t s = groups.used[u];
    for (int64_t first = groups.begin[s]; first < groups.begin[s + 1]; first += kExpandTokens)
      for (int64_t column = 0; column < out_padded; column += kExpandColumns)
        expands.push_back(
            {u, first, std::min(kExpandTokens, groups.begin[s + 1] - first), column});
  }
  at::parallel_for(0, int64_t(expands.size()), grain(expands.size()), [&](int64_t b, int64_t e) {
    float sums[kExpandTokens * kExpandColumns];
    for (int64_t i = b; i < e; ++i) {
      const Task& task = expands[i];
      const int64_t columns = std::min(kExpandColumns, out_padded - task.column);
      gemm_f32(task.count, columns, rank, h.data() + task.first * rank, rank,
               b_t.data() + task.used_index * rank * out_padded + task.column, out_padded, sums,
               columns, false);
      const int64_t width = std::min(columns, out - task.column);
      for (int64_t m = 0; m < task.count; ++m)
        add_to_row(y_data + groups.order[task.first + m] * ldy + task.column, sums + m * columns,
                   width);
    }
  });
}

void add_lora_cpu(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
                  const at::Tensor& lora_b, const at::Tensor& token_slots) {
  check_lora_inputs(y, x, lora_a, lora_b, token_slots);
  const auto slots = token_slots.contiguous();
  // Every slot is checked before anything is written: bad input leaves y unchanged.
  check_token_slot_values(slots, lora_a.size(0));
  if (x.size(0) == 0 || y.size(1) == 0) return;
  const SlotGroups groups =
      group_by_slot(slots.const_data_ptr<int32_t>(), x.size(0), lora_a.size(0));
  if (groups.order.empty()) return;
  const auto x_rows = x.size(1) <= 1 || x.stride(1) == 1 ? x : x.contiguous();
  const auto a = lora_a.contiguous(), b = lora_b.contiguous();
  FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fastllm::add_lora_cpu", [&] {
    add_lora_groups<scalar_t>(y, x_rows, a.const_data_ptr<scalar_t>(),
                              b.const_data_ptr<scalar_t>(), groups, lora_a.size(1));
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CPU, m) { m.impl("add_lora", &add_lora_cpu); }

}  // namespace fastllm
