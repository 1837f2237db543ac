// The quantized CPU kernels with AVX2 and FMA: this file is compiled with those flags (and
// without AVX-512's) whatever the build targets (CMakeLists.txt), and runs on CPUs that have
// them but not AVX-512 VNNI, or when FASTLLM_CPU_ISA=avx2 (common/cpu_isa.h). The weights'
// integers are widened to int16 and meet the activations' int16 in vpmaddwd.
#include "quantized/quantized_cpu.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "quantized/block_bytes_avx2.h"
#include "quantized/quantized_cpu_kernel.h"

namespace fastllm {
namespace {

struct Avx2 {
  // 16 registers: two activation rows' accumulators for four weight rows, and their operands.
  static constexpr int kActRows = 2, kTileRows = 4;
  struct Ints {
    __m256i low, high;  // values 0..15, 16..31
  };
  using Acc = __m256;

  template <BlockFormat F, int kSub>
  static Ints weights(const uint8_t* block) {
    const __m256i bytes = sub_block_bytes<F, kSub>(block);
    const __m128i low = _mm256_castsi256_si128(bytes), high = _mm256_extracti128_si256(bytes, 1);
    if constexpr (F != BlockFormat::kQ6_K) {  // unsigned
      return {_mm256_cvtepu8_epi16(low), _mm256_cvtepu8_epi16(high)};
    } else {  // (q - 32) times the scale of its half
      const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192 + 2 * kSub);
      const __m256i zero = _mm256_set1_epi16(32);
      return {_mm256_mullo_epi16(_mm256_sub_epi16(_mm256_cvtepu8_epi16(low), zero),
                                 _mm256_set1_epi16(scales[0])),
              _mm256_mullo_epi16(_mm256_sub_epi16(_mm256_cvtepu8_epi16(high), zero),
                                 _mm256_set1_epi16(scales[1]))};
    }
  }
  template <BlockFormat F>
  static Ints activations(const ActivationBlocks& x, int64_t i) {
    const int16_t* p = x.values + i * kSubBlockValues;
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))};
  }
  static Acc zero() { return _mm256_setzero_ps(); }
  // A lane sums 4 products of at most 4096 * 32767 (Q6_K) or 255 * 32767: an int32.
  static Acc dot_fma(Ints w, Ints x, float scale, Acc acc) {
    const __m256i dots = _mm256_add_epi32(_mm256_madd_epi16(w.low, x.low),
                                          _mm256_madd_epi16(w.high, x.high));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_set1_ps(scale), acc);
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
  static float sum(Acc acc) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
  }
};

}  // namespace

CpuKernels cpu_kernels_avx2(BlockFormat format) { return cpu_kernels_for<Avx2>(format); }

}  // namespace fastllm
#else
namespace fastllm {
CpuKernels cpu_kernels_avx2(BlockFormat) { return {}; }
}  // namespace fastllm
#endif
