// Block-quantized matmul on CUDA, free of torch headers (nvcc compiles it alone in the tests):
// a GEMV for decode rows that streams the weight once in its blocks, and a dequantize kernel for
// prefill rows (the host then multiplies with cuBLAS).
//
// A format is one BlockDecoder specialization: it turns part `part` of a block (its values
// 8 * part .. 8 * part + 7) into the small integers q the block stores (FP8: its codes' values),
// as floats, and the part's affine map w = scale * q + offset; kOffset says whether the map has
// an offset at all. Every kernel is a template over the format, and block_formats.h's
// visit_block_format names each one once.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "common/cuda_types.cuh"
#include "quantized/block_formats.h"

namespace fastllm {
namespace cuda {

constexpr int kPartValues = 8;
// Decode rows the GEMV serves: each is a register accumulator per lane; past them the product is
// compute-bound and the host dequantizes for cuBLAS.
constexpr int kMaxGemvRows = 8;
constexpr int kGemvWarps = 4;  // weight rows per thread block, one per warp
constexpr int kDequantizeThreads = 256;

template <BlockFormat F>
constexpr int64_t kBlockBytes = block_layout(F).bytes;
template <BlockFormat F>
constexpr int64_t kBlockParts = block_layout(F).values / kPartValues;

// A part's affine map: w = scale * q + offset.
struct PartAffine {
  float scale, offset;
};

// An fp16 field of a block, read byte by byte: a weight's rows may start at any byte (a view of
// wider storage).
__host__ __device__ __forceinline__ float load_half(const uint8_t* p) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(p[0] | p[1] << 8)));
}

// Q4_x/Q5_x (fp16 d, [fp16 m], [32-bit qh], 16 bytes): value j in byte j's low nibble, value
// j + 16 in its high one, bit j of qh its fifth bit; w = d (q - zero point), or d q + m.
template <BlockFormat F>
struct SmallBlockDecoder {
  static constexpr bool kMin = F == BlockFormat::kQ4_1 || F == BlockFormat::kQ5_1;
  static constexpr bool kFifthBit = F == BlockFormat::kQ5_0 || F == BlockFormat::kQ5_1;
  static constexpr bool kOffset = kMin;
  __host__ __device__ __forceinline__ static PartAffine decode(const uint8_t* block, int part,
                                                               float (&q)[kPartValues]) {
    const uint8_t* nibbles = block + 2 + (kMin ? 2 : 0) + (kFifthBit ? 4 : 0);
    const uint8_t* bytes = nibbles + (part % 2) * kPartValues;
    const int shift = (part / 2) * 4;
    // The part's 8 fifth bits: byte `part` of the little-endian qh.
    const int fifth = kFifthBit ? nibbles[part - 4] : 0;
    constexpr int zero_point = kMin ? 0 : kFifthBit ? 16 : 8;
    for (int j = 0; j < kPartValues; ++j)
      q[j] = float((((bytes[j] >> shift) & 0x0f) | ((fifth >> j) & 1) << 4) - zero_point);
    return {load_half(block), kMin ? load_half(block + 2) : 0.f};
  }
};

template <BlockFormat F>
struct BlockDecoder : SmallBlockDecoder<F> {};

// fp16 d, 32 int8; w = d q.
template <>
struct BlockDecoder<BlockFormat::kQ8_0> {
  static constexpr bool kOffset = false;
  __host__ __device__ __forceinline__ static PartAffine decode(const uint8_t* block, int part,
                                                               float (&q)[kPartValues]) {
    const uint8_t* bytes = block + 2 + part * kPartValues;
    for (int j = 0; j < kPartValues; ++j) q[j] = float(static_cast<int8_t>(bytes[j]));
    return {load_half(block), 0.f};
  }
};

// Q4_K/Q5_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, [32 bytes of qh], 128 bytes
// of nibbles; sub-block s (parts 4s .. 4s + 3): w = d sc[s] q - dmin m[s].
template <BlockFormat F>
struct KBlockDecoder {
  static constexpr bool kOffset = true;
  __host__ __device__ __forceinline__ static PartAffine decode(const uint8_t* block, int part,
                                                               float (&q)[kPartValues]) {
    constexpr bool kFifthBit = F == BlockFormat::kQ5_K;
    const int s = part / 4, at = (part % 4) * kPartValues;  // sub-block, value within it
    // Bytes 32c.. hold sub-block 2c in their low nibbles, 2c + 1 in their high ones.
    const uint8_t* bytes = block + (kFifthBit ? 48 : 16) + 32 * (s / 2) + at;
    const uint8_t* high = block + 16 + at;  // Q5_K: bit s of byte l, sub-block s's value l
    for (int j = 0; j < kPartValues; ++j)
      q[j] = float(((bytes[j] >> (4 * (s % 2))) & 0x0f) |
                   (kFifthBit ? ((high[j] >> s) & 1) << 4 : 0));
    // The 6-bit scale and min: scales 0-3 in bytes 4-7's low 6 bits, mins 0-3 in bytes 8-11's;
    // 4-7 from bytes 12-15's nibbles, with the top 2 bits of bytes 4-7 (8-11) above them.
    const uint8_t* packed = block + 4;
    const int scale = s < 4 ? packed[s] & 63 : (packed[s + 4] & 15) | (packed[s - 4] >> 6) << 4;
    const int min = s < 4 ? packed[s + 4] & 63 : (packed[s + 4] >> 4) | (packed[s] >> 6) << 4;
    return {load_half(block) * float(scale), -(load_half(block + 2) * float(min))};
  }
};

template <>
struct BlockDecoder<BlockFormat::kQ4_K> : KBlockDecoder<BlockFormat::kQ4_K> {};
template <>
struct BlockDecoder<BlockFormat::kQ5_K> : KBlockDecoder<BlockFormat::kQ5_K> {};

// Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales (one per 16 values), fp16 d;
// per half h of 128 values, value 32k + l (k < 4) has its low bits in byte 64h + 32 (k % 2) + l
// (the high nibble for k >= 2) and its high bits in bits 2k, 2k + 1 of byte 128 + 32h + l;
// w = d sc (q - 32).
template <>
struct BlockDecoder<BlockFormat::kQ6_K> {
  static constexpr bool kOffset = false;
  __host__ __device__ __forceinline__ static PartAffine decode(const uint8_t* block, int part,
                                                               float (&q)[kPartValues]) {
    const int h = part / 16, k = (part % 16) / 4, l = (part % 4) * kPartValues;
    const uint8_t* low = block + 64 * h + 32 * (k % 2) + l;
    const uint8_t* high = block + 128 + 32 * h + l;
    for (int j = 0; j < kPartValues; ++j)
      q[j] = float((((low[j] >> (4 * (k / 2))) & 0x0f) | ((high[j] >> (2 * k)) & 3) << 4) - 32);
    return {load_half(block + 208) * float(static_cast<int8_t>(block[192 + part / 2])), 0.f};
  }
};

// fastllm's FP8 (block_formats.h: kFp8E4M3): a float32 scale, 32 e4m3 codes; w = scale e4m3(q).
// A code is read as the float16 of fp8_half_bits (its value times 2^-8) and the part's scale
// is the block's times 2^8: a power of two, so scale * q is the one rounding of the exact value.
template <>
struct BlockDecoder<BlockFormat::kFp8E4M3> {
  static constexpr bool kOffset = false;
  __host__ __device__ __forceinline__ static PartAffine decode(const uint8_t* block, int part,
                                                               float (&q)[kPartValues]) {
    const uint8_t* codes = block + 4 + part * kPartValues;
    for (int j = 0; j < kPartValues; ++j)
      q[j] = __half2float(__ushort_as_half(fp8_half_bits(codes[j])));
    // Byte by byte, as load_half: a row may start at any byte.
    const uint32_t bits = uint32_t(block[0]) | uint32_t(block[1]) << 8 |
                          uint32_t(block[2]) << 16 | uint32_t(block[3]) << 24;
    float scale;
    memcpy(&scale, &bits, sizeof(scale));
    return {scale * 256.f, 0.f};
  }
};

// f(std::integral_constant<int, rows>()) for 1 <= rows <= kMaxGemvRows.
template <int kRows = 1, typename Visitor>
void visit_gemv_rows(int64_t rows, Visitor&& f) {
  if constexpr (kRows < kMaxGemvRows) {
    if (rows != kRows) return visit_gemv_rows<kRows + 1>(rows, std::forward<Visitor>(f));
  }
  f(std::integral_constant<int, kRows>());
}

// acc[m] = sum_k x[m, k] w[k] for the kRows activation rows m (dense, x_stride apart) and one
// weight row, computed by a whole warp: lane l takes parts l, l + 32, ... of the row
// (consecutive lanes read consecutive bytes), decodes each once for all kRows rows, and adds
// scale * sum_j q_j x_j (+ offset * sum_j x_j) to a float32 accumulator per row; the 32 lanes'
// sums then meet in a fixed butterfly, so every lane ends with the sums. Every acc[m] is the
// same sequence of operations whatever kRows is and whatever the other rows hold (explicit
// fmaf, no contraction left to the compiler), so a row's result does not depend on the batch
// around it.
template <BlockFormat F, int kRows, typename scalar_t>
__device__ __forceinline__ void quantized_row_dots(const scalar_t* __restrict__ x,
                                                   int64_t x_stride,
                                                   const uint8_t* __restrict__ row,
                                                   int64_t k_len, float (&acc)[kRows]) {
  using Decoder = BlockDecoder<F>;
  const int lane = threadIdx.x % 32;
  for (int m = 0; m < kRows; ++m) acc[m] = 0.f;
  const int64_t parts = k_len / kPartValues;
  for (int64_t p = lane; p < parts; p += 32) {
    float q[kPartValues];
    const PartAffine affine = Decoder::decode(row + p / kBlockParts<F> * kBlockBytes<F>,
                                              int(p % kBlockParts<F>), q);
    for (int m = 0; m < kRows; ++m) {
      const scalar_t* xs = x + m * x_stride + p * kPartValues;
      float dot = 0.f, sum = 0.f;
      for (int j = 0; j < kPartValues; ++j) {
        const float xj = to_float(xs[j]);
        dot = fmaf(q[j], xj, dot);
        if constexpr (Decoder::kOffset) sum += xj;
      }
      acc[m] = fmaf(affine.scale, dot, acc[m]);
      if constexpr (Decoder::kOffset) acc[m] = fmaf(affine.offset, sum, acc[m]);
    }
  }
  for (int m = 0; m < kRows; ++m)
    for (int offset = 16; offset > 0; offset /= 2)
      acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], offset);  // a + b == b + a: lanes agree
}

// y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for the kRows activation rows m (x rows dense,
// x_stride apart; y dense [kRows, n_out]): one warp per weight row n (quantized_row_dots).
template <BlockFormat F, int kRows, typename scalar_t>
__global__ void __launch_bounds__(kGemvWarps * 32)
    quantized_gemv_kernel(const scalar_t* __restrict__ x, int64_t x_stride,
                          const uint8_t* __restrict__ w, int64_t w_stride,
                          const scalar_t* __restrict__ bias, scalar_t* __restrict__ y,
                          int64_t n_out, int64_t k_len) {
  const int64_t n = int64_t(blockIdx.x) * kGemvWarps + threadIdx.x / 32;
  if (n >= n_out) return;  // the whole warp: n is the same in all its lanes
  float acc[kRows];
  quantized_row_dots<F, kRows>(x, x_stride, w + n * w_stride, k_len, acc);
  if (threadIdx.x % 32 == 0) {
    const float b = bias != nullptr ? to_float(bias[n]) : 0.f;
    for (int m = 0; m < kRows; ++m) y[m * n_out + n] = from_float<scalar_t>(acc[m] + b);
  }
}

// out[r, k] = w[r, k] for every value of the weight, in out_t: one thread per part (8 values),
// rounded from float32 once, as the CPU does.
template <BlockFormat F, typename out_t>
__global__ void __launch_bounds__(kDequantizeThreads)
    dequantize_kernel(const uint8_t* __restrict__ w, int64_t w_stride, out_t* __restrict__ out,
                      int64_t rows, int64_t k_len) {
  using Decoder = BlockDecoder<F>;
  const int64_t row_parts = k_len / kPartValues;
  const int64_t i = int64_t(blockIdx.x) * kDequantizeThreads + threadIdx.x;
  if (i >= rows * row_parts) return;
  const int64_t r = i / row_parts, p = i % row_parts;
  float q[kPartValues];
  const uint8_t* block = w + r * w_stride + p / kBlockParts<F> * kBlockBytes<F>;
  const PartAffine affine = Decoder::decode(block, int(p % kBlockParts<F>), q);
  out_t* dst = out + r * k_len + p * kPartValues;
  for (int j = 0; j < kPartValues; ++j)
    dst[j] = from_float<out_t>(Decoder::kOffset ? fmaf(affine.scale, q[j], affine.offset)
                                                : affine.scale * q[j]);
}

}  // namespace cuda
}  // namespace fastllm

#ifdef FASTLLM_KERNEL_COMPILE_CHECK
// Every format visit_block_format names, every GEMV row count and every storage dtype: taking
// the kernels' addresses instantiates them.
namespace fastllm::cuda {
void instantiate_quantized_kernels(BlockFormat format, int64_t rows) {
  visit_block_format(format, [&](auto f) {
    constexpr BlockFormat F = decltype(f)::value;
    visit_gemv_rows(rows, [](auto m) {
      constexpr int M = decltype(m)::value;
      (void)&quantized_gemv_kernel<F, M, float>;
      (void)&quantized_gemv_kernel<F, M, __half>;
      (void)&quantized_gemv_kernel<F, M, __nv_bfloat16>;
    });
    (void)&dequantize_kernel<F, float>;
    (void)&dequantize_kernel<F, __half>;
    (void)&dequantize_kernel<F, __nv_bfloat16>;
  });
}
}  // namespace fastllm::cuda
#endif
