// The decode-path kernel, written once over an instruction set's primitives `Isa` and compiled
// per instruction set: quantized_cpu_<isa>.cpp defines its Isa and includes this. Torch-free.
//
// Each sub-block of 32 values is an integer dot product of the weight's integers, widened to
// int16, with the activations' int16, scaled by one float (the weight's scale times the
// activations'); a format with minima adds offset * (the activations' block sum) per
// sub-block. A K-quant's scales are decoded once per super-block and weight row.
//
// A row's result never depends on the other rows in the batch: every (activation row, weight
// row) pair takes the same operations in the same order whatever the tile around it, with
// explicit fused multiply-adds (left to the compiler, contraction could differ between tiles).
//
// What an Isa provides:
//   kActRows, kTileRows        activation rows and weight rows of a register tile
//   Ints                       32 int16 (a sub-block)
//   Acc                        float lanes of partial sums
//   weights<F, kSub>(block)    sub-block kSub's integers (block_formats.h's sub_block_ints)
//   activations(p)             32 int16 from memory
//   zero(), sum(acc)           an empty accumulator; the sum of its lanes, in a fixed order
//   dot_fma(w, x, scale, acc)  acc + scale * (w . x), spread over the lanes
#pragma once

#include <cmath>
#include <type_traits>
#include <utility>

#include "quantized/quantized_cpu.h"

namespace fastllm {
namespace {

// out[m][r] = (activation row row0 + m) . (weight row r), for M activation and R weight rows.
template <class Isa, BlockFormat F, int M, int R>
inline void dot_tile(const ActivationBlocks& x, int64_t row0, const uint8_t* w, int64_t ldw,
                     float (&out)[M][R]) {
  constexpr int S = kSubBlocks<F>;
  constexpr int64_t bytes = block_layout(F).bytes;
  typename Isa::Acc acc[M][R];
  float offsets[M][R][S] = {};  // per sub-block position, summed at the end
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = Isa::zero();
  for (int64_t b = 0; b < x.blocks / S; ++b) {
    const uint8_t* block[R];
    float scale[R][S], offset[R][S];
    for (int r = 0; r < R; ++r) {
      block[r] = w + r * ldw + b * bytes;
      block_affine<F>(block[r], scale[r], offset[r]);
    }
    const int16_t* xq[M];
    float combined[M][R][S];  // weight scale * activation scale
    for (int m = 0; m < M; ++m) {
      const int64_t i = (row0 + m) * x.blocks + b * S;  // the activations' first sub-block
      xq[m] = x.values + i * kSubBlockValues;
      for (int r = 0; r < R; ++r) {
        for (int s = 0; s < S; ++s) combined[m][r][s] = scale[r][s] * x.scales[i + s];
        if constexpr (kHasOffset<F>)
          for (int s = 0; s < S; ++s)
            offsets[m][r][s] = std::fma(offset[r][s], x.sums[i + s], offsets[m][r][s]);
      }
    }
    // The sub-blocks, unrolled: each one's position is a constant to the decoding.
    [&]<int... kSub>(std::integer_sequence<int, kSub...>) {
      ([&] {
        typename Isa::Ints xs[M];
        for (int m = 0; m < M; ++m) xs[m] = Isa::activations(xq[m] + kSub * kSubBlockValues);
        for (int r = 0; r < R; ++r) {
          const auto wq = Isa::template weights<F, kSub>(block[r]);
          for (int m = 0; m < M; ++m)
            acc[m][r] = Isa::dot_fma(wq, xs[m], combined[m][r][kSub], acc[m][r]);
        }
      }(), ...);
    }(std::make_integer_sequence<int, S>());
  }
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      float offset = 0.f;
      for (int s = 0; s < S; ++s) offset += offsets[m][r][s];
      out[m][r] = Isa::sum(acc[m][r]) + offset;
    }
  }
}

// Every activation row against weight rows [n, n + R).
template <class Isa, BlockFormat F, int R>
inline void tile_all_rows(const ActivationBlocks& x, const uint8_t* w, int64_t ldw,
                          const float* bias, float* y, int64_t ldy, int64_t n) {
  const auto run = [&](auto rows, int64_t m) {
    float sums[rows][R];
    dot_tile<Isa, F, rows, R>(x, m, w, ldw, sums);
    for (int i = 0; i < rows; ++i)
      for (int r = 0; r < R; ++r)
        y[(m + i) * ldy + n + r] = sums[i][r] + (bias ? bias[n + r] : 0.f);
  };
  int64_t m = 0;
  for (; m + Isa::kActRows <= x.rows; m += Isa::kActRows)
    run(std::integral_constant<int, Isa::kActRows>(), m);
  // The last rows, fewer than a tile: a tile of their number.
  [&]<int... kRows>(std::integer_sequence<int, kRows...>) {
    ((x.rows - m == kRows + 1 ? run(std::integral_constant<int, kRows + 1>(), m) : void()), ...);
  }(std::make_integer_sequence<int, Isa::kActRows - 1>());
}

template <class Isa, BlockFormat F>
void decode_rows(const ActivationBlocks& x, const uint8_t* w, int64_t ldw, int64_t begin,
                 int64_t end, const float* bias, float* y, int64_t ldy) {
  int64_t n = begin;
  for (; n + Isa::kTileRows <= end; n += Isa::kTileRows)
    tile_all_rows<Isa, F, Isa::kTileRows>(x, w + n * ldw, ldw, bias, y, ldy, n);
  for (; n < end; ++n) tile_all_rows<Isa, F, 1>(x, w + n * ldw, ldw, bias, y, ldy, n);
}

template <class Isa>
DecodeRowsFn decode_rows_for(BlockFormat format) {
  return visit_block_format(format, [](auto f) -> DecodeRowsFn {
    return &decode_rows<Isa, decltype(f)::value>;
  });
}

}  // namespace
}  // namespace fastllm
