// The CPU's kernels for a format, one set per instruction set, each compiled in its own
// translation unit with that set's flags (quantized_cpu_<isa>.cpp) and picked at run time
// (common/cpu_isa.h): the decode path (a few activation rows against streamed weight rows) and
// the dequantization of weight rows (the prefill path's tiles, ops.dequantize); and what the
// CPU ops that run them share (quantized_cpu.cpp, moe_cpu.cpp): the choice between them and the
// activations' quantization. Torch-free.
#pragma once

#include <cstdint>
#include <vector>

#include "quantized/block_formats.h"

namespace fastllm {

// Largest magnitude of the activations' int16: the largest x whose bytes split as
// x = 256 * high + low with both signed bytes (the form 8-bit dot products take).
constexpr int kActivationMax = 127 * 256 + 127;
// Q4_0's and the K-quants' decode rows take activations of one signed byte (high is 0): one
// 8-bit dot product per 4 values instead of two, as llama.cpp does (q8_0, q8_K), with a scale
// per 32 values: SmolLM2's Q4_0 and Q4_K_M rewrites still answer "Paris" and agree with HF's
// greedy tokens. The other formats keep int16: with bytes, the shipped SmolLM2 Q4_1 would not
// answer "Paris" (tests/models/test_smollm2.py).
constexpr int kByteActivationMax = 127;

template <BlockFormat F>
constexpr bool kByteActivations = F == BlockFormat::kQ4_0 || F == BlockFormat::kQ4_K ||
                                  F == BlockFormat::kQ5_K || F == BlockFormat::kQ6_K;

// The activations' largest integer for decode rows of `format`.
inline int activation_max(BlockFormat format) {
  return visit_block_format(format, [](auto f) {
    return kByteActivations<decltype(f)::value> ? kByteActivationMax : kActivationMax;
  });
}

// Activation rows quantized per sub-block of 32 values to integers (|x| <= activation_max)
// with one float scale each, also split into bytes.
struct ActivationBlocks {
  int64_t rows = 0, blocks = 0;   // blocks of 32 per row
  const int16_t* values;          // [rows, blocks * 32]
  const int8_t* high;             // [rows, blocks * 32]: x = 256 * high + low
  const int8_t* low;
  const float* scales;            // [rows, blocks]
  const float* sums;              // [rows, blocks]: scale * the sum of the block's values
};

// y[m * ldy + n] = (activation row m) . (weight row n) + bias[n] (bias may be null), for every
// activation row m and the weight rows n in [begin, end) (w: rows of ldw bytes).
using DecodeRowsFn = void (*)(const ActivationBlocks& x, const uint8_t* w, int64_t ldw,
                              int64_t begin, int64_t end, const float* bias, float* y,
                              int64_t ldy);

// Weight rows [begin, end) as float32, in_features values each, from out on.
using DequantizeRowsFn = void (*)(const uint8_t* w, int64_t ldw, int64_t begin, int64_t end,
                                  int64_t in_features, float* out);

// y[m * ldy + n] = x[m] . (weight row n) + bias[n] (bias may be null) for every row m of x
// (float32 [rows, k_len], dense) and the weight rows n in [begin, end): the prefill path.
using GemmRowsFn = void (*)(const float* x, int64_t rows, int64_t k_len, const uint8_t* w,
                            int64_t ldw, int64_t begin, int64_t end, const float* bias,
                            float* y, int64_t ldy);

struct CpuKernels {
  DecodeRowsFn decode_rows;
  DequantizeRowsFn dequantize_rows;
  GemmRowsFn gemm_rows;
  // Prefill rows from byte activations (Q4_0, the K-quants), where the instruction set has
  // them; else null.
  DecodeRowsFn byte_gemm_rows;
  // Decode rows of the interleaved layout (block_formats.h: kInterleavedTypes; begin and end
  // whole groups of rows), where the instruction set has them (AVX-512: Q4_0, Q4_1, Q5_0,
  // Q8_0, Q4_K, Q6_K; AVX2: Q4_0, Q4_1, Q5_0, Q8_0); else null.
  DecodeRowsFn interleaved_decode_rows = nullptr;
  // FP8's decode rows (block_formats.h: kFp8E4M3), from float32 activations as they are: its
  // kernels set this and no decode_rows.
  GemmRowsFn float_decode_rows = nullptr;
};

// The kernels for `format`; null where the translation unit was built without its instruction
// set (a build for another architecture).
CpuKernels cpu_kernels_avx512(BlockFormat format);
CpuKernels cpu_kernels_avx2(BlockFormat format);
CpuKernels cpu_kernels_scalar(BlockFormat format);

// The kernels of the instruction set in use (common/cpu_isa.h).
CpuKernels isa_kernels(BlockFormat format);

// Up to this many activation rows the integer kernel streams the weights once for all of them;
// past it the product is compute-bound and a GEMM wins (decode rows and prefill rows differ in
// their last bits: int16 activations against a GEMM's, or the byte GEMM's sums in another
// order; the byte GEMM wins from fewer rows, quantized_cpu.cpp). The dequantize + GEMM path
// pays for dequantizing the whole weight, so it wins only well past this many rows; up to it
// streaming is faster, which covers a draft model's catch-up chunk, a verification step or a
// batch of 32 decodes.
constexpr int64_t kMaxStreamRows = 32;

// Activations quantized per row and block of 32 to integers of at most `max` with one float
// scale (amax / max): int16 (kActivationMax) is exact to about 1e-5 of the block's largest
// value, where ggml's int8 activations (1/127) flip near-tied logits; Q4_0 and the K-quants
// take bytes (kByteActivations). Each block keeps its scaled sum too, for the weights' offsets:
// sum_j (s q_j + o) x_j = s sum_j q_j x_j + o sum_j x_j.
struct QuantizedActivations {
  int64_t rows = 0, blocks = 0;
  std::vector<int16_t> values;
  std::vector<int8_t> high, low;
  std::vector<float> scales, sums;

  ActivationBlocks view() const {
    return {rows, blocks, values.data(), high.data(), low.data(), scales.data(), sums.data()};
  }
  // Rows [first, first + count) alone.
  ActivationBlocks view(int64_t first, int64_t count) const {
    const int64_t values_at = first * blocks * kSubBlockValues, blocks_at = first * blocks;
    return {count, blocks, values.data() + values_at, high.data() + values_at,
            low.data() + values_at, scales.data() + blocks_at, sums.data() + blocks_at};
  }
};

// x [rows, k_len] (dense, k_len a multiple of 32; float, c10::BFloat16 or c10::Half) quantized
// for decode rows, with integers of at most max_value (activation_max of the weight's format).
template <typename x_t>
QuantizedActivations quantize_activations(const x_t* x, int64_t rows, int64_t k_len,
                                          int max_value);

}  // namespace fastllm
