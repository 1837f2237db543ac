// Block-quantized matmul on the CPU.
//
// Decode rows (a few activation rows) stream the weights, so their cost is bytes: the weight
// stays in its 4.5 to 8.5 bits per value, and the activations are quantized on the fly to int16
// blocks of 32 (one float scale each), so each block's dot product is integer multiply-adds of
// int16 pairs (AVX-512 VNNI's vpdpwssd where present, else vpmaddwd) and one float multiply.
// Prefill rows are compute-bound: tiles of weight rows are dequantized to float32 and go through
// ATen's GEMM.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include "common/dispatch.h"
#include "quantized/quantized.h"

namespace fastllm {
namespace {

// Up to this many activation rows the integer kernel streams the weights once for all of them;
// past it the product is compute-bound and the dequantize + GEMM path wins.
constexpr int64_t kMaxStreamRows = 16;
// Activation rows and weight rows of one register tile.
constexpr int kActRows = 4;
constexpr int kTileRows = 4;
// Weight rows dequantized at a time on the GEMM path (a tile of a few hundred KiB stays in L2).
constexpr int64_t kGemmTileRows = 128;

// Activations quantized per row and block of 32 to int16 with one float scale (amax / 32767):
// exact to about 1e-5 of the block's largest value, where ggml's int8 activations (1/127) flip
// near-tied logits. Each block keeps its scaled sum too, for the weights' offsets:
// sum_j (s q_j + o) x_j = s sum_j q_j x_j + o sum_j x_j.
struct QuantizedActivations {
  int64_t rows = 0, blocks = 0;
  std::vector<int16_t> values;  // [rows, blocks * 32]
  std::vector<float> scales;    // [rows, blocks]
  std::vector<float> sums;      // [rows, blocks]: scale * sum of the block's values

  const int16_t* block(int64_t row, int64_t b) const {
    return values.data() + (row * blocks + b) * kBlockValues;
  }
};

QuantizedActivations quantize_activations(const float* x, int64_t rows, int64_t k_len) {
  QuantizedActivations q;
  q.rows = rows;
  q.blocks = k_len / kBlockValues;
  q.values.resize(rows * k_len);
  q.scales.resize(rows * q.blocks);
  q.sums.resize(rows * q.blocks);
  for (int64_t i = 0; i < rows * q.blocks; ++i) {
    const float* src = x + i * kBlockValues;
    float amax = 0.f;
    for (int j = 0; j < kBlockValues; ++j) amax = std::max(amax, std::fabs(src[j]));
    const float scale = amax / 32767.f;
    const float inverse = scale > 0.f ? 1.f / scale : 0.f;
    int16_t* dst = q.values.data() + i * kBlockValues;
    int64_t sum = 0;
    for (int j = 0; j < kBlockValues; ++j) {
      dst[j] = int16_t(std::nearbyint(src[j] * inverse));
      sum += dst[j];
    }
    q.scales[i] = scale;
    q.sums[i] = scale * float(sum);
  }
  return q;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// A weight block's 32 integers as int16 (0..15 for the 4-bit formats, -128..127 for Q8_0).
inline __m512i widen_block(BlockFormat format, const uint8_t* block) {
  if (format == BlockFormat::kQ8_0)
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2)));
  const __m128i packed = _mm_loadu_si128(
      reinterpret_cast<const __m128i*>(block + (format == BlockFormat::kQ4_1 ? 4 : 2)));
  const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(0x0f));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0f));
  return _mm512_cvtepu8_epi16(_mm256_set_m128i(high, low));  // values 0..15, then 16..31
}

// Sixteen int32 sums of pairs of int16 products (|q x| <= 128 * 32767: no overflow).
inline __m512i dot_pairs(__m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(_mm512_setzero_si512(), w, x);
#else
  return _mm512_madd_epi16(w, x);
#endif
}
#endif

// out[m][r] = dot(activation row m, weight row r) for M activation rows and R weight rows.
template <int M, int R>
inline void dot_tile(BlockFormat format, const QuantizedActivations& x, int64_t row0,
                     const uint8_t* w, int64_t ldw, float (&out)[M][R]) {
  const int64_t bytes = block_bytes(format);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 acc[M][R];
  float offsets[M][R] = {};
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    __m512i wq[R];
    BlockAffine affine[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* block = w + r * ldw + b * bytes;
      wq[r] = widen_block(format, block);
      affine[r] = block_affine(format, block);
    }
    for (int m = 0; m < M; ++m) {
      const int64_t i = (row0 + m) * x.blocks + b;
      const __m512i xq = _mm512_loadu_si512(x.block(row0 + m, b));
      const float x_scale = x.scales[i], x_sum = x.sums[i];
      for (int r = 0; r < R; ++r) {
        const __m512 dots = _mm512_cvtepi32_ps(dot_pairs(wq[r], xq));
        acc[m][r] = _mm512_fmadd_ps(dots, _mm512_set1_ps(affine[r].scale * x_scale), acc[m][r]);
        // An explicit fma: left to the compiler, contraction could differ between tile sizes,
        // and a row's result would depend on the rows beside it.
        offsets[m][r] = std::fma(affine[r].offset, x_sum, offsets[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m][r] = _mm512_reduce_add_ps(acc[m][r]) + offsets[m][r];
#else
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      float sum = 0.f;
      float values[kBlockValues];
      for (int64_t b = 0; b < x.blocks; ++b) {
        dequantize_block(format, w + r * ldw + b * bytes, values);
        const int16_t* xq = x.block(row0 + m, b);
        float block_sum = 0.f;
        for (int j = 0; j < kBlockValues; ++j) block_sum += values[j] * float(xq[j]);
        sum += block_sum * x.scales[(row0 + m) * x.blocks + b];
      }
      out[m][r] = sum;
    }
  }
#endif
}

template <int R, typename scalar_t>
inline void tile_all_rows(BlockFormat format, const QuantizedActivations& x, const uint8_t* w,
                          int64_t ldw, const scalar_t* bias, scalar_t* y, int64_t ldy,
                          int64_t n) {
  const auto store = [&](auto& sums, int64_t m0, int rows) {
    for (int m = 0; m < rows; ++m)
      for (int r = 0; r < R; ++r)
        y[(m0 + m) * ldy + n + r] = scalar_t(sums[m][r] + (bias ? float(bias[n + r]) : 0.f));
  };
  int64_t m = 0;
  for (; m + kActRows <= x.rows; m += kActRows) {
    float sums[kActRows][R];
    dot_tile<kActRows, R>(format, x, m, w, ldw, sums);
    store(sums, m, kActRows);
  }
  const auto tail = [&](auto rows) {
    float sums[rows][R];
    dot_tile<rows, R>(format, x, m, w, ldw, sums);
    store(sums, m, rows);
  };
  switch (x.rows - m) {
    case 3: tail(std::integral_constant<int, 3>()); break;
    case 2: tail(std::integral_constant<int, 2>()); break;
    case 1: tail(std::integral_constant<int, 1>()); break;
    default: break;
  }
}

template <typename scalar_t>
void stream_quantized(BlockFormat format, const QuantizedActivations& x, const uint8_t* w,
                      int64_t ldw, const scalar_t* bias, scalar_t* y, int64_t n_out) {
  // Grain: enough weight rows per task that their bytes (>= 64 KiB) dwarf its scheduling cost.
  const int64_t grain = std::max<int64_t>(kTileRows, (64 << 10) / std::max<int64_t>(1, ldw));
  at::parallel_for(0, n_out, grain, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    for (; n + kTileRows <= end; n += kTileRows)
      tile_all_rows<kTileRows>(format, x, w + n * ldw, ldw, bias, y, n_out, n);
    for (; n < end; ++n) tile_all_rows<1>(format, x, w + n * ldw, ldw, bias, y, n_out, n);
  });
}

// Rows [begin, end) of the weight as float32 [end - begin, in_features].
void dequantize_rows(BlockFormat format, const uint8_t* w, int64_t ldw, int64_t begin,
                     int64_t end, int64_t in_features, float* out) {
  const int64_t bytes = block_bytes(format), blocks = in_features / kBlockValues;
  for (int64_t r = begin; r < end; ++r)
    for (int64_t b = 0; b < blocks; ++b)
      dequantize_block(format, w + r * ldw + b * bytes,
                       out + (r - begin) * in_features + b * kBlockValues);
}

at::Tensor dequantize_cpu(const at::Tensor& weight, int64_t weight_type, at::ScalarType dtype) {
  int64_t in_features = 0;
  const BlockFormat format = check_quantized_weight(weight, weight_type, in_features);
  const int64_t rows = weight.size(0);
  auto out = at::empty({rows, in_features}, weight.options().dtype(at::kFloat));
  const uint8_t* w = weight.const_data_ptr<uint8_t>();
  float* dst = out.mutable_data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    dequantize_rows(format, w, weight.stride(0), begin, end, in_features,
                    dst + begin * in_features);
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

at::Tensor quantized_linear_cpu(const at::Tensor& x, const at::Tensor& weight,
                                int64_t weight_type, const std::optional<at::Tensor>& bias) {
  const BlockFormat format = check_quantized_linear_inputs(x, weight, weight_type, bias);
  const int64_t rows = x.size(0), n_out = weight.size(0), k_len = x.size(1);
  auto y = at::empty({rows, n_out}, x.options());
  if (rows == 0 || n_out == 0) return y;
  if (k_len == 0) return bias.has_value() ? y.copy_(bias->expand({rows, n_out})) : y.zero_();
  const uint8_t* w = weight.const_data_ptr<uint8_t>();
  const int64_t ldw = weight.stride(0);
  if (rows > kMaxStreamRows) {
    // Compute-bound: dequantized tiles of weight rows through ATen's GEMM, tile by tile, so the
    // float copy never exceeds a tile.
    const auto x_float = x.to(at::kFloat).contiguous();
    auto y_float = x.scalar_type() == at::kFloat ? y : at::empty({rows, n_out}, x_float.options());
    auto tile = at::empty({std::min(kGemmTileRows, n_out), k_len}, x_float.options());
    for (int64_t n = 0; n < n_out; n += kGemmTileRows) {
      const int64_t end = std::min(n_out, n + kGemmTileRows);
      auto w_tile = tile.narrow(0, 0, end - n);
      float* dst = w_tile.mutable_data_ptr<float>();
      at::parallel_for(n, end, 16, [&](int64_t begin, int64_t stop) {
        dequantize_rows(format, w, ldw, begin, stop, k_len, dst + (begin - n) * k_len);
      });
      auto y_tile = y_float.narrow(1, n, end - n);
      at::mm_out(y_tile, x_float, w_tile.t());
    }
    if (bias.has_value()) y_float.add_(bias->to(at::kFloat));
    return x.scalar_type() == at::kFloat ? y : y.copy_(y_float);
  }
  const auto x_float = x.to(at::kFloat).contiguous();
  const QuantizedActivations xq = quantize_activations(x_float.const_data_ptr<float>(), rows,
                                                       k_len);
  const auto bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fastllm::quantized_linear_cpu", [&] {
    stream_quantized(format, xq, w, ldw,
                     bias_c.defined() ? bias_c.const_data_ptr<scalar_t>() : nullptr,
                     y.mutable_data_ptr<scalar_t>(), n_out);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CPU, m) {
  m.impl("quantized_linear", &quantized_linear_cpu);
  m.impl("dequantize", &dequantize_cpu);
}

}  // namespace fastllm
