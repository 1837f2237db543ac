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
  // streams in flight (a Qwen3-0.6B shape's Q8_0 products, 2 threads: 13 -> 17.6 GB/s).
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
  // rows took 0.91-0.95x the time of three, five or six; SmolLM2's Q4_0 layers, one thread).
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
};

// Decode rows of Q4_0 weights in the interleaved layout (quantized.h: kInterleavedQ4_0). One
// 64-byte run holds 4 bytes of each of a group's 16 rows: its low nibbles are values 4q..4q+3
// of every row, its high nibbles 16 + 4q.., so one vpdpbusd multiplies 4 values of 16 rows and
// the rows' sums stay in the lanes. Per block and activation row that is 8 vpdpbusd and one
// float multiply-add for the 16 rows, where the row-major kernel takes 2 and 1 a row, and sums
// its lanes at the end: a third of the instructions (SmolLM2's Q4_0 layers from L2, one
// thread: 2.5x the speed), so the product streams at the memory's speed.
constexpr int64_t kInterleavedBlockBytes = kInterleavedRows * 18;
// Weight bytes fetched this far ahead of the block in use (into L1: one stream a thread): 16
// blocks, 4.5 KiB (SmolLM2's Q4_0 layers, 2 threads: 1.2-1.3x the speed of no prefetch, 1152
// and 2304 bytes ahead took 1.05-1.1x the time).
constexpr int64_t kInterleavedPrefetchBytes = 16 * kInterleavedBlockBytes;

// out rows (row0 + m) . (the group's 16 weight rows), for M activation rows, as decode_rows.
template <int M>
inline void interleaved_q4_0_tile(const ActivationBlocks& x, int64_t row0, const uint8_t* group,
                                  const float* bias, float* y, int64_t ldy) {
  const __m512i mask = _mm512_set1_epi8(0x0f);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    const uint8_t* block = group + b * kInterleavedBlockBytes;
    for (int64_t line = 0; line < kInterleavedBlockBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block + kInterleavedPrefetchBytes + line),
                   _MM_HINT_T0);
    __m512i low[4], high[4];
    for (int q = 0; q < 4; ++q) {
      const __m512i run = _mm512_loadu_si512(block + 2 * kInterleavedRows + 64 * q);
      low[q] = _mm512_and_si512(run, mask);
      high[q] = _mm512_and_si512(_mm512_srli_epi16(run, 4), mask);
    }
    const __m512 scales = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
    for (int m = 0; m < M; ++m) {
      const int64_t i = (row0 + m) * x.blocks + b;
      const uint8_t* xs = reinterpret_cast<const uint8_t*>(x.low + i * kSubBlockValues);
      __m512i low_sums = _mm512_setzero_si512(), high_sums = _mm512_setzero_si512();
      for (int q = 0; q < 4; ++q) {
        low_sums = _mm512_dpbusd_epi32(low_sums, low[q], _mm512_set1_epi32(int(read_u32(xs + 4 * q))));
        high_sums =
            _mm512_dpbusd_epi32(high_sums, high[q], _mm512_set1_epi32(int(read_u32(xs + 16 + 4 * q))));
      }
      // d (s u.x - 8 s sum x): the block's sum with Q4_0's zero point, times each row's scale.
      const __m512 dots = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(_mm512_add_epi32(low_sums, high_sums)), _mm512_set1_ps(x.scales[i]),
          _mm512_set1_ps(-kZeroPoint<BlockFormat::kQ4_0> * x.sums[i]));
      acc[m] = _mm512_fmadd_ps(dots, scales, acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    const __m512 sums = bias ? _mm512_add_ps(acc[m], _mm512_loadu_ps(bias)) : acc[m];
    _mm512_storeu_ps(y + (row0 + m) * ldy, sums);
  }
}

void interleaved_q4_0_decode_rows(const ActivationBlocks& x, const uint8_t* w, int64_t ldw,
                                  int64_t begin, int64_t end, const float* bias, float* y,
                                  int64_t ldy) {
  for (int64_t n = begin; n < end; n += kInterleavedRows) {
    for_row_tiles<Avx512::kActRows>(x.rows, [&](auto rows, int64_t m) {
      interleaved_q4_0_tile<decltype(rows)::value>(x, m, w + n * ldw, bias ? bias + n : nullptr,
                                                   y + n, ldy);
    });
  }
}

}  // namespace

CpuKernels cpu_kernels_avx512(BlockFormat format) {
  CpuKernels kernels = cpu_kernels_for<Avx512>(format);
  if (format == BlockFormat::kQ4_0) kernels.interleaved_decode_rows = &interleaved_q4_0_decode_rows;
  return kernels;
}

}  // namespace fastllm
#else
namespace fastllm {
CpuKernels cpu_kernels_avx512(BlockFormat) { return {}; }
}  // namespace fastllm
#endif
