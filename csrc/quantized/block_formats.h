// llama.cpp's (ggml's) block-quantized weight formats that fastllm keeps quantized. A weight row
// is a run of blocks. A block of the simple formats holds 32 values with one scale (and
// minimum); a K-quant block is a super-block of 256 values: 8 sub-blocks of 32, each with its
// own scale (and minimum) stored in the super-block's header. Torch-free, so every device's
// kernels read the same definitions.
//
//          bytes  fields (in order)                                   value
//   Q4_0     18   fp16 d, 16 B of 4-bit q                             d * (q - 8)
//   Q4_1     20   fp16 d, fp16 m, 16 B of 4-bit q                     d * q + m
//   Q5_0     22   fp16 d, 32-bit qh, 16 B of 4-bit q                  d * (q - 16)
//   Q5_1     24   fp16 d, fp16 m, 32-bit qh, 16 B of 4-bit q          d * q + m
//   Q8_0     34   fp16 d, 32 int8 q                                   d * q
//   Q4_K    144   fp16 d, fp16 dmin, 12 B of 6-bit scales and mins,   d * sc[s] * q - dmin * m[s]
//                 128 B of 4-bit q
//   Q5_K    176   as Q4_K, with 32 B of qh before the 4-bit q         d * sc[s] * q - dmin * m[s]
//   Q6_K    210   128 B of low 4 bits, 64 B of high 2 bits,           d * sc[j / 16] * (q - 32)
//                 16 int8 scales (one per 16 values), fp16 d
//
// Where the bits are:
// - Q4_x/Q5_x: byte j holds value j in its low nibble and value j + 16 in its high one; bit j
//   of qh is value j's fifth bit.
// - Q4_K/Q5_K: bytes 32c..32c+31 hold sub-block 2c in their low nibbles and 2c + 1 in their
//   high ones; bit s of qh byte l is the fifth bit of sub-block s's value l. The 12 scale bytes:
//   bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the
//   same for mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high).
// - Q6_K, per half of 128 values h: low bits in bytes 64h..64h+63 (value j in byte j's low
//   nibble, value 64 + j in its high one), high bits in bytes 128+32h..: bits 2k, 2k + 1 of
//   byte l belong to value 32k + l.
#pragma once

#include <cstdint>
#include <type_traits>

#if defined(__F16C__) && !defined(__CUDA_ARCH__)
#include <immintrin.h>
#endif

namespace fastllm {

// ggml's type ids (gguf's GGMLQuantizationType), as the ops' weight_type argument, and
// fastllm's FP8 blocks (kFp8E4M3, below).
enum class BlockFormat : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kFp8E4M3 = 2000
};

// fastllm's own weight types, never in a file: Q4_0's, Q4_1's, Q5_0's, Q8_0's, Q4_K's and Q6_K's
// blocks with the rows of each group of kInterleavedRows interleaved, the layout of the AVX-512
// decode kernels (quantized_cpu_avx512.cpp; AVX2's for Q4_0, Q4_1, Q5_0 and Q8_0), type
// kInterleavedTypes + the ggml type. Group g
// (rows 16 g .. 16 g + 15) keeps their bytes, block after block; each field of a group's block
// holds the 16 rows' bytes of that field in chunks: chunk c of every row, row after row, then
// chunk c + 1. The 16 bytes of nibbles (Q4_K: 128; Q8_0's 32 bytes) come in chunks of 4 (one
// 32-bit lane of a row's integers), last; before them, each in one chunk, the float16 scale
// (Q4_K: d and dmin) and Q4_1's float16 minimum or Q5_0's 32 fifth bits; Q4_K's 12 bytes of
// packed 6-bit scales in chunks of 1. Q6_K's fields keep their order: 128 bytes of low bits and
// 64 of high bits in chunks of 4, the 16 int8 scales in chunks of 1, d. Only the CPU ops take
// them.
constexpr int64_t kInterleavedTypes = 1000;
constexpr int64_t kInterleavedRows = 16;

// fastllm's FP8 weight type, never in a file: FP8 checkpoints' float8_e4m3fn weights kept in
// their byte, type 2000 (BlockFormat::kFp8E4M3) on every device. A row is blocks of 32 values,
// 36 bytes each: a little-endian float32 scale, then 32 e4m3 codes (bit 7 the sign, bits 3-6
// the exponent, bias 7, bits 0-2 the mantissa); value j is scale * e4m3(code j). A float32 scale
// holds a checkpoint's per-tensor, per-channel or 128 x 128 block scale (float32, bfloat16 or
// float16) exactly. The NaN codes (0x7f, 0xff) are not values: loaders refuse them. The kernels
// decode a code as the float16 with bits (s << 15) | (eeeemmm << 7): e4m3's value times 2^-8,
// normal or subnormal alike (fp8_half_bits), the 2^8 applied with the scale.
constexpr int64_t kFp8E4M3Type = int64_t(BlockFormat::kFp8E4M3);

// The float16 bits of an e4m3 code times 2^-8.
constexpr uint16_t fp8_half_bits(uint8_t code) {
  return uint16_t((code & 0x80) << 8 | (code & 0x7f) << 7);
}

// The formats with an interleaved layout, in type order.
constexpr BlockFormat kInterleavedFormats[] = {BlockFormat::kQ4_0, BlockFormat::kQ4_1,
                                               BlockFormat::kQ5_0, BlockFormat::kQ8_0,
                                               BlockFormat::kQ4_K, BlockFormat::kQ6_K};

constexpr bool is_interleaved_type(int64_t type) {
  for (const BlockFormat format : kInterleavedFormats)
    if (type == kInterleavedTypes + int64_t(format)) return true;
  return false;
}

// Values of a sub-block: the unit of one scale (the activations' too).
constexpr int64_t kSubBlockValues = 32;

struct BlockLayout {
  const char* name;
  int64_t values, bytes;  // per block (a K-quant's super-block)
};

constexpr bool is_block_format(int64_t type) {
  return type == 2 || type == 3 || type == 6 || type == 7 || type == 8 || type == 12 ||
         type == 13 || type == 14;
}

constexpr BlockLayout block_layout(BlockFormat format) {
  switch (format) {
    case BlockFormat::kQ4_0: return {"Q4_0", 32, 18};
    case BlockFormat::kQ4_1: return {"Q4_1", 32, 20};
    case BlockFormat::kQ5_0: return {"Q5_0", 32, 22};
    case BlockFormat::kQ5_1: return {"Q5_1", 32, 24};
    case BlockFormat::kQ8_0: return {"Q8_0", 32, 34};
    case BlockFormat::kQ4_K: return {"Q4_K", 256, 144};
    case BlockFormat::kQ5_K: return {"Q5_K", 256, 176};
    case BlockFormat::kQ6_K: return {"Q6_K", 256, 210};
    case BlockFormat::kFp8E4M3: return {"FP8_E4M3", 32, 36};
  }
  return {"?", 1, 1};
}

template <BlockFormat F>
constexpr int kSubBlocks = int(block_layout(F).values / kSubBlockValues);

// Whether the format has minima (w = d * q + m).
template <BlockFormat F>
constexpr bool kHasMin = F == BlockFormat::kQ4_1 || F == BlockFormat::kQ5_1 ||
                         F == BlockFormat::kQ4_K || F == BlockFormat::kQ5_K;
// The zero point of the formats without minima (w = d * (q - zero point)), but Q6_K's, whose
// integers are signed (sub_block_ints).
template <BlockFormat F>
constexpr float kZeroPoint = F == BlockFormat::kQ4_0 ? 8.f : F == BlockFormat::kQ5_0 ? 16.f
                             : F == BlockFormat::kQ8_0 ? 128.f : 0.f;
// Whether block_affine's offsets are not all 0: every format but Q6_K.
template <BlockFormat F>
constexpr bool kHasOffset = kHasMin<F> || kZeroPoint<F> != 0.f;

// Calls fn(std::integral_constant<BlockFormat, F>()) for the runtime format (FP8 too).
template <class Fn>
decltype(auto) visit_block_format(BlockFormat format, Fn&& fn) {
  using F = BlockFormat;
  switch (format) {
    case F::kQ4_0: return fn(std::integral_constant<F, F::kQ4_0>());
    case F::kQ4_1: return fn(std::integral_constant<F, F::kQ4_1>());
    case F::kQ5_0: return fn(std::integral_constant<F, F::kQ5_0>());
    case F::kQ5_1: return fn(std::integral_constant<F, F::kQ5_1>());
    case F::kQ8_0: return fn(std::integral_constant<F, F::kQ8_0>());
    case F::kQ4_K: return fn(std::integral_constant<F, F::kQ4_K>());
    case F::kQ5_K: return fn(std::integral_constant<F, F::kQ5_K>());
    case F::kFp8E4M3: return fn(std::integral_constant<F, F::kFp8E4M3>());
    case F::kQ6_K: break;
  }
  return fn(std::integral_constant<F, F::kQ6_K>());
}

// The decoding functions below are compiled once per instruction set (the CPU kernels'
// quantized_cpu_<isa>.cpp): internal linkage keeps the linker from handing one translation
// unit's copy, with instructions the CPU may lack, to another.
namespace {

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

inline float half_to_float(uint16_t bits) {
#if defined(__F16C__) && !defined(__CUDA_ARCH__)
  return _cvtsh_ss(bits);  // one instruction; the bit-by-bit path costs a kernel its speed
#else
  return half_bits_to_float(bits);
#endif
}

inline float read_half(const uint8_t* p) {
  return half_to_float(uint16_t(p[0]) | uint16_t(p[1]) << 8);
}

inline uint32_t read_u32(const uint8_t* p) {
  uint32_t v;
  __builtin_memcpy(&v, p, sizeof(v));  // little-endian, as ggml writes it
  return v;
}

// Q4_K/Q5_K's 12 scale bytes as 8 scales and 8 mins (0..63), four per 32-bit word.
inline void unpack_k_scales(const uint8_t* p, uint8_t (&scales)[8], uint8_t (&mins)[8]) {
  const uint32_t a = read_u32(p), b = read_u32(p + 4), c = read_u32(p + 8);
  const uint32_t words[4] = {a & 0x3f3f3f3fu, (c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u),
                             b & 0x3f3f3f3fu, ((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)};
  __builtin_memcpy(scales, words, 8);
  __builtin_memcpy(mins, words + 2, 8);
}

// A block's value w = scale[s] * q + offset[s] for each sub-block s < kSubBlocks<F>, with q
// the integers sub_block_ints gives: unsigned (so 8-bit dot products can take them as they
// are), the zero point of Q4_0, Q5_0 and Q8_0 in the offset; Q6_K's are signed, offset 0.
// scale * q is exact in float32 (at most 11 + 8 + 5 significant bits), so w rounded once is
// ggml's (and gguf-py's) value bit for bit (d * (q - zero point) exactly, for a zero point).
template <BlockFormat F>
inline void block_affine(const uint8_t* block, float* scale, float* offset) {
  using enum BlockFormat;
  if constexpr (F == kQ4_K || F == kQ5_K) {
    uint8_t scales[8], mins[8];
    unpack_k_scales(block + 4, scales, mins);
    const float d = read_half(block), dmin = read_half(block + 2);
    for (int s = 0; s < 8; ++s) {  // through int32: vectorizes (uint8 to float does not)
      scale[s] = d * float(int32_t(scales[s]));
      offset[s] = -(dmin * float(int32_t(mins[s])));
    }
  } else if constexpr (F == kQ6_K) {
    const float d = read_half(block + 208);  // the int8 scales are in q
    for (int s = 0; s < 8; ++s) {
      scale[s] = d;
      offset[s] = 0.f;
    }
  } else {
    scale[0] = read_half(block);
    offset[0] = kHasMin<F> ? read_half(block + 2) : -(kZeroPoint<F> * scale[0]);
  }
}

// block_affine of the U sub-blocks from `block` on (U / kSubBlocks<F> blocks), in one go: the
// fp16 fields of 8 blocks of 32 values are gathered and converted together (one instruction
// with F16C).
template <BlockFormat F, int U>
inline void unit_affine(const uint8_t* block, float* scale, float* offset) {
  constexpr int S = kSubBlocks<F>;
  constexpr int64_t bytes = block_layout(F).bytes;
  if constexpr (S > 1 || U == 1) {
    for (int k = 0; k < U / S; ++k)
      block_affine<F>(block + k * bytes, scale + k * S, offset + k * S);
  } else {
    uint16_t d[U], m[U];
    for (int k = 0; k < U; ++k) {
      __builtin_memcpy(d + k, block + k * bytes, 2);
      if constexpr (kHasMin<F>) __builtin_memcpy(m + k, block + k * bytes + 2, 2);
    }
    const auto convert = [](const uint16_t* h, float* out) {
#if defined(__F16C__) && !defined(__CUDA_ARCH__)
      if constexpr (U == 8) {
        const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h));
        return _mm256_storeu_ps(out, _mm256_cvtph_ps(halves));
      }
#endif
      for (int k = 0; k < U; ++k) out[k] = half_bits_to_float(h[k]);
    };
    convert(d, scale);
    if constexpr (kHasMin<F>) {
      convert(m, offset);
    } else {
      for (int k = 0; k < U; ++k) offset[k] = -(kZeroPoint<F> * scale[k]);
    }
  }
}

// Sub-block s's 32 integers: as stored (Q8_0's plus 128: 0..255), except Q6_K's, which have
// the zero point subtracted and are times the int8 scale of each value's 16 (|q| <= 32 * 128),
// so that d is Q6_K's only float scale. (The bytes are read from local copies, which q cannot
// alias: the loops vectorize.)
template <BlockFormat F>
inline void sub_block_ints(const uint8_t* block, int s, int16_t* q) {
  using enum BlockFormat;
  uint8_t low[32], high[32];
  if constexpr (F == kQ8_0) {
    __builtin_memcpy(low, block + 2, 32);
    for (int j = 0; j < 32; ++j) q[j] = low[j] ^ 0x80;
  } else if constexpr (F == kQ4_K || F == kQ5_K) {
    __builtin_memcpy(low, block + (F == kQ4_K ? 16 : 48) + 32 * (s / 2), 32);
    if constexpr (F == kQ5_K) __builtin_memcpy(high, block + 16, 32);
    const int shift = 4 * (s % 2);
    for (int j = 0; j < 32; ++j)
      q[j] = ((low[j] >> shift) & 0x0f) | (F == kQ5_K ? ((high[j] >> s) & 1) << 4 : 0);
  } else if constexpr (F == kQ6_K) {
    const int k = s % 4;
    __builtin_memcpy(low, block + 64 * (s / 4) + 32 * (k % 2), 32);
    __builtin_memcpy(high, block + 128 + 32 * (s / 4), 32);
    for (int h = 0; h < 2; ++h) {  // a scale per 16 values
      const int scale = int8_t(block[192 + 2 * s + h]);
      for (int j = 16 * h; j < 16 * h + 16; ++j) {
        const int value = ((low[j] >> (4 * (k / 2))) & 0x0f) | ((high[j] >> (2 * k)) & 3) << 4;
        q[j] = int16_t((value - 32) * scale);
      }
    }
  } else {  // Q4_0, Q4_1, Q5_0, Q5_1: values 0..15 in the low nibbles, 16..31 in the high ones
    constexpr bool five_bits = F == kQ5_0 || F == kQ5_1;
    const uint8_t* nibbles = block + 2 + (kHasMin<F> ? 2 : 0) + (five_bits ? 4 : 0);
    __builtin_memcpy(low, nibbles, 16);
    const uint32_t fifth = five_bits ? read_u32(nibbles - 4) : 0;
    for (int j = 0; j < 16; ++j) q[j] = (low[j] & 0x0f) | ((fifth >> j) & 1) << 4;
    for (int j = 0; j < 16; ++j) q[j + 16] = (low[j] >> 4) | ((fifth >> (j + 16)) & 1) << 4;
  }
}

}  // namespace
}  // namespace fastllm
