// The decode-path kernel with AVX-512 (BW, VL, VNNI): this file is compiled with those flags
// whatever the build targets (CMakeLists.txt) and runs only on CPUs that have them
// (common/cpu_isa.h). vpdpwssd takes a sub-block's 32 int16 products in one instruction.
#include "quantized/quantized_cpu.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "quantized/block_bytes_avx2.h"
#include "quantized/quantized_cpu_kernel.h"

namespace fastllm {
namespace {

struct Avx512 {
  static constexpr int kActRows = 4, kTileRows = 4;
  using Ints = __m512i;
  using Acc = __m512;

  template <BlockFormat F, int kSub>
  static Ints weights(const uint8_t* block) {
    const __m512i q = _mm512_cvtepi8_epi16(sub_block_bytes<F, kSub>(block));
    if constexpr (F != BlockFormat::kQ6_K) return q;
    const __m512i scales = _mm512_mask_set1_epi16(_mm512_set1_epi16(q6_k_scale<kSub>(block, 0)),
                                                  0xffff0000u, q6_k_scale<kSub>(block, 1));
    return _mm512_mullo_epi16(q, scales);
  }
  static Ints activations(const int16_t* p) { return _mm512_loadu_si512(p); }
  static Acc zero() { return _mm512_setzero_ps(); }
  // A lane sums two products of at most 4096 * 32767: an int32, and a float within 2^-24.
  static Acc dot_fma(Ints w, Ints x, float scale, Acc acc) {
    const __m512i dots = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w, x);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_set1_ps(scale), acc);
  }
  static float sum(Acc acc) { return _mm512_reduce_add_ps(acc); }
};

}  // namespace

DecodeRowsFn decode_rows_avx512(BlockFormat format) { return decode_rows_for<Avx512>(format); }

}  // namespace fastllm
#else
namespace fastllm {
DecodeRowsFn decode_rows_avx512(BlockFormat) { return nullptr; }
}  // namespace fastllm
#endif
