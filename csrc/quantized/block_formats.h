// llama.cpp's (ggml's) block-quantized weight formats that fastllm keeps quantized: each row of a
// weight is a run of blocks of 32 values, every block its own scale (and, for Q4_1, minimum).
// Torch-free, so CPU and GPU kernels read the same definitions.
//
//   Q4_0: fp16 d, 16 bytes of 4-bit q      w = d * (q - 8)     18 bytes
//   Q4_1: fp16 d, fp16 m, 16 bytes of q    w = d * q + m       20 bytes
//   Q8_0: fp16 d, 32 int8 q                w = d * q           34 bytes
//
// In the 4-bit formats, byte j holds value j in its low nibble and value j + 16 in its high one.
#pragma once

#include <cstdint>

#if defined(__F16C__) && !defined(__CUDA_ARCH__)
#include <immintrin.h>
#endif

namespace fastllm {

// ggml's type ids (gguf's GGMLQuantizationType), as the op's weight_type argument.
enum class BlockFormat : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

constexpr int64_t kBlockValues = 32;

constexpr bool is_block_format(int64_t type) {
  return type == int64_t(BlockFormat::kQ4_0) || type == int64_t(BlockFormat::kQ4_1) ||
         type == int64_t(BlockFormat::kQ8_0);
}

constexpr int64_t block_bytes(BlockFormat format) {
  switch (format) {
    case BlockFormat::kQ4_0: return 18;
    case BlockFormat::kQ4_1: return 20;
    case BlockFormat::kQ8_0: return 34;
  }
  return 0;
}

constexpr const char* block_format_name(BlockFormat format) {
  switch (format) {
    case BlockFormat::kQ4_0: return "Q4_0";
    case BlockFormat::kQ4_1: return "Q4_1";
    case BlockFormat::kQ8_0: return "Q8_0";
  }
  return "?";
}

// IEEE half to float, bit by bit (no fp16 hardware or library needed).
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exponent = 113;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float read_half(const uint8_t* p) {
  const uint16_t bits = uint16_t(p[0]) | uint16_t(p[1]) << 8;
#if defined(__F16C__) && !defined(__CUDA_ARCH__)
  return _cvtsh_ss(bits);  // one instruction; the bit-by-bit path costs a kernel its speed
#else
  return half_bits_to_float(bits);
#endif
}

// A block's affine map w = scale * q + offset, with q as the integers the block stores (0..15
// for the 4-bit formats, -128..127 for Q8_0).
struct BlockAffine {
  float scale, offset;
};

inline BlockAffine block_affine(BlockFormat format, const uint8_t* block) {
  const float d = read_half(block);
  switch (format) {
    case BlockFormat::kQ4_0: return {d, -8.f * d};
    case BlockFormat::kQ4_1: return {d, read_half(block + 2)};
    case BlockFormat::kQ8_0: return {d, 0.f};
  }
  return {0.f, 0.f};
}

// The block's 32 values.
inline void dequantize_block(BlockFormat format, const uint8_t* block, float* out) {
  const BlockAffine a = block_affine(format, block);
  if (format == BlockFormat::kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int j = 0; j < 32; ++j) out[j] = a.scale * float(q[j]);
    return;
  }
  const uint8_t* q = block + (format == BlockFormat::kQ4_1 ? 4 : 2);
  for (int j = 0; j < 16; ++j) {
    out[j] = a.scale * float(q[j] & 0x0f) + a.offset;
    out[j + 16] = a.scale * float(q[j] >> 4) + a.offset;
  }
}

}  // namespace fastllm
