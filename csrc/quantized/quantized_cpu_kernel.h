// The quantized CPU kernels (decode rows, dequantization), written once over an instruction
// set's primitives `Isa` and compiled per instruction set: quantized_cpu_<isa>.cpp defines its
// Isa and includes this. Torch-free.
//
// Decode rows: each sub-block of 32 values is an integer dot product of the weight's integers
// with the activations' int16, scaled by one float (the weight's scale times the
// activations'), plus the weight's offset times the activations' block sum. Scales and offsets
// are decoded once per weight row and unit of 8 sub-blocks (a K-quant's super-block: once per
// block), and multiplied by the activations' as vectors of 8.
//
// A row's result never depends on the other rows in the batch: every (activation row, weight
// row) pair takes the same operations in the same order whatever the tile around it. The
// kernels' files are compiled with -ffp-contract=off (CMakeLists.txt), so the compiler fuses
// no multiply-add on its own (it could do so in one tile size and not another).
//
// What an Isa provides:
//   kActRows, kTileRows<F>      activation rows and weight rows of a register tile
//   kOneRowTileRows<F>          weight rows of a tile for a single activation row
//   Acc                         float lanes of partial sums
//   weights<F, kSub>(block)     sub-block kSub's integers (block_formats.h's sub_block_ints),
//                               in the form the Isa multiplies format F's in
//   kSignedQ8_0                 whether weights<kQ8_0> are Q8_0's int8 as stored (no offset),
//                               not sub_block_ints' unsigned ones
//   activations<F>(x, i)        activation sub-block i in the matching form
//   zero(), sum(acc)            an empty accumulator; the sum of its lanes, in a fixed order
//   dot_fma(w, x, scale, acc)   acc + *scale * (w . x), spread over the lanes
//   store_values(w, scale, offset, out)   out[j] = scale * w_j + offset, the 32 values (the
//                               product is exact, so a fused multiply-add rounds as ggml does)
//   Floats, kFloats             a float vector and its lanes (the prefill GEMM's)
//   kGemmRows, kGemmVecs        the GEMM's register tile: activation rows x weight-row vectors
//   load(p), broadcast(p), fmadd(a, b, c), store(p, v)   on Floats
// and for FP8 (block_formats.h: kFp8E4M3), whose decode rows take float32 activations:
//   Fp8Values, fp8_values(codes)  a block's 32 codes as float16 values (fp8_half_bits: e4m3's
//                               times 2^-8), in float lanes
//   fp8_dot(v, x)               Floats whose lanes sum to v . x[0..31] (in a fixed order)
//   fp8_store(v, scale, out)    out[j] = scale * e4m3(code j), rounded once
//   kFp8ActRows, kFp8TileRows   activation rows and weight rows of an FP8 decode tile
//   mul(a, b), sum(v)           on Floats
// and, where kByteGemm (the prefill byte GEMM of the formats with byte activations):
//   Quads, kByteGemmRows        an integer vector of kFloats 32-bit lanes of 4 bytes each (a weight
//                               row's 4 consecutive unsigned integers, or an activation row's 4
//                               int8); the GEMM's register tile: activation rows x 2 Quads
//   store_bytes(p, w)           the 32 unsigned integers weights<F, kSub> gave, as bytes
//                               (Q6_K's as stored: 0..63, its int8 scales not applied)
//   load_quads(p), broadcast_quad(p), zero_quads()
//   kPartialSumQuads<F>         how many groups of 4 values' products one partial sum holds
//   add_quad_products(w, x, a)  partial sums a + the products w x of each lane
//   lane_sums(a)                the partial sums as int32, one per lane of 4 bytes
//   add_ints(a, b)              int32 lanes; mul(a, b) on Floats
//   scale_ints(ints, scale, acc)   acc + float(ints) * scale
#pragma once

#include <algorithm>
#include <utility>
#include <vector>

#include "quantized/quantized_cpu.h"

namespace fastllm {
namespace {

// One float per sub-block of a unit: 8 as a vector (GCC's and Clang's vector extension: one
// instruction whatever the ISA).
template <int S>
struct SubBlockFloatsOf {
  using type = float;
};
template <>
struct SubBlockFloatsOf<8> {
  typedef float type __attribute__((vector_size(8 * sizeof(float))));
};
template <int S>
using SubBlockFloats = typename SubBlockFloatsOf<S>::type;

template <int S>
inline SubBlockFloats<S> load_floats(const float* p) {
  SubBlockFloats<S> v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// Whether the Isa's integers for format F are signed, so the weights' offsets are all 0.
template <class Isa, BlockFormat F>
constexpr bool kSignedInts = F == BlockFormat::kQ8_0 && Isa::kSignedQ8_0;
template <class Isa, BlockFormat F>
constexpr bool kOffsets = kHasOffset<F> && !kSignedInts<Isa, F>;

// Sub-blocks are taken in units of 8: a K-quant's block, or 8 blocks of the other formats,
// whose scales are handled as vectors; a row's last blocks of those, fewer than 8, one by one.
constexpr int kUnit = 8;
// Each unit asks for the same unit of the weight rows this far below (two register tiles on):
// a tile's rows are few short streams that the hardware prefetcher follows too late, so without
// it a decode product draws far less than the memory bandwidth. Into L2, not L1: a core has far
// more L2 misses in flight than L1 ones. A prefetch past the weight's end is dropped, never a
// fault.
constexpr int kPrefetchRows = 8;
constexpr int kPrefetchIntoL2 = 2;  // __builtin_prefetch's locality for _MM_HINT_T1

// The interleaved layouts' kernels (block_formats.h: kInterleavedTypes): each group of rows is
// one stream of bytes, fetched this far ahead (into L1) of the block in use: far enough to hide
// the memory's latency, which nearer distances do not.
constexpr int64_t kInterleavedPrefetchBytes = 4608;

template <int64_t kBlockBytes>
inline void prefetch_interleaved(const uint8_t* block) {
  for (int64_t line = 0; line < kBlockBytes; line += 64)
    __builtin_prefetch(block + kInterleavedPrefetchBytes + line, 0, 3);  // _MM_HINT_T0
}

// Adds sub-blocks [first, first + U) of activation rows row0.. and weight rows 0..R - 1 to the
// accumulators and, per position in the unit, to the offset sums.
template <class Isa, BlockFormat F, int M, int R, int U>
inline void dot_unit(const ActivationBlocks& x, int64_t row0, const uint8_t* w, int64_t ldw,
                     int64_t first, typename Isa::Acc (&acc)[M][R],
                     SubBlockFloats<U> (&offsets)[M][R]) {
  constexpr int S = kSubBlocks<F>;
  constexpr int64_t bytes = block_layout(F).bytes;
  using Floats = SubBlockFloats<U>;
  const uint8_t* blocks[R];  // the unit's first block in each weight row
  Floats scale[R], offset[R];
  for (int r = 0; r < R; ++r) {
    blocks[r] = w + r * ldw + first / S * bytes;
    for (int64_t line = 0; line < U / S * bytes; line += 64)
      __builtin_prefetch(blocks[r] + kPrefetchRows * ldw + line, 0, kPrefetchIntoL2);
    float s[U], o[U];
    unit_affine<F, U>(blocks[r], s, o);
    scale[r] = load_floats<U>(s);
    offset[r] = load_floats<U>(o);
  }
  // Weight scale * activation scale, kept in memory: each sub-block's product broadcasts from
  // there in one load, where taking a lane of a register costs shuffles on the vector ports.
  alignas(32) float combined[M][R][U];
  for (int m = 0; m < M; ++m) {
    const int64_t i = (row0 + m) * x.blocks + first;  // the activations' first sub-block
    const Floats x_scale = load_floats<U>(x.scales + i);
    for (int r = 0; r < R; ++r) {
      const Floats product = scale[r] * x_scale;
      __builtin_memcpy(combined[m][r], &product, sizeof(product));
    }
    if constexpr (kOffsets<Isa, F>) {
      const Floats x_sum = load_floats<U>(x.sums + i);
      for (int r = 0; r < R; ++r) offsets[m][r] += offset[r] * x_sum;
    }
  }
  // The sub-blocks, unrolled: each one's place is a constant to the decoding.
  [&]<int... kSub>(std::integer_sequence<int, kSub...>) {
    ([&] {
      decltype(Isa::template activations<F>(x, 0)) xs[M];
      for (int m = 0; m < M; ++m)
        xs[m] = Isa::template activations<F>(x, (row0 + m) * x.blocks + first + kSub);
      for (int r = 0; r < R; ++r) {
        const auto wq = Isa::template weights<F, kSub % S>(blocks[r] + kSub / S * bytes);
        for (int m = 0; m < M; ++m)
          acc[m][r] = Isa::dot_fma(wq, xs[m], &combined[m][r][kSub], acc[m][r]);
      }
    }(), ...);
  }(std::make_integer_sequence<int, U>());
}

// out[m][r] = (activation row row0 + m) . (weight row r), for M activation and R weight rows.
template <class Isa, BlockFormat F, int M, int R>
inline void dot_tile(const ActivationBlocks& x, int64_t row0, const uint8_t* w, int64_t ldw,
                     float (&out)[M][R]) {
  typename Isa::Acc acc[M][R];
  SubBlockFloats<kUnit> offsets[M][R];
  SubBlockFloats<1> last_offsets[M][R];
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      acc[m][r] = Isa::zero();
      offsets[m][r] = SubBlockFloats<kUnit>{};
      last_offsets[m][r] = 0.f;
    }
  }
  const int64_t units = x.blocks / kUnit;  // a K-quant row is whole units
  for (int64_t u = 0; u < units; ++u)
    dot_unit<Isa, F, M, R, kUnit>(x, row0, w, ldw, u * kUnit, acc, offsets);
  if constexpr (kSubBlocks<F> == 1)
    for (int64_t i = units * kUnit; i < x.blocks; ++i)
      dot_unit<Isa, F, M, R, 1>(x, row0, w, ldw, i, acc, last_offsets);
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      float offset = last_offsets[m][r];
      for (int s = 0; s < kUnit; ++s) offset += offsets[m][r][s];
      out[m][r] = Isa::sum(acc[m][r]) + offset;
    }
  }
}

// Calls run(std::integral_constant<int, R>(), m) for tiles of R = MR rows from m = 0 on, then
// for the last rows, fewer than MR, as a tile of their number: every row of [0, rows) once.
template <int MR, class Run>
inline void for_row_tiles(int64_t rows, const Run& run) {
  int64_t m = 0;
  for (; m + MR <= rows; m += MR) run(std::integral_constant<int, MR>(), m);
  [&]<int... kRows>(std::integer_sequence<int, kRows...>) {
    ((rows - m == kRows + 1 ? run(std::integral_constant<int, kRows + 1>(), m) : void()), ...);
  }(std::make_integer_sequence<int, MR - 1>());
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
  for_row_tiles<Isa::kActRows>(x.rows, run);
}

template <class Isa, BlockFormat F>
void decode_rows(const ActivationBlocks& x, const uint8_t* w, int64_t ldw, int64_t begin,
                 int64_t end, const float* bias, float* y, int64_t ldy) {
  constexpr int kOneRowTile = Isa::template kOneRowTileRows<F>, kTile = Isa::template kTileRows<F>;
  int64_t n = begin;
  if (x.rows == 1)
    for (; n + kOneRowTile <= end; n += kOneRowTile)
      tile_all_rows<Isa, F, kOneRowTile>(x, w + n * ldw, ldw, bias, y, ldy, n);
  for (; n + kTile <= end; n += kTile)
    tile_all_rows<Isa, F, kTile>(x, w + n * ldw, ldw, bias, y, ldy, n);
  for (; n < end; ++n) tile_all_rows<Isa, F, 1>(x, w + n * ldw, ldw, bias, y, ldy, n);
}

template <class Isa, BlockFormat F>
void dequantize_rows(const uint8_t* w, int64_t ldw, int64_t begin, int64_t end,
                     int64_t in_features, float* out) {
  constexpr BlockLayout layout = block_layout(F);
  constexpr int S = kSubBlocks<F>;
  for (int64_t n = begin; n < end; ++n) {
    for (int64_t b = 0; b < in_features / layout.values; ++b) {
      const uint8_t* block = w + n * ldw + b * layout.bytes;
      float* values = out + (n - begin) * in_features + b * layout.values;
      float scale[S], offset[S];
      block_affine<F>(block, scale, offset);
      if constexpr (kSignedInts<Isa, F>) offset[0] = 0.f;
      [&]<int... kSub>(std::integer_sequence<int, kSub...>) {
        (Isa::store_values(Isa::template weights<F, kSub>(block), scale[kSub], offset[kSub],
                           values + kSub * kSubBlockValues), ...);
      }(std::make_integer_sequence<int, S>());
    }
  }
}

// c[m][j] += sum_k x[m * ldx + k] * panel[k * kCols + j] over k < k_len, for MR activation
// rows and a panel's kCols weight rows laid out k-major: each k, one load of the panel per
// weight-row vector and one broadcast per activation row, the sums in registers.
template <class Isa, int MR>
inline void gemm_tile(const float* x, int64_t ldx, int64_t k_len, const float* panel,
                      float* c, int64_t ldc) {
  constexpr int V = Isa::kGemmVecs, W = Isa::kFloats;
  typename Isa::Floats acc[MR][V];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < V; ++v) acc[m][v] = Isa::load(c + m * ldc + v * W);
  for (int64_t k = 0; k < k_len; ++k) {
    typename Isa::Floats b[V];
    for (int v = 0; v < V; ++v) b[v] = Isa::load(panel + k * V * W + v * W);
    for (int m = 0; m < MR; ++m) {
      const auto a = Isa::broadcast(x + m * ldx + k);
      for (int v = 0; v < V; ++v) acc[m][v] = Isa::fmadd(a, b[v], acc[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < V; ++v) Isa::store(c + m * ldc + v * W, acc[m][v]);
}

// Prefill rows, compute-bound: y[m * ldy + n] = x[m] . (weight row n) (+ bias[n]) for every
// activation row m (x: float32 [rows, k_len], dense) and weight rows n in [begin, end). A few
// panels of kCols weight rows at a time are dequantized (kDequantizeRows: the format's) and
// laid out k-major; then, a block of
// kBlockK values of k at a time (the panels' block stays in L1 and L2), every tile of
// activation rows adds its products to float32 sums kept for the panels' columns. Each
// (row, weight row) sum runs over k in order whatever the tile, so a row's result does not
// depend on the others.
template <class Isa, DequantizeRowsFn kDequantizeRows>
void gemm_rows(const float* x, int64_t rows, int64_t k_len, const uint8_t* w, int64_t ldw,
               int64_t begin, int64_t end, const float* bias, float* y, int64_t ldy) {
  constexpr int MR = Isa::kGemmRows, kCols = Isa::kGemmVecs * Isa::kFloats;
  constexpr int kPanels = 4, kGroupCols = kPanels * kCols;
  constexpr int64_t kBlockK = 128;
  std::vector<float> dequantized(int64_t(kCols) * k_len), panels(kGroupCols * k_len);
  std::vector<float> sums(rows * kGroupCols);
  for (int64_t n0 = begin; n0 < end; n0 += kGroupCols) {
    const int64_t group_cols = std::min<int64_t>(kGroupCols, end - n0);
    const int n_panels = int((group_cols + kCols - 1) / kCols);
    for (int p = 0; p < n_panels; ++p) {
      const int64_t cols = std::min<int64_t>(kCols, group_cols - p * kCols);
      kDequantizeRows(w, ldw, n0 + p * kCols, n0 + p * kCols + cols, k_len, dequantized.data());
      float* panel = panels.data() + p * kCols * k_len;
      for (int64_t k = 0; k < k_len; ++k)
        for (int j = 0; j < kCols; ++j)
          panel[k * kCols + j] = j < cols ? dequantized[j * k_len + k] : 0.f;
    }
    std::fill(sums.begin(), sums.end(), 0.f);
    for (int64_t k0 = 0; k0 < k_len; k0 += kBlockK) {
      const int64_t block = std::min(kBlockK, k_len - k0);
      const auto run = [&](auto tile_rows, int64_t m) {
        for (int p = 0; p < n_panels; ++p)
          gemm_tile<Isa, decltype(tile_rows)::value>(
              x + m * k_len + k0, k_len, block, panels.data() + (p * k_len + k0) * kCols,
              sums.data() + m * kGroupCols + p * kCols, kGroupCols);
      };
      for_row_tiles<MR>(rows, run);
    }
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t j = 0; j < group_cols; ++j)
        y[m * ldy + n0 + j] = sums[m * kGroupCols + j] + (bias ? bias[n0 + j] : 0.f);
  }
}

// Scale groups of a sub-block in the byte GEMM: Q6_K's int8 scales change every 16 values.
template <BlockFormat F>
constexpr int kScaleGroups = F == BlockFormat::kQ6_K ? 2 : 1;

// Prefill rows of the formats with byte activations (Q4_0 and the K-quants), compute-bound:
// y[m * ldy + n] = (activation row m) . (weight row n) (+ bias[n]) from byte activations, as
// decode_rows, with the weight rows' unsigned integers repacked a panel of kCols rows at a
// time so that each 32-bit lane holds 4 consecutive integers of one row: one 8-bit multiply-add
// of a panel vector and 4 of an activation row's bytes (broadcast) is 4 products a lane, where
// a float GEMM's multiply-add is 1. Each scale group's integer sums are exact; the float sums
// run over the groups in order whatever the tile, so a row's result does not depend on the
// others.
template <class Isa, BlockFormat F>
void byte_gemm_rows(const ActivationBlocks& x, const uint8_t* w, int64_t ldw, int64_t begin,
                    int64_t end, const float* bias, float* y, int64_t ldy) {
  constexpr int S = kSubBlocks<F>, MR = Isa::kByteGemmRows, G = kScaleGroups<F>;
  constexpr int kQuads = kSubBlockValues / 4, kGroupQuads = kQuads / G;
  constexpr int kLanes = Isa::kFloats, kCols = 2 * kLanes;
  constexpr int kPartQuads = std::min(kGroupQuads, Isa::template kPartialSumQuads<F>);
  constexpr int kParts = kGroupQuads / kPartQuads;
  constexpr int64_t bytes = block_layout(F).bytes;
  const int64_t blocks = x.blocks, k_len = blocks * kSubBlockValues;
  // Each scale group's activation sum times the sub-block's scale: the blocks' own sums, or
  // Q6_K's halves.
  std::vector<float> group_sums(G == 1 ? 0 : x.rows * blocks * G);
  for (int64_t i = 0; i < int64_t(group_sums.size()); ++i) {
    int32_t sum = 0;
    for (int64_t v = 0; v < kSubBlockValues / G; ++v) sum += x.low[i * (kSubBlockValues / G) + v];
    group_sums[i] = x.scales[i / G] * float(sum);
  }
  const float* x_sums = G == 1 ? x.sums : group_sums.data();
  // A panel: per sub-block, its kQuads groups of 4 integers of each of the kCols weight rows;
  // and the rows' scales and offsets per scale group.
  std::vector<uint8_t> quads(blocks * kQuads * kCols * 4);
  std::vector<float> scales(blocks * G * kCols), offsets(blocks * G * kCols);
  for (int64_t n0 = begin; n0 < end; n0 += kCols) {
    const int cols = int(std::min<int64_t>(kCols, end - n0));
    for (int j = 0; j < kCols; ++j) {
      // Rows past the weight's end: a copy of its last row, whose results are not stored.
      const uint8_t* row = w + (n0 + std::min(j, cols - 1)) * ldw;
      for (int64_t b = 0; b < blocks / S; ++b) {
        const uint8_t* block = row + b * bytes;
        float scale[S], offset[S];
        block_affine<F>(block, scale, offset);
        [&]<int... kSub>(std::integer_sequence<int, kSub...>) {
          ([&] {
            const int64_t sub = b * S + kSub;
            alignas(32) uint8_t ints[kSubBlockValues];
            Isa::store_bytes(ints, Isa::template weights<F, kSub>(block));
            for (int q = 0; q < kQuads; ++q)
              __builtin_memcpy(&quads[((sub * kQuads + q) * kCols + j) * 4], ints + 4 * q, 4);
            for (int g = 0; g < G; ++g) {
              const int64_t at = (sub * G + g) * kCols + j;
              if constexpr (F == BlockFormat::kQ6_K) {  // d * the group's int8 scale, exact
                scales[at] = scale[kSub] * float(int8_t(block[192 + G * kSub + g]));
                offsets[at] = -32.f * scales[at];
              } else {
                scales[at] = scale[kSub];
                offsets[at] = offset[kSub];
              }
            }
          }(), ...);
        }(std::make_integer_sequence<int, S>());
      }
    }
    const auto run = [&](auto tile_rows, int64_t m0) {
      constexpr int R = decltype(tile_rows)::value;
      constexpr float kZero = 0.f;
      typename Isa::Floats acc[R][2];
      for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = Isa::broadcast(&kZero);
      for (int64_t sub = 0; sub < blocks; ++sub) {
        for (int g = 0; g < G; ++g) {
          const uint8_t* panel = quads.data() + (sub * kQuads + g * kGroupQuads) * kCols * 4;
          typename Isa::Quads ints[R][2];
          for (int m = 0; m < R; ++m) ints[m][0] = ints[m][1] = Isa::zero_quads();
          for (int part = 0; part < kParts; ++part) {
            typename Isa::Quads partial[R][2];
            for (int m = 0; m < R; ++m) partial[m][0] = partial[m][1] = Isa::zero_quads();
            for (int q = part * kPartQuads; q < (part + 1) * kPartQuads; ++q) {
              const typename Isa::Quads w0 = Isa::load_quads(panel + q * kCols * 4);
              const typename Isa::Quads w1 = Isa::load_quads(panel + (q * kCols + kLanes) * 4);
              for (int m = 0; m < R; ++m) {
                const auto xq = Isa::broadcast_quad(x.low + (m0 + m) * k_len +
                                                    sub * kSubBlockValues +
                                                    4 * (g * kGroupQuads + q));
                partial[m][0] = Isa::add_quad_products(w0, xq, partial[m][0]);
                partial[m][1] = Isa::add_quad_products(w1, xq, partial[m][1]);
              }
            }
            for (int m = 0; m < R; ++m)
              for (int v = 0; v < 2; ++v)
                ints[m][v] = Isa::add_ints(ints[m][v], Isa::lane_sums(partial[m][v]));
          }
          const float* group_scales = scales.data() + (sub * G + g) * kCols;
          const float* group_offsets = offsets.data() + (sub * G + g) * kCols;
          for (int m = 0; m < R; ++m) {
            const int64_t i = (m0 + m) * blocks + sub;
            const auto x_scale = Isa::broadcast(x.scales + i);
            const auto x_sum = Isa::broadcast(x_sums + i * G + g);
            for (int v = 0; v < 2; ++v) {
              const auto combined = Isa::mul(Isa::load(group_scales + v * kLanes), x_scale);
              acc[m][v] = Isa::scale_ints(ints[m][v], combined, acc[m][v]);
              acc[m][v] = Isa::fmadd(Isa::load(group_offsets + v * kLanes), x_sum, acc[m][v]);
            }
          }
        }
      }
      for (int m = 0; m < R; ++m) {
        alignas(32) float out[kCols];
        Isa::store(out, acc[m][0]);
        Isa::store(out + kLanes, acc[m][1]);
        for (int j = 0; j < cols; ++j)
          y[(m0 + m) * ldy + n0 + j] = out[j] + (bias ? bias[n0 + j] : 0.f);
      }
    };
    for_row_tiles<MR>(x.rows, run);
  }
}

// FP8 (block_formats.h: kFp8E4M3). Decode rows stream the weight's bytes once and take the
// activations as they are (float32): per block, the 32 codes decoded in registers, their dot
// product with the activations in float lanes, then one multiply-add by the block's scale into
// one of two accumulators (even and odd blocks: two chains of multiply-adds in flight). The
// 2^8 the codes' float16 values lack is applied to the row's sum (a power of two: exact).
inline float fp8_block_scale(const uint8_t* block) {
  float scale;
  __builtin_memcpy(&scale, block, sizeof(scale));
  return scale;
}

// out[m][r] = (activation row m: x + m * ldx) . (weight row r: w + r * ldw), for M activation
// and R weight rows of `blocks` blocks.
template <class Isa, int M, int R>
inline void fp8_tile(const float* x, int64_t ldx, int64_t blocks, const uint8_t* w, int64_t ldw,
                     float (&out)[M][R]) {
  using Floats = typename Isa::Floats;
  constexpr int64_t kBytes = block_layout(BlockFormat::kFp8E4M3).bytes;
  constexpr float kZero = 0.f;
  Floats acc[2][M][R];
  for (int p = 0; p < 2; ++p)
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[p][m][r] = Isa::broadcast(&kZero);
  const auto add_block = [&](int64_t b, auto parity) {
    constexpr int P = decltype(parity)::value;
    for (int r = 0; r < R; ++r) {
      const uint8_t* block = w + r * ldw + b * kBytes;
      const auto values = Isa::fp8_values(block + 4);
      const float scale_value = fp8_block_scale(block);
      const Floats scale = Isa::broadcast(&scale_value);
      for (int m = 0; m < M; ++m)
        acc[P][m][r] = Isa::fmadd(Isa::fp8_dot(values, x + m * ldx + b * kSubBlockValues), scale,
                                  acc[P][m][r]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    add_block(b, std::integral_constant<int, 0>());
    add_block(b + 1, std::integral_constant<int, 1>());
  }
  if (b < blocks) add_block(b, std::integral_constant<int, 0>());
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r)
      out[m][r] = (Isa::sum(acc[0][m][r]) + Isa::sum(acc[1][m][r])) * 256.f;
}

// Decode rows (CpuKernels::float_decode_rows): y[m * ldy + n] = x[m] . (weight row n) (+ bias[n])
// for every activation row m (x: float32 [rows, k_len], dense) and weight rows n in
// [begin, end), each tile of weight rows read once for all the activation rows.
template <class Isa>
void fp8_decode_rows(const float* x, int64_t rows, int64_t k_len, const uint8_t* w, int64_t ldw,
                     int64_t begin, int64_t end, const float* bias, float* y, int64_t ldy) {
  const int64_t blocks = k_len / kSubBlockValues;
  const auto tile = [&](auto weight_rows, int64_t n) {
    constexpr int R = decltype(weight_rows)::value;
    for_row_tiles<Isa::kFp8ActRows>(rows, [&](auto activation_rows, int64_t m) {
      constexpr int M = decltype(activation_rows)::value;
      float sums[M][R];
      fp8_tile<Isa, M, R>(x + m * k_len, k_len, blocks, w + n * ldw, ldw, sums);
      for (int i = 0; i < M; ++i)
        for (int r = 0; r < R; ++r)
          y[(m + i) * ldy + n + r] = sums[i][r] + (bias ? bias[n + r] : 0.f);
    });
  };
  int64_t n = begin;
  for (; n + Isa::kFp8TileRows <= end; n += Isa::kFp8TileRows)
    tile(std::integral_constant<int, Isa::kFp8TileRows>(), n);
  for (; n < end; ++n) tile(std::integral_constant<int, 1>(), n);
}

template <class Isa>
void fp8_dequantize_rows(const uint8_t* w, int64_t ldw, int64_t begin, int64_t end,
                         int64_t in_features, float* out) {
  constexpr int64_t kBytes = block_layout(BlockFormat::kFp8E4M3).bytes;
  for (int64_t n = begin; n < end; ++n) {
    for (int64_t b = 0; b < in_features / kSubBlockValues; ++b) {
      const uint8_t* block = w + n * ldw + b * kBytes;
      Isa::fp8_store(Isa::fp8_values(block + 4), fp8_block_scale(block),
                     out + (n - begin) * in_features + b * kSubBlockValues);
    }
  }
}

template <class Isa>
CpuKernels cpu_kernels_for(BlockFormat format) {
  return visit_block_format(format, [](auto f) {
    constexpr BlockFormat F = decltype(f)::value;
    if constexpr (F == BlockFormat::kFp8E4M3) {
      CpuKernels kernels{nullptr, &fp8_dequantize_rows<Isa>,
                         &gemm_rows<Isa, &fp8_dequantize_rows<Isa>>, nullptr};
      kernels.float_decode_rows = &fp8_decode_rows<Isa>;
      return kernels;
    } else {
      DecodeRowsFn byte_gemm = nullptr;
      if constexpr (Isa::kByteGemm && kByteActivations<F>) byte_gemm = &byte_gemm_rows<Isa, F>;
      return CpuKernels{&decode_rows<Isa, F>, &dequantize_rows<Isa, F>,
                        &gemm_rows<Isa, &dequantize_rows<Isa, F>>, byte_gemm};
    }
  });
}

}  // namespace
}  // namespace fastllm
