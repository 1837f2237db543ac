// The quantized CPU kernels with AVX2 and FMA: this file is compiled with those flags (and
// without AVX-512's) whatever the build targets (CMakeLists.txt), and runs on CPUs that have
// them but not AVX-512 VNNI, or when FASTLLM_CPU_ISA=avx2 (common/cpu_isa.h). Where the
// activations are int16, the weights' integers (Q8_0's signed, as stored; Q4_1's bytes
// widened before their nibbles are split) are widened to int16 and meet them in vpmaddwd;
// where they are single bytes (Q4_0, the K-quants: quantized_cpu.h), the weights' unsigned
// bytes meet them in vpmaddubsw (pairs of products into int16, never saturating: u <= 63), and
// vpmaddwd sums the pairs into the same int32 lanes of 4 values as the AVX-512 kernels' vpdpbusd,
// so both give the same sums. Q6_K's zero point and int8 scales apply to the int16 pairs.
#include "quantized/quantized_cpu.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "quantized/block_bytes_avx2.h"
#include "quantized/quantized_cpu_kernel.h"

namespace fastllm {
namespace {

struct Avx2 {
  // 16 registers: two activation rows' accumulators for up to four weight rows, and their
  // operands.
  static constexpr int kActRows = 2;
  // Weight rows are read one at a time, in address order: a tile that interleaves two or four
  // rows ~1 KB apart draws less bandwidth from memory whatever the prefetch distance. Q4_0,
  // Q4_1, Q5_0 and Q5_1 do more arithmetic per byte and stay compute-bound, so they keep four
  // weight rows sharing each activation load.
  template <BlockFormat F>
  static constexpr int kTileRows = F == BlockFormat::kQ4_0 || F == BlockFormat::kQ4_1 ||
                                           F == BlockFormat::kQ5_0 || F == BlockFormat::kQ5_1
                                       ? 4
                                       : 1;
  template <BlockFormat F>
  static constexpr int kOneRowTileRows = kTileRows<F>;
  // Q8_0's int8 sign-extend into vpmaddwd's int16 straight from memory: no zero point to add
  // and take back through the activations' sums.
  static constexpr bool kSignedQ8_0 = true;
  struct Ints {
    __m256i low, high;  // values 0..15, 16..31
  };
  struct Bytes {  // single-byte activations (kByteActivations)
    __m256i x;
  };
  // Q6_K's: also 32 times each pair's sum (int16), the zero point's share of u . x.
  struct BytesAndZero {
    __m256i x, zero;
  };
  struct Q6KWeights {
    __m256i u, scales;  // the 6-bit integers; each pair's int8 scale, as int16 (16 values each)
  };
  using Acc = __m256;

  template <BlockFormat F, int kSub>
  static auto weights(const uint8_t* block) {
    if constexpr (F == BlockFormat::kQ8_0) {
      const auto* q = reinterpret_cast<const __m128i*>(block + 2);
      return Ints{_mm256_cvtepi8_epi16(_mm_loadu_si128(q)),
                  _mm256_cvtepi8_epi16(_mm_loadu_si128(q + 1))};
    } else if constexpr (F == BlockFormat::kQ4_1) {
      // The 16 bytes widened once: low nibbles are values 0..15, high nibbles 16..31.
      const __m256i both = _mm256_cvtepu8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4)));
      return Ints{_mm256_and_si256(both, _mm256_set1_epi16(0x0f)), _mm256_srli_epi16(both, 4)};
    }
    const __m256i bytes = sub_block_bytes<F, kSub>(block);
    if constexpr (kByteActivations<F> && F != BlockFormat::kQ6_K) {
      return bytes;
    } else if constexpr (F == BlockFormat::kQ6_K) {  // pairs 0-7: scale 2 kSub, 8-15: 2 kSub + 1
      const __m128i pick = _mm_set_epi64x(0x0101010101010101 * (2 * kSub + 1),
                                          0x0101010101010101 * (2 * kSub));
      const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
      return Q6KWeights{bytes, _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pick))};
    } else {  // unsigned, widened
      return Ints{_mm256_cvtepu8_epi16(_mm256_castsi256_si128(bytes)),
                  _mm256_cvtepu8_epi16(_mm256_extracti128_si256(bytes, 1))};
    }
  }
  template <BlockFormat F>
  static auto activations(const ActivationBlocks& x, int64_t i) {
    const int64_t at = i * kSubBlockValues;
    if constexpr (!kByteActivations<F>) {
      const int16_t* p = x.values + at;
      return Ints{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))};
    } else {
      const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.low + at));
      if constexpr (F != BlockFormat::kQ6_K)
        return Bytes{low};
      else
        return BytesAndZero{low, _mm256_maddubs_epi16(_mm256_set1_epi8(32), low)};
    }
  }
  static Acc zero() { return _mm256_setzero_ps(); }
  static Acc fma(__m256i dots, const float* scale, Acc acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_broadcast_ss(scale), acc);
  }
  // A lane sums 4 products of at most 255 * 32767: an int32.
  static Acc dot_fma(Ints w, Ints x, const float* scale, Acc acc) {
    return fma(_mm256_add_epi32(_mm256_madd_epi16(w.low, x.low),
                                _mm256_madd_epi16(w.high, x.high)),
               scale, acc);
  }
  // A pair's two products are at most 2 * 31 * 127 (Q5_K): an int16.
  static Acc dot_fma(__m256i u, Bytes x, const float* scale, Acc acc) {
    return fma(_mm256_madd_epi16(_mm256_maddubs_epi16(u, x.x), _mm256_set1_epi16(1)), scale,
               acc);
  }
  // (u - 32) . x per pair: within 2 * 32 * 127 (u . x within 2 * 63 * 127), times an int8
  // scale per pair, summed in lanes of 4 values: an int32.
  static Acc dot_fma(Q6KWeights w, BytesAndZero x, const float* scale, Acc acc) {
    const __m256i pairs = _mm256_sub_epi16(_mm256_maddubs_epi16(w.u, x.x), x.zero);
    return fma(_mm256_madd_epi16(pairs, w.scales), scale, acc);
  }
  static void store_values(Ints w, float scale, float offset, float* out) {
    const __m256 s = _mm256_set1_ps(scale), o = _mm256_set1_ps(offset);
    for (int quarter = 0; quarter < 4; ++quarter) {
      const __m256i ints = quarter < 2 ? w.low : w.high;
      const __m128i eight = quarter % 2 ? _mm256_extracti128_si256(ints, 1)
                                        : _mm256_castsi256_si128(ints);
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(eight));
      _mm256_storeu_ps(out + 8 * quarter, _mm256_fmadd_ps(q, s, o));
    }
  }
  static void store_values(__m256i u, float scale, float offset, float* out) {
    store_values(Ints{_mm256_cvtepu8_epi16(_mm256_castsi256_si128(u)),
                      _mm256_cvtepu8_epi16(_mm256_extracti128_si256(u, 1))},
                 scale, offset, out);
  }
  static void store_values(Q6KWeights w, float scale, float offset, float* out) {
    // (u - 32) times its half's scale: at most 32 * 128, an int16.
    const __m256i zero = _mm256_set1_epi16(32);
    const __m256i low = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(w.u)), zero);
    const __m256i high =
        _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(w.u, 1)), zero);
    store_values(Ints{_mm256_mullo_epi16(low, _mm256_permute2x128_si256(w.scales, w.scales, 0x00)),
                      _mm256_mullo_epi16(high, _mm256_permute2x128_si256(w.scales, w.scales, 0x11))},
                 scale, offset, out);
  }
  // The prefill GEMM's tile: 6 x 2 vectors, 12 of the 16 registers.
  static constexpr int kGemmRows = 6, kGemmVecs = 2, kFloats = 8;
  using Floats = __m256;
  static Floats load(const float* p) { return _mm256_loadu_ps(p); }
  static Floats broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static Floats fmadd(Floats a, Floats b, Floats c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, Floats v) { _mm256_storeu_ps(p, v); }
  static Floats mul(Floats a, Floats b) { return _mm256_mul_ps(a, b); }
  // The prefill byte GEMM: two activation rows against two vectors of 8 weight rows, 4 int16
  // pair sums, 4 int32 sums and 4 float accumulators.
  static constexpr bool kByteGemm = true;
  static constexpr int kByteGemmRows = 2;
  using Quads = __m256i;
  static void store_bytes(uint8_t* p, __m256i w) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w);
  }
  static void store_bytes(uint8_t* p, Q6KWeights w) { store_bytes(p, w.u); }
  static Quads load_quads(const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static Quads broadcast_quad(const int8_t* p) {
    return _mm256_set1_epi32(int(read_u32(reinterpret_cast<const uint8_t*>(p))));
  }
  static Quads zero_quads() { return _mm256_setzero_si256(); }
  // Partial sums are int16 pairs: a group of 4 values adds at most 2 * 127 * (the largest
  // integer) to a pair (|x| <= kByteActivationMax), so one holds 8 groups of 4-bit integers
  // (30480), 4 of Q5_K's 5-bit ones (31496), 2 of Q6_K's 6-bit ones (32004).
  template <BlockFormat F>
  static constexpr int kPartialSumQuads =
      F == BlockFormat::kQ6_K ? 2 : F == BlockFormat::kQ5_K ? 4 : 8;
  static Quads add_quad_products(Quads w, Quads x, Quads pairs) {
    return _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w, x));
  }
  static Quads lane_sums(Quads pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }
  static Quads add_ints(Quads a, Quads b) { return _mm256_add_epi32(a, b); }
  static Floats scale_ints(Quads ints, Floats scale, Floats acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), scale, acc);
  }
  static float sum(Acc acc) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
  }
  // FP8: one weight row at a time, in address order, as the memory-bound formats above.
  static constexpr int kFp8ActRows = 2, kFp8TileRows = 1;
  // A block's values in the order vpunpcklbw/vpunpckhbw leave them: 0-7, 16-23, 8-15, 24-31
  // (kFp8Order); fp8_dot reads the activations in the same order.
  struct Fp8Values {
    __m256 v[4];
  };
  static constexpr int kFp8Order[4] = {0, 16, 8, 24};
  static Fp8Values fp8_values(const uint8_t* codes) {
    const __m256i bytes = load_bytes(codes), zero = _mm256_setzero_si256();
    // Each code in the high byte of a 16-bit lane, shifted right arithmetically by one with
    // bit 14 (the sign's copy) cleared: (s << 15) | (eeeemmm << 7), fp8_half_bits.
    const __m256i keep = _mm256_set1_epi16(int16_t(0xbfff));
    const auto halves = [&](__m256i high_bytes) {
      return _mm256_and_si256(_mm256_srai_epi16(high_bytes, 1), keep);
    };
    const __m256i low = halves(_mm256_unpacklo_epi8(zero, bytes));
    const __m256i high = halves(_mm256_unpackhi_epi8(zero, bytes));
    return {{_mm256_cvtph_ps(_mm256_castsi256_si128(low)),
             _mm256_cvtph_ps(_mm256_extracti128_si256(low, 1)),
             _mm256_cvtph_ps(_mm256_castsi256_si128(high)),
             _mm256_cvtph_ps(_mm256_extracti128_si256(high, 1))}};
  }
  static Floats fp8_dot(const Fp8Values& w, const float* x) {
    const __m256 a = _mm256_fmadd_ps(w.v[1], _mm256_loadu_ps(x + kFp8Order[1]),
                                     _mm256_mul_ps(w.v[0], _mm256_loadu_ps(x + kFp8Order[0])));
    const __m256 b = _mm256_fmadd_ps(w.v[3], _mm256_loadu_ps(x + kFp8Order[3]),
                                     _mm256_mul_ps(w.v[2], _mm256_loadu_ps(x + kFp8Order[2])));
    return _mm256_add_ps(a, b);
  }
  static void fp8_store(const Fp8Values& w, float scale, float* out) {
    const __m256 s = _mm256_set1_ps(scale), two_8 = _mm256_set1_ps(256.f);
    for (int i = 0; i < 4; ++i)
      _mm256_storeu_ps(out + kFp8Order[i], _mm256_mul_ps(_mm256_mul_ps(w.v[i], two_8), s));
  }
};

// Decode rows of the interleaved layouts of Q4_0, Q4_1, Q5_0 (and Q8_0 below; block_formats.h:
// kInterleavedTypes). A 64-byte run holds 4 bytes of each of a group's 16 rows, its two 32-byte
// halves rows 0-7 and 8-15: one vpmaddubsw multiplies 4 values of 8 rows (a run's low nibbles,
// or its high ones) with 4 activation bytes broadcast to every lane, and the rows' sums stay in
// the lanes. Per 32 values, 8 rows and an activation row of bytes: 8 vpmaddubsw, 7 additions of
// their int16 pairs and one vpmaddwd, where the row-major kernel takes an unpacking, two integer
// and two float instructions a row besides its scales' decoding. The sums are the AVX-512
// interleaved kernel's (vpdpbusd): the same int32 per 4 values, the same float operations.

// Half h (rows 8h .. 8h + 7) of a block's 4 runs of nibbles: run q's low nibbles (values
// 4q .. 4q + 3 of each row, lanes of 4 bytes) and high nibbles (16 + 4q ..); Q5_0's fifth bits
// added from each row's 32-bit word of them.
template <BlockFormat F>
struct HalfRuns {
  __m256i low[4], high[4];

  HalfRuns(const uint8_t* runs, const uint8_t* fifth_bits) {
    const __m256i mask = _mm256_set1_epi8(0x0f);
    for (int q = 0; q < 4; ++q) {
      const __m256i run = load_bytes(runs + 64 * q);
      low[q] = _mm256_and_si256(run, mask);
      high[q] = _mm256_and_si256(_mm256_srli_epi16(run, 4), mask);
    }
    if constexpr (F == BlockFormat::kQ5_0) {
      // Byte b of each lane's word copied to the lane's 4 bytes (vpshufb), then byte k's bit
      // 4 (q % 2) + k tested: 16 where set.
      const __m256i bits = load_bytes(fifth_bits), sixteen = _mm256_set1_epi8(16);
      // vpshufb's index of each lane's first byte, within its 128-bit half.
      const __m256i lanes = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c, 0,
                                              0x04040404, 0x08080808, 0x0c0c0c0c);
      for (int q = 0; q < 4; ++q) {
        const __m256i pick = _mm256_set1_epi32(0x08040201 << (4 * (q % 2)));
        for (int half = 0; half < 2; ++half) {
          const int byte = 2 * half + q / 2;  // of the lane's word
          const __m256i copies =
              _mm256_shuffle_epi8(bits, _mm256_add_epi8(lanes, _mm256_set1_epi8(char(byte))));
          const __m256i fifth = _mm256_and_si256(
              _mm256_cmpeq_epi8(_mm256_and_si256(copies, pick), pick), sixteen);
          (half ? high : low)[q] = _mm256_or_si256((half ? high : low)[q], fifth);
        }
      }
    }
  }
  // The runs' products with one sub-block's 32 activation bytes x, as int32 per row. A pair of
  // products is at most 2 * 15 * 128 (Q5_0: 31): int16 sums of 8 pairs (Q5_0: 4) never wrap.
  __m256i dot(const uint8_t* x) const {
    const auto word = [&](int at) { return _mm256_set1_epi32(int(read_u32(x + at))); };
    __m256i low_pairs = _mm256_setzero_si256(), high_pairs = _mm256_setzero_si256();
    for (int q = 0; q < 4; ++q) {
      low_pairs = _mm256_add_epi16(low_pairs, _mm256_maddubs_epi16(low[q], word(4 * q)));
      high_pairs = _mm256_add_epi16(high_pairs, _mm256_maddubs_epi16(high[q], word(16 + 4 * q)));
    }
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (F == BlockFormat::kQ5_0)
      return _mm256_add_epi32(_mm256_madd_epi16(low_pairs, ones),
                              _mm256_madd_epi16(high_pairs, ones));
    else
      return _mm256_madd_epi16(_mm256_add_epi16(low_pairs, high_pairs), ones);
  }
};

inline const uint8_t* activation_bytes(const int8_t* bytes, int64_t i) {
  return reinterpret_cast<const uint8_t*>(bytes + i * kSubBlockValues);
}

inline __m256 float16s(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A group's 16 sums (two halves of 8) for activation rows row0 .., plus the bias.
template <int M>
inline void store_rows(const __m256 (&acc)[M][2], int64_t row0, const float* bias, float* y,
                       int64_t ldy) {
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < 2; ++h) {
      const __m256 sums =
          bias ? _mm256_add_ps(acc[m][h], _mm256_loadu_ps(bias + 8 * h)) : acc[m][h];
      _mm256_storeu_ps(y + (row0 + m) * ldy + 8 * h, sums);
    }
}

// Half h (rows 8h .. 8h + 7) of a Q8_0 block's 8 runs of the rows' int8 values, 4 of each row.
// vpmaddubsw's pairs of a byte and a signed byte would overflow int16 here, so each run's two
// 16-byte quarters (4 rows each) are widened to int16 and meet the activations' int16 in
// vpmaddwd: lanes of 2 values, a row's 4 values in two lanes, added across the runs (at most
// 32 * 128 * 32767: an int32) and pairwise at the end.
struct Q8_0HalfRuns {
  const uint8_t* runs;

  Q8_0HalfRuns(const uint8_t* runs, const uint8_t*) : runs(runs) {}

  // The runs' products with one sub-block's 32 activation values, as int32 per row.
  __m256i dot(const int16_t* x) const {
    __m256i quarters[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int q = 0; q < 8; ++q) {
      int64_t values;  // activation values 4q .. 4q + 3
      __builtin_memcpy(&values, x + 4 * q, sizeof(values));
      const __m256i xs = _mm256_set1_epi64x(values);
      for (int k = 0; k < 2; ++k) {
        const __m256i w = _mm256_cvtepi8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(runs + 64 * q + 16 * k)));
        quarters[k] = _mm256_add_epi32(quarters[k], _mm256_madd_epi16(w, xs));
      }
    }
    // vphaddd leaves rows 0, 1, 4, 5 | 2, 3, 6, 7: 64-bit units 0, 2, 1, 3 put them in order.
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(quarters[0], quarters[1]), 0xd8);
  }
};

// Rows row0 .. row0 + M - 1 against a group of Q4_0, Q4_1, Q5_0 or Q8_0 blocks: per block, the
// 16 scales; Q4_1's 16 minimums, Q5_0's 16 words of fifth bits; then 4 runs of nibbles (Q8_0: 8
// of bytes).
template <BlockFormat F, int M>
inline void interleaved_block32_tile(const ActivationBlocks& x, int64_t row0,
                                     const uint8_t* group, const float* bias, float* y,
                                     int64_t ldy) {
  constexpr bool kQ8_0 = F == BlockFormat::kQ8_0;
  constexpr int64_t kRowBytes = block_layout(F).bytes, kBlockBytes = kInterleavedRows * kRowBytes;
  constexpr int64_t kRuns = kBlockBytes - 64 * (kQ8_0 ? 8 : 4);  // the runs end the block
  constexpr int64_t kSecond = 2 * kInterleavedRows;  // Q4_1's minimums, Q5_0's fifth bits
  // Q8_0's integers are signed as stored: no zero point.
  constexpr float kZero = kQ8_0 ? 0.f : kZeroPoint<F>;
  __m256 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    const uint8_t* block = group + b * kBlockBytes;
    prefetch_interleaved<kBlockBytes>(block);
    for (int h = 0; h < 2; ++h) {
      const std::conditional_t<kQ8_0, Q8_0HalfRuns, HalfRuns<F>> runs(block + kRuns + 32 * h,
                                                                      block + kSecond + 32 * h);
      const __m256 scales = float16s(block + 16 * h);
      for (int m = 0; m < M; ++m) {
        const int64_t i = (row0 + m) * x.blocks + b;
        __m256i ints;
        if constexpr (kQ8_0) {
          ints = runs.dot(x.values + i * kSubBlockValues);
        } else if constexpr (kByteActivations<F>) {
          ints = runs.dot(activation_bytes(x.low, i));
        } else {  // x = 256 high + low: at most 32 * 31 * 32767
          ints = _mm256_add_epi32(_mm256_slli_epi32(runs.dot(activation_bytes(x.high, i)), 8),
                                  runs.dot(activation_bytes(x.low, i)));
        }
        // d (s u.x - z s sum x): the block's sum with the zero point z, times each row's scale;
        // Q4_1's minimums m (s sum x) apart.
        const __m256 dots =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), _mm256_set1_ps(x.scales[i]),
                            _mm256_set1_ps(-kZero * x.sums[i]));
        acc[m][h] = _mm256_fmadd_ps(dots, scales, acc[m][h]);
        if constexpr (F == BlockFormat::kQ4_1)
          acc[m][h] = _mm256_fmadd_ps(float16s(block + kSecond + 16 * h),
                                      _mm256_set1_ps(x.sums[i]), acc[m][h]);
      }
    }
  }
  store_rows(acc, row0, bias, y, ldy);
}

template <BlockFormat F>
void interleaved_decode_rows(const ActivationBlocks& x, const uint8_t* w, int64_t ldw,
                             int64_t begin, int64_t end, const float* bias, float* y,
                             int64_t ldy) {
  for (int64_t n = begin; n < end; n += kInterleavedRows)
    for_row_tiles<Avx2::kActRows>(x.rows, [&](auto rows, int64_t m) {
      interleaved_block32_tile<F, decltype(rows)::value>(x, m, w + n * ldw,
                                                         bias ? bias + n : nullptr, y + n, ldy);
    });
}

}  // namespace

CpuKernels cpu_kernels_avx2(BlockFormat format) {
  CpuKernels kernels = cpu_kernels_for<Avx2>(format);
  visit_block_format(format, [&](auto f) {
    constexpr BlockFormat F = decltype(f)::value;
    if constexpr (F == BlockFormat::kQ4_0 || F == BlockFormat::kQ4_1 ||
                  F == BlockFormat::kQ5_0 || F == BlockFormat::kQ8_0)
      kernels.interleaved_decode_rows = &interleaved_decode_rows<F>;
  });
  return kernels;
}

}  // namespace fastllm
#else
namespace fastllm {
CpuKernels cpu_kernels_avx2(BlockFormat) { return {}; }
}  // namespace fastllm
#endif
