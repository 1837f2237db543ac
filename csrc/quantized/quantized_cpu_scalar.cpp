// The quantized CPU kernels in plain C++: any CPU, compiled with the build's own flags. The
// reference for the SIMD kernels' structure, and what runs where they cannot.
#include <cmath>

#include "quantized/quantized_cpu_kernel.h"

namespace fastllm {
namespace {

struct Scalar {
  static constexpr bool kByteGemm = false;  // prefill rows take the float32 GEMM
  static constexpr int kActRows = 4;
  template <BlockFormat>
  static constexpr int kTileRows = 4;
  template <BlockFormat>
  static constexpr int kOneRowTileRows = 4;
  static constexpr bool kSignedQ8_0 = false;
  struct Ints {
    int16_t v[kSubBlockValues];
  };
  using Acc = float;

  template <BlockFormat F, int kSub>
  static Ints weights(const uint8_t* block) {
    Ints q;
    sub_block_ints<F>(block, kSub, q.v);
    return q;
  }
  template <BlockFormat F>
  static const int16_t* activations(const ActivationBlocks& x, int64_t i) {
    return x.values + i * kSubBlockValues;
  }
  static Acc zero() { return 0.f; }
  static Acc dot_fma(const Ints& w, const int16_t* x, const float* scale, Acc acc) {
    int64_t dot = 0;  // 32 products of up to 4096 * 32639 would overflow an int32
    for (int j = 0; j < kSubBlockValues; ++j) dot += int32_t(w.v[j]) * x[j];
    return std::fma(float(dot), *scale, acc);
  }
  static void store_values(const Ints& w, float scale, float offset, float* out) {
    for (int j = 0; j < kSubBlockValues; ++j) out[j] = std::fma(float(w.v[j]), scale, offset);
  }
  static float sum(Acc acc) { return acc; }
  static constexpr int kGemmRows = 4, kGemmVecs = 4, kFloats = 1;
  using Floats = float;
  static Floats load(const float* p) { return *p; }
  static Floats broadcast(const float* p) { return *p; }
  static Floats fmadd(Floats a, Floats b, Floats c) { return std::fma(a, b, c); }
  static void store(float* p, Floats v) { *p = v; }
  static Floats mul(Floats a, Floats b) { return a * b; }
  static constexpr int kFp8ActRows = 4, kFp8TileRows = 1;
  struct Fp8Values {
    float v[kSubBlockValues];
  };
  static Fp8Values fp8_values(const uint8_t* codes) {
    Fp8Values w;
    for (int j = 0; j < kSubBlockValues; ++j) w.v[j] = half_to_float(fp8_half_bits(codes[j]));
    return w;
  }
  static Floats fp8_dot(const Fp8Values& w, const float* x) {
    float dot = 0.f;
    for (int j = 0; j < kSubBlockValues; ++j) dot = std::fma(w.v[j], x[j], dot);
    return dot;
  }
  static void fp8_store(const Fp8Values& w, float scale, float* out) {
    for (int j = 0; j < kSubBlockValues; ++j) out[j] = w.v[j] * 256.f * scale;
  }
};

}  // namespace

CpuKernels cpu_kernels_scalar(BlockFormat format) { return cpu_kernels_for<Scalar>(format); }

}  // namespace fastllm
