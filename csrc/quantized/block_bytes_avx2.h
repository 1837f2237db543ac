// A sub-block's 32 integers as the 32 bytes of a __m256i, with AVX2: the SIMD twin of
// block_formats.h's sub_block_ints. The same unsigned integers, except Q6_K's, which are its
// stored 6-bit integers here (0..63, the zero point 32 not subtracted and the int8 scales not
// applied: those need more than a byte).
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

// Byte j is 16 where bit j of `bits` is set, else 0 (Q5_x's fifth bits).
inline __m256i fifth_bits(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_mov_epi8(__mmask32(bits), _mm256_set1_epi8(16));
#else
  // Byte j takes byte j / 8 of bits, then tests its bit j % 8.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                          _mm256_set1_epi8(16));
#endif
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
    return _mm256_xor_si256(load_bytes(block + 2), _mm256_set1_epi8(char(0x80)));
  } else if constexpr (F == kQ4_0 || F == kQ4_1) {
    return split_nibbles(block + (F == kQ4_0 ? 2 : 4));
  } else if constexpr (F == kQ5_0 || F == kQ5_1) {
    constexpr int qh = F == kQ5_0 ? 2 : 4;
    return _mm256_or_si256(split_nibbles(block + qh + 4), fifth_bits(read_u32(block + qh)));
  } else if constexpr (F == kQ4_K) {
    return nibbles<4 * (kSub % 2)>(block + 16 + 32 * (kSub / 2));
  } else if constexpr (F == kQ5_K) {
    return _mm256_or_si256(nibbles<4 * (kSub % 2)>(block + 48 + 32 * (kSub / 2)),
                           high_bits<kSub, 1>(load_bytes(block + 16)));
  } else {  // Q6_K
    constexpr int half = kSub / 4, k = kSub % 4;
    const __m256i low = nibbles<4 * (k / 2)>(block + 64 * half + 32 * (k % 2));
    return _mm256_or_si256(low, high_bits<2 * k, 2>(load_bytes(block + 128 + 32 * half)));
  }
}

}  // namespace
}  // namespace fastllm
