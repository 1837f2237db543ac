// A sub-block's 32 integers as the 32 signed bytes of a __m256i, with AVX2: the SIMD twin of
// block_formats.h's sub_block_ints (the same integers, except Q6_K's, which are left unscaled
// here: the int8 scales need int16). The AVX2 and AVX-512 kernels widen them to int16.
#pragma once

#include <immintrin.h>

#include "quantized/block_formats.h"

namespace fastllm {
namespace {

inline __m256i load_bytes(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// 16 bytes' low nibbles, then their high nibbles (Q4_x/Q5_x's value order).
inline __m256i split_nibbles(const uint8_t* p) {
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_set_epi64x(4, 4, 0, 0)),
                          _mm256_set1_epi8(0x0f));
}

// 32 bytes' low (kShift 0) or high (kShift 4) nibbles.
template <int kShift>
inline __m256i nibbles(const uint8_t* p) {
  return _mm256_and_si256(_mm256_srli_epi16(load_bytes(p), kShift), _mm256_set1_epi8(0x0f));
}

// Byte j is 0xff where bit j of `bits` is set, else 0.
inline __m256i bit_bytes(uint32_t bits) {
  // Byte j takes byte j / 8 of bits, then tests its bit j % 8.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

// Bits kFrom .. kFrom + kWidth - 1 of each byte moved to bits 4.. (above a 4-bit q's).
template <int kFrom, int kWidth>
inline __m256i high_bits(__m256i bytes) {
  const __m256i mask = _mm256_set1_epi8(char(((1 << kWidth) - 1) << 4));
  // 16-bit shifts: the bits crossing between a pair's bytes land outside the mask.
  if constexpr (kFrom <= 4) return _mm256_and_si256(_mm256_slli_epi16(bytes, 4 - kFrom), mask);
  else return _mm256_and_si256(_mm256_srli_epi16(bytes, kFrom - 4), mask);
}

template <BlockFormat F, int kSub>
inline __m256i sub_block_bytes(const uint8_t* block) {
  using enum BlockFormat;
  if constexpr (F == kQ8_0) {
    return load_bytes(block + 2);
  } else if constexpr (F == kQ4_0) {
    return _mm256_sub_epi8(split_nibbles(block + 2), _mm256_set1_epi8(8));
  } else if constexpr (F == kQ4_1) {
    return split_nibbles(block + 4);
  } else if constexpr (F == kQ5_0) {  // q - 16 where the fifth bit is clear
    const __m256i fifth = bit_bytes(read_u32(block + 2));
    return _mm256_sub_epi8(split_nibbles(block + 6),
                           _mm256_andnot_si256(fifth, _mm256_set1_epi8(16)));
  } else if constexpr (F == kQ5_1) {
    const __m256i fifth = bit_bytes(read_u32(block + 4));
    return _mm256_or_si256(split_nibbles(block + 8), _mm256_and_si256(fifth, _mm256_set1_epi8(16)));
  } else if constexpr (F == kQ4_K) {
    return nibbles<4 * (kSub % 2)>(block + 16 + 32 * (kSub / 2));
  } else if constexpr (F == kQ5_K) {
    return _mm256_or_si256(nibbles<4 * (kSub % 2)>(block + 48 + 32 * (kSub / 2)),
                           high_bits<kSub, 1>(load_bytes(block + 16)));
  } else {  // Q6_K, unscaled
    constexpr int half = kSub / 4, k = kSub % 4;
    const __m256i low = nibbles<4 * (k / 2)>(block + 64 * half + 32 * (k % 2));
    const __m256i high = high_bits<2 * k, 2>(load_bytes(block + 128 + 32 * half));
    return _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
  }
}

// Q6_K's int8 scales of sub-block kSub's two halves of 16 values.
template <int kSub>
inline int16_t q6_k_scale(const uint8_t* block, int half) {
  return int8_t(block[192 + 2 * kSub + half]);
}

}  // namespace
}  // namespace fastllm
