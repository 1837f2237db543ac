// The quantized CPU kernels with AVX-512 (BW, VL, VNNI): this file is compiled with those flags
// whatever the build targets (CMakeLists.txt) and runs only on CPUs that have them
// (common/cpu_isa.h).
//
// A sub-block's unsigned 8-bit integers u meet the activations split into signed bytes,
// x = 256 * high + low, in two vpdpbusd: u . x = 256 (u . high) + u . low, exact in int32,
// without widening the weights; Q4_0's and the K-quants' activations are single bytes
// (quantized_cpu.h), one vpdpbusd. Each int32 lane holds 4 values' products, so Q6_K's int8
// scale (one per 16 values) and zero point apply to its lanes: (u - 32) . x times the scale.
#include "quantized/quantized_cpu.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "quantized/block_bytes_avx2.h"
#include "quantized/quantized_cpu_kernel.h"

namespace fastllm {
namespace {

struct Avx512 {
  // One activation row leaves registers (32 of them) for twice the weight rows: twice the
  // streams in flight, which memory-bound decode needs.
  static constexpr int kActRows = 4;
  template <BlockFormat>
  static constexpr int kTileRows = 4;
  template <BlockFormat>
  static constexpr int kOneRowTileRows = 8;
  static constexpr bool kSignedQ8_0 = false;  // vpdpbusd takes the weights unsigned
  using Acc = __m256;
  struct SplitBytes {
    __m256i high, low;
  };
  struct Bytes {  // single-byte activations (kByteActivations)
    __m256i x;
  };
  // Q6_K's: also each lane's 4 values' sum times 32, the zero point's share of u . x.
  struct BytesAndZero {
    __m256i x, zero;
  };
  struct Q6KWeights {
    __m256i u, scales;  // the 6-bit integers; the int8 scale of each lane's 16 values
  };

  template <BlockFormat F, int kSub>
  static auto weights(const uint8_t* block) {
    const __m256i u = sub_block_bytes<F, kSub>(block);
    if constexpr (F != BlockFormat::kQ6_K) {
      return u;
    } else {  // lanes 0-3: scale 2 kSub (values 0..15), lanes 4-7: scale 2 kSub + 1
      const __m128i pick = _mm_set_epi64x(0, 0x0101010100000000 + 0x0202020202020202 * kSub);
      const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
      return Q6KWeights{u, _mm256_cvtepi8_epi32(_mm_shuffle_epi8(scales, pick))};
    }
  }
  template <BlockFormat F>
  static auto activations(const ActivationBlocks& x, int64_t i) {
    const int64_t at = i * kSubBlockValues;
    const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.low + at));
    if constexpr (!kByteActivations<F>)
      return SplitBytes{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.high + at)), low};
    else if constexpr (F != BlockFormat::kQ6_K)
      return Bytes{low};
    else
      return BytesAndZero{low, _mm256_slli_epi32(dot(_mm256_set1_epi8(1), low), 5)};
  }
  static Acc zero() { return _mm256_setzero_ps(); }
  static __m256i dot(__m256i u, __m256i x) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
  }
  // u . x per lane of 4 values: |256 (u . high) + u . low| <= 4 * 255 * 32767, an int32.
  static __m256i dot(__m256i u, SplitBytes x) {
    return _mm256_dpbusd_epi32(_mm256_slli_epi32(dot(u, x.high), 8), u, x.low);
  }
  static Acc dot_fma(__m256i u, SplitBytes x, const float* scale, Acc acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot(u, x)), _mm256_broadcast_ss(scale), acc);
  }
  static Acc dot_fma(__m256i u, Bytes x, const float* scale, Acc acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot(u, x.x)), _mm256_broadcast_ss(scale), acc);
  }
  // |(u - 32) . x| <= 4 * 32 * 127 per lane, times an int8 scale: an int32.
  static Acc dot_fma(Q6KWeights w, BytesAndZero x, const float* scale, Acc acc) {
    const __m256i dots = _mm256_sub_epi32(dot(w.u, x.x), x.zero);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(dots, w.scales)),
                           _mm256_broadcast_ss(scale), acc);
  }
  static void store_values(__m256i u, float scale, float offset, float* out) {
    const __m512 s = _mm512_set1_ps(scale), o = _mm512_set1_ps(offset);
    for (int half = 0; half < 2; ++half) {
      const __m128i bytes = half ? _mm256_extracti128_si256(u, 1) : _mm256_castsi256_si128(u);
      const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
      _mm512_storeu_ps(out + 16 * half, _mm512_fmadd_ps(q, s, o));
    }
  }
  static void store_values(Q6KWeights w, float scale, float offset, float* out) {
    for (int half = 0; half < 2; ++half) {  // (u - 32) times the half's int8 scale (lane 4 half)
      const __m128i bytes = half ? _mm256_extracti128_si256(w.u, 1) : _mm256_castsi256_si128(w.u);
      const __m512i q = _mm512_sub_epi32(_mm512_cvtepu8_epi32(bytes), _mm512_set1_epi32(32));
      const __m512i scales = _mm512_permutexvar_epi32(_mm512_set1_epi32(4 * half),
                                                      _mm512_castsi256_si512(w.scales));
      const __m512 values = _mm512_cvtepi32_ps(_mm512_mullo_epi32(q, scales));
      _mm512_storeu_ps(out + 16 * half,
                       _mm512_fmadd_ps(values, _mm512_set1_ps(scale), _mm512_set1_ps(offset)));
    }
  }
  static float sum(Acc acc) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
  }
  // The prefill GEMM's tile: 12 x 2 vectors, 24 of the 32 registers.
  static constexpr int kGemmRows = 12, kGemmVecs = 2, kFloats = 16;
  using Floats = __m512;
  static Floats load(const float* p) { return _mm512_loadu_ps(p); }
  static Floats broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static Floats fmadd(Floats a, Floats b, Floats c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, Floats v) { _mm512_storeu_ps(p, v); }
  static Floats mul(Floats a, Floats b) { return _mm512_mul_ps(a, b); }
  // The prefill byte GEMM: four activation rows against two vectors of 16 weight rows (four
  // rows beat three, five or six).
  // vpdpbusd adds each lane's 4 products into int32 at once: no int16 pairs, so a partial sum
  // takes a whole sub-block (|u . x| <= 32 * 63 * 127).
  static constexpr bool kByteGemm = true;
  static constexpr int kByteGemmRows = 4;
  using Quads = __m512i;
  template <BlockFormat>
  static constexpr int kPartialSumQuads = kSubBlockValues / 4;
  static void store_bytes(uint8_t* p, __m256i w) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w);
  }
  static void store_bytes(uint8_t* p, Q6KWeights w) { store_bytes(p, w.u); }
  static Quads load_quads(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static Quads broadcast_quad(const int8_t* p) {
    return _mm512_set1_epi32(int(read_u32(reinterpret_cast<const uint8_t*>(p))));
  }
  static Quads zero_quads() { return _mm512_setzero_si512(); }
  static Quads add_quad_products(Quads w, Quads x, Quads sums) {
    return _mm512_dpbusd_epi32(sums, w, x);
  }
  static Quads lane_sums(Quads sums) { return sums; }
  static Quads add_ints(Quads a, Quads b) { return _mm512_add_epi32(a, b); }
  static Floats scale_ints(Quads ints, Floats scale, Floats acc) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), scale, acc);
  }
  static float sum(Floats v) { return _mm512_reduce_add_ps(v); }
  // FP8: four weight rows' streams in flight, as the decode tiles above; 2 x 4 x 2
  // accumulators of the 32 registers.
  static constexpr int kFp8ActRows = 2, kFp8TileRows = 4;
  struct Fp8Values {
    __m512 low, high;  // values 0-15, 16-31
  };
  static Fp8Values fp8_values(const uint8_t* codes) {
    // Each code in the high byte of a 16-bit lane, shifted right arithmetically by one with
    // bit 14 (the sign's copy) cleared: (s << 15) | (eeeemmm << 7), fp8_half_bits.
    const __m512i words = _mm512_slli_epi16(
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes))), 8);
    const __m512i halves =
        _mm512_and_si512(_mm512_srai_epi16(words, 1), _mm512_set1_epi16(int16_t(0xbfff)));
    return {_mm512_cvtph_ps(_mm512_castsi512_si256(halves)),
            _mm512_cvtph_ps(_mm512_extracti64x4_epi64(halves, 1))};
  }
  static Floats fp8_dot(const Fp8Values& w, const float* x) {
    return _mm512_fmadd_ps(w.high, _mm512_loadu_ps(x + 16),
                           _mm512_mul_ps(w.low, _mm512_loadu_ps(x)));
  }
  static void fp8_store(const Fp8Values& w, float scale, float* out) {
    const __m512 s = _mm512_set1_ps(scale), two_8 = _mm512_set1_ps(256.f);
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_mul_ps(w.low, two_8), s));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(_mm512_mul_ps(w.high, two_8), s));
  }
};

// Decode rows of the interleaved layouts (block_formats.h: kInterleavedTypes). A 64-byte chunk
// run holds 4 bytes of each of a group's 16 rows: its low nibbles are 4 values of every row, its
// high nibbles 4 more, so one vpdpbusd multiplies 4 values of 16 rows and the rows' sums stay in
// the lanes. Per 32 values and activation row that is 8 vpdpbusd and a float multiply-add or
// two for all 16 rows, where the row-major kernel takes 2 and 1 a row, and sums its lanes at
// the end: a third of the instructions, so the product streams at the memory's speed.

// A block's runs of nibbles as the 16 rows' integers, lanes of 4: run q's low nibbles (low[q])
// and its high nibbles (high[q]); and their products with an activation row's bytes.
struct NibbleRuns {
  __m512i low[8], high[8];
  template <int kRuns>
  void load(const uint8_t* chunks) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    for (int q = 0; q < kRuns; ++q) {
      const __m512i run = _mm512_loadu_si512(chunks + 64 * q);
      low[q] = _mm512_and_si512(run, mask);
      high[q] = _mm512_and_si512(_mm512_srli_epi16(run, 4), mask);
    }
  }
  // Q5_0's fifth bits of values 4q.. (bits 4q.. of a row's 32) and 16 + 4q.., from the lanes'
  // 32-bit words `bits`: the byte holding them copied to a lane's 4 bytes (vpshufb), byte k's
  // bit tested (vptestmb) into 16 or 0.
  void add_fifth_bits(__m512i bits) {
    const __m512i sixteen = _mm512_set1_epi8(16);
    // Byte 4k of each 128-bit lane's word k, 4 times: vpshufb's indices of a lane's first byte.
    const __m512i first_bytes = _mm512_broadcast_i32x4(_mm_set_epi32(0x0c0c0c0c, 0x08080808,
                                                                     0x04040404, 0));
    for (int q = 0; q < 4; ++q) {
      const __m512i pick_bit = _mm512_set1_epi32(0x08040201 << (4 * (q % 2)));
      for (int half = 0; half < 2; ++half) {
        const int byte = 2 * half + q / 2;  // of the lane's word: bits 8 byte .. 8 byte + 7
        const __m512i copies = _mm512_shuffle_epi8(
            bits, _mm512_add_epi32(_mm512_set1_epi32(0x01010101 * byte), first_bytes));
        const __m512i fifth =
            _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(copies, pick_bit), sixteen);
        (half ? high : low)[q] = _mm512_or_si512((half ? high : low)[q], fifth);
      }
    }
  }
  // The runs' products with one sub-block's activation bytes x: values 4q.. and 16 + 4q...
  __m512i dot(const uint8_t* x) const {
    __m512i low_sums = _mm512_setzero_si512(), high_sums = _mm512_setzero_si512();
    for (int q = 0; q < 4; ++q) {
      low_sums =
          _mm512_dpbusd_epi32(low_sums, low[q], _mm512_set1_epi32(int(read_u32(x + 4 * q))));
      high_sums = _mm512_dpbusd_epi32(high_sums, high[q],
                                      _mm512_set1_epi32(int(read_u32(x + 16 + 4 * q))));
    }
    return _mm512_add_epi32(low_sums, high_sums);
  }
  // A Q4_K pair's runs: values 4q.. of sub-block x_low (low nibbles) and of x_high.
  void q4_k_dots(const uint8_t* x_low, const uint8_t* x_high, __m512i& low_sums,
                 __m512i& high_sums) const {
    low_sums = high_sums = _mm512_setzero_si512();
    for (int q = 0; q < 8; ++q) {
      low_sums =
          _mm512_dpbusd_epi32(low_sums, low[q], _mm512_set1_epi32(int(read_u32(x_low + 4 * q))));
      high_sums = _mm512_dpbusd_epi32(high_sums, high[q],
                                      _mm512_set1_epi32(int(read_u32(x_high + 4 * q))));
    }
  }
};

// Q8_0's block as the 16 rows' integers: run q holds values 4q..4q+3 of every row, plus 128
// (vpdpbusd takes them unsigned; the zero point comes back through the activations' sums).
struct ByteRuns {
  __m512i runs[8];
  template <int kRuns>
  void load(const uint8_t* chunks) {
    static_assert(kRuns == 8);
    const __m512i sign = _mm512_set1_epi8(char(0x80));
    for (int q = 0; q < 8; ++q)
      runs[q] = _mm512_xor_si512(_mm512_loadu_si512(chunks + 64 * q), sign);
  }
  __m512i dot(const uint8_t* x) const {
    __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
    for (int q = 0; q < 8; q += 2) {
      even = _mm512_dpbusd_epi32(even, runs[q], _mm512_set1_epi32(int(read_u32(x + 4 * q))));
      odd = _mm512_dpbusd_epi32(odd, runs[q + 1],
                                _mm512_set1_epi32(int(read_u32(x + 4 * q + 4))));
    }
    return _mm512_add_epi32(even, odd);
  }
};

// A block's runs against int16 activations, x = 256 high + low: 256 (u.high) + u.low, at most
// 32 * 255 * 32767 (Q8_0's bytes plus 128; 31 for Q5_0).
template <class Runs>
inline __m512i split_dot(const Runs& runs, const uint8_t* high_x, const uint8_t* low_x) {
  return _mm512_add_epi32(_mm512_slli_epi32(runs.dot(high_x), 8), runs.dot(low_x));
}

inline const uint8_t* activation_bytes(const int8_t* bytes, int64_t i) {
  return reinterpret_cast<const uint8_t*>(bytes + i * kSubBlockValues);
}

inline __m512 float16s(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store_rows(const __m512 (&acc)[4], int m_count, int64_t row0, const float* bias,
                       float* y, int64_t ldy) {
  for (int m = 0; m < m_count; ++m) {
    const __m512 sums = bias ? _mm512_add_ps(acc[m], _mm512_loadu_ps(bias)) : acc[m];
    _mm512_storeu_ps(y + (row0 + m) * ldy, sums);
  }
}

// Rows row0.. row0 + M - 1 against a group of 32-value blocks: per block, the 16 scales; Q4_1's
// 16 minimums, Q5_0's 16 words of fifth bits; then 4 runs of nibbles (Q8_0: 8 of bytes).
template <BlockFormat F, int M>
inline void interleaved_block32_tile(const ActivationBlocks& x, int64_t row0,
                                     const uint8_t* group, const float* bias, float* y,
                                     int64_t ldy) {
  constexpr int64_t kRowBytes = block_layout(F).bytes, kBlockBytes = kInterleavedRows * kRowBytes;
  constexpr int kRunCount = F == BlockFormat::kQ8_0 ? 8 : 4;
  constexpr int64_t kRuns = kBlockBytes - 64 * kRunCount;  // the runs end the block
  __m512 acc[4];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    const uint8_t* block = group + b * kBlockBytes;
    prefetch_interleaved<kBlockBytes>(block);
    std::conditional_t<F == BlockFormat::kQ8_0, ByteRuns, NibbleRuns> runs;
    runs.template load<kRunCount>(block + kRuns);
    if constexpr (F == BlockFormat::kQ5_0)
      runs.add_fifth_bits(_mm512_loadu_si512(block + 2 * kInterleavedRows));
    const __m512 scales = float16s(block);
    for (int m = 0; m < M; ++m) {
      const int64_t i = (row0 + m) * x.blocks + b;
      __m512i ints;
      if constexpr (kByteActivations<F>)
        ints = runs.dot(activation_bytes(x.low, i));
      else
        ints = split_dot(runs, activation_bytes(x.high, i), activation_bytes(x.low, i));
      // d (s u.x - z s sum x): the block's sum with the zero point z, times each row's scale;
      // Q4_1's minimums m (s sum x) apart.
      const __m512 dots =
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), _mm512_set1_ps(x.scales[i]),
                          _mm512_set1_ps(-kZeroPoint<F> * x.sums[i]));
      acc[m] = _mm512_fmadd_ps(dots, scales, acc[m]);
      if constexpr (F == BlockFormat::kQ4_1)
        acc[m] = _mm512_fmadd_ps(float16s(block + 2 * kInterleavedRows),
                                 _mm512_set1_ps(x.sums[i]), acc[m]);
    }
  }
  store_rows(acc, M, row0, bias, y, ldy);
}

// Rows row0.. row0 + M - 1 against a Q4_K group: per super-block, the 16 d, the 16 dmin, the 12
// bytes of 6-bit scales and mins (byte k of each row, row after row), then the 4 pairs of
// sub-blocks' 8 runs each (low nibbles sub-block 2p, high 2p + 1).
template <int M>
inline void interleaved_q4_k_tile(const ActivationBlocks& x, int64_t row0, const uint8_t* group,
                                  const float* bias, float* y, int64_t ldy) {
  constexpr int64_t kBlockBytes = kInterleavedRows * 144;
  __m512 acc[4];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.blocks / 8; ++b) {
    const uint8_t* block = group + b * kBlockBytes;
    prefetch_interleaved<kBlockBytes>(block);
    // The sub-blocks' scales and mins of the 16 rows (block_formats.h: unpack_k_scales), as
    // floats, kept in memory: each is a multiply-add's operand once per activation row.
    alignas(64) float scales[8][kInterleavedRows], mins[8][kInterleavedRows];
    {
      __m128i packed[12];
      for (int k = 0; k < 12; ++k)
        packed[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 64 + 16 * k));
      const __m128i six = _mm_set1_epi8(63), four = _mm_set1_epi8(0x0f), two = _mm_set1_epi8(3);
      // The top 2 bits of each byte of v, moved to bits 4-5.
      const auto top = [&](__m128i v) {
        return _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(v, 6), two), 4);
      };
      for (int j = 0; j < 8; ++j) {
        const __m128i scale =
            j < 4 ? _mm_and_si128(packed[j], six)
                  : _mm_or_si128(_mm_and_si128(packed[j + 4], four), top(packed[j - 4]));
        const __m128i min =
            j < 4 ? _mm_and_si128(packed[j + 4], six)
                  : _mm_or_si128(_mm_and_si128(_mm_srli_epi16(packed[j + 4], 4), four),
                                 top(packed[j]));
        _mm512_store_ps(scales[j], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scale)));
        _mm512_store_ps(mins[j], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(min)));
      }
    }
    __m512 sums[4], min_sums[4];
    for (int m = 0; m < M; ++m) sums[m] = min_sums[m] = _mm512_setzero_ps();
    for (int p = 0; p < 4; ++p) {
      NibbleRuns runs;
      runs.load<8>(block + 256 + 512 * p);
      for (int m = 0; m < M; ++m) {
        const int64_t i = (row0 + m) * x.blocks + 8 * b + 2 * p;  // sub-block 2p's activations
        __m512i low_sums, high_sums;
        runs.q4_k_dots(activation_bytes(x.low, i), activation_bytes(x.low, i + 1), low_sums,
                       high_sums);
        // sc s u.x per sub-block, and mn s sum x for the mins.
        sums[m] = _mm512_fmadd_ps(
            _mm512_mul_ps(_mm512_cvtepi32_ps(low_sums), _mm512_set1_ps(x.scales[i])),
            _mm512_load_ps(scales[2 * p]), sums[m]);
        sums[m] = _mm512_fmadd_ps(
            _mm512_mul_ps(_mm512_cvtepi32_ps(high_sums), _mm512_set1_ps(x.scales[i + 1])),
            _mm512_load_ps(scales[2 * p + 1]), sums[m]);
        min_sums[m] = _mm512_fmadd_ps(_mm512_load_ps(mins[2 * p]), _mm512_set1_ps(x.sums[i]),
                                      min_sums[m]);
        min_sums[m] = _mm512_fmadd_ps(_mm512_load_ps(mins[2 * p + 1]),
                                      _mm512_set1_ps(x.sums[i + 1]), min_sums[m]);
      }
    }
    const __m512 d = float16s(block), dmin = float16s(block + 2 * kInterleavedRows);
    for (int m = 0; m < M; ++m) {
      acc[m] = _mm512_fmadd_ps(d, sums[m], acc[m]);
      acc[m] = _mm512_fnmadd_ps(dmin, min_sums[m], acc[m]);
    }
  }
  store_rows(acc, M, row0, bias, y, ldy);
}

// Rows row0.. row0 + M - 1 against a Q6_K group: per super-block, the 32 runs of low 4 bits
// (row bytes 4r..4r+3 each), the 16 runs of high 2 bits, the 16 int8 scales (scale k of every
// row, row after row), the 16 d. Run c of a half's low bits with run 8 + c and high-bit run c
// make values 4c.. of its 4 sub-blocks (block_formats.h). `zeros`: 32 times each 16 activation
// values' sum, the zero point's share of each scale group (activation row after row).
template <int M>
inline void interleaved_q6_k_tile(const ActivationBlocks& x, const int32_t* zeros, int64_t row0,
                                  const uint8_t* group, const float* bias, float* y,
                                  int64_t ldy) {
  constexpr int64_t kBlockBytes = kInterleavedRows * 210, kHighBits = 2048, kScales = 3072;
  const __m512i four = _mm512_set1_epi8(0x0f), two = _mm512_set1_epi8(0x30);
  __m512 acc[4];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.blocks / 8; ++b) {
    const uint8_t* block = group + b * kBlockBytes;
    prefetch_interleaved<kBlockBytes>(block);
    __m512 sums[4];
    for (int m = 0; m < M; ++m) sums[m] = _mm512_setzero_ps();
    for (int half = 0; half < 2; ++half) {
      for (int quarter = 0; quarter < 2; ++quarter) {  // values 16 quarter.. of each sub-block
        __m512i dots[4][4];  // [activation row][sub-block of the half]
        for (int m = 0; m < M; ++m)
          for (int k = 0; k < 4; ++k) dots[m][k] = _mm512_setzero_si512();
        for (int c = 4 * quarter; c < 4 * quarter + 4; ++c) {
          const uint8_t* low_bits = block + 64 * (16 * half + c);
          const __m512i low = _mm512_loadu_si512(low_bits);
          const __m512i high = _mm512_loadu_si512(low_bits + 64 * 8);
          const __m512i top = _mm512_loadu_si512(block + kHighBits + 64 * (8 * half + c));
          // (lo & 0x0f) | (hi & 0x30), one vpternlogd.
          const auto merge = [&](__m512i lo, __m512i hi) {
            return _mm512_ternarylogic_epi32(lo, four, _mm512_and_si512(hi, two), 0xea);
          };
          const __m512i u[4] = {merge(low, _mm512_slli_epi16(top, 4)),
                                merge(high, _mm512_slli_epi16(top, 2)),
                                merge(_mm512_srli_epi16(low, 4), top),
                                merge(_mm512_srli_epi16(high, 4), _mm512_srli_epi16(top, 2))};
          for (int m = 0; m < M; ++m) {
            const int64_t i = (row0 + m) * x.blocks + 8 * b + 4 * half;
            for (int k = 0; k < 4; ++k)
              dots[m][k] = _mm512_dpbusd_epi32(
                  dots[m][k], u[k],
                  _mm512_set1_epi32(int(read_u32(activation_bytes(x.low, i + k) + 4 * c))));
          }
        }
        // sc (u - 32) . x per scale group: |.| <= 128 * 16 * 32 * 127 < 2^24, exact as a float.
        for (int k = 0; k < 4; ++k) {
          const int scale_group = 2 * (4 * half + k) + quarter;
          const __m512i scales = _mm512_cvtepi8_epi32(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(block + kScales + 16 * scale_group)));
          for (int m = 0; m < M; ++m) {
            const int64_t i = (row0 + m) * x.blocks + 8 * b + 4 * half + k;
            const __m512i ints = _mm512_mullo_epi32(
                _mm512_sub_epi32(dots[m][k], _mm512_set1_epi32(zeros[2 * i + quarter])), scales);
            sums[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), _mm512_set1_ps(x.scales[i]),
                                      sums[m]);
          }
        }
      }
    }
    const __m512 d = float16s(block + kScales + 256);
    for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(d, sums[m], acc[m]);
  }
  store_rows(acc, M, row0, bias, y, ldy);
}

template <BlockFormat F>
void interleaved_decode_rows(const ActivationBlocks& x, const uint8_t* w, int64_t ldw,
                             int64_t begin, int64_t end, const float* bias, float* y,
                             int64_t ldy) {
  static_assert(Avx512::kActRows <= 4);
  // Q6_K's zero point: 32 times each 16 activation values' sum, once for all the rows.
  std::vector<int32_t> zeros(F == BlockFormat::kQ6_K ? 2 * x.rows * x.blocks : 0);
  for (size_t g = 0; g < zeros.size(); ++g) {
    int32_t sum = 0;
    for (int j = 0; j < 16; ++j) sum += x.low[16 * g + j];
    zeros[g] = 32 * sum;
  }
  for (int64_t n = begin; n < end; n += kInterleavedRows) {
    for_row_tiles<Avx512::kActRows>(x.rows, [&](auto rows, int64_t m) {
      constexpr int M = decltype(rows)::value;
      const float* group_bias = bias ? bias + n : nullptr;
      if constexpr (F == BlockFormat::kQ4_K)
        interleaved_q4_k_tile<M>(x, m, w + n * ldw, group_bias, y + n, ldy);
      else if constexpr (F == BlockFormat::kQ6_K)
        interleaved_q6_k_tile<M>(x, zeros.data(), m, w + n * ldw, group_bias, y + n, ldy);
      else
        interleaved_block32_tile<F, M>(x, m, w + n * ldw, group_bias, y + n, ldy);
    });
  }
}

}  // namespace

CpuKernels cpu_kernels_avx512(BlockFormat format) {
  CpuKernels kernels = cpu_kernels_for<Avx512>(format);
  visit_block_format(format, [&](auto f) {
    constexpr BlockFormat F = decltype(f)::value;
    if constexpr (is_interleaved_type(kInterleavedTypes + int64_t(F)))
      kernels.interleaved_decode_rows = &interleaved_decode_rows<F>;
  });
  return kernels;
}

}  // namespace fastllm
#else
namespace fastllm {
CpuKernels cpu_kernels_avx512(BlockFormat) { return {}; }
}  // namespace fastllm
#endif
