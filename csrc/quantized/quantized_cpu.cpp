// Block-quantized matmul on the CPU.
//
// Decode rows (a few activation rows) stream the weights, so their cost is bytes: the weight
// stays in its 4.5 to 8.5 bits per value, and the activations are quantized on the fly to int16
// blocks of 32 (one float scale each), so each sub-block's dot product is integer multiply-adds
// and one float multiply-add. Prefill rows are compute-bound: weight rows are repacked a panel
// at a time for a GEMM on the decode rows' byte activations (Q4_0, the K-quants; AVX2 and
// AVX-512), or dequantized to float32 a panel at a time for the ISA's float GEMM, or to tiles
// for oneDNN's bfloat16 GEMM (AMX, and the other formats with AVX512-BF16). FP8 weights
// (block_formats.h: kFp8E4M3, 9 bits per value) keep the activations in float32: their decode
// rows decode the codes in registers for float32 multiply-adds, their prefill rows take the
// dequantized panels or tiles. The kernels
// (quantized_cpu_kernel.h) are built once per instruction set and picked at run time
// (common/cpu_isa.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/batch_invariant.h"
#include "common/cpu_isa.h"
#include "common/dispatch.h"
#include "quantized/quantized.h"
#include "quantized/quantized_cpu.h"

namespace fastllm {
namespace {

// Weight rows dequantized at a time on the GEMM path (a tile of a few hundred KiB stays in L2).
constexpr int64_t kGemmTileRows = 128;

// A row's block as the interleaved layout splits it (block_formats.h: kInterleavedTypes).
struct InterleavedField {
  int64_t offset, bytes, chunk;
};

std::vector<InterleavedField> interleaved_fields(BlockFormat format) {
  switch (format) {
    case BlockFormat::kQ4_0: return {{0, 2, 2}, {2, 16, 4}};
    case BlockFormat::kQ4_1: return {{0, 2, 2}, {2, 2, 2}, {4, 16, 4}};
    case BlockFormat::kQ5_0: return {{0, 2, 2}, {2, 4, 4}, {6, 16, 4}};
    case BlockFormat::kQ8_0: return {{0, 2, 2}, {2, 32, 4}};
    case BlockFormat::kQ4_K: return {{0, 2, 2}, {2, 2, 2}, {4, 12, 1}, {16, 128, 4}};
    case BlockFormat::kQ6_K: return {{0, 128, 4}, {128, 64, 4}, {192, 16, 1}, {208, 2, 2}};
    default: break;
  }
  TORCH_CHECK_VALUE(false, block_layout(format).name, " has no interleaved layout; Q4_0, Q4_1, "
                    "Q5_0, Q8_0, Q4_K and Q6_K have");
  return {};
}

}  // namespace

template <typename x_t>
QuantizedActivations quantize_activations(const x_t* x, int64_t rows, int64_t k_len,
                                          int max_value) {
  QuantizedActivations q;
  q.rows = rows;
  q.blocks = k_len / kSubBlockValues;
  q.values.resize(rows * k_len);
  q.high.resize(rows * k_len);
  q.low.resize(rows * k_len);
  q.scales.resize(rows * q.blocks);
  q.sums.resize(rows * q.blocks);
  for (int64_t i = 0; i < rows * q.blocks; ++i) {
    // The block as float32 (exact from 16 bits).
    float src[kSubBlockValues];
    for (int j = 0; j < kSubBlockValues; ++j) src[j] = float(x[i * kSubBlockValues + j]);
    // The largest |x| as the largest of their bits without the sign, an integer maximum that
    // vectorizes (a float one does not, for its NaN rules); a NaN makes the block's scale NaN,
    // and so the rows' results.
    uint32_t amax_bits = 0;
    for (int j = 0; j < kSubBlockValues; ++j) {
      uint32_t bits;
      __builtin_memcpy(&bits, src + j, sizeof(bits));
      amax_bits = std::max(amax_bits, bits & 0x7fffffffu);
    }
    float amax;
    __builtin_memcpy(&amax, &amax_bits, sizeof(amax));
    const float scale = amax / float(max_value);
    const float inverse = scale > 0.f ? 1.f / scale : 0.f;
    // Local arrays, copied out after: stores through the vectors' int8 data could alias
    // anything, which keeps the compiler from vectorizing the loop.
    int16_t values[kSubBlockValues];
    int8_t high[kSubBlockValues], low[kSubBlockValues];
    int32_t sum = 0;
    for (int j = 0; j < kSubBlockValues; ++j) {
      // Clamped: a subnormal scale's inverse is too coarse to keep the product in range.
      const float max = float(max_value);
      const int32_t value = int32_t(std::clamp(std::nearbyint(src[j] * inverse), -max, max));
      values[j] = int16_t(value);
      low[j] = int8_t(value);  // two's complement: value - low is 256 * high
      high[j] = int8_t((value - low[j]) >> 8);
      sum += value;
    }
    const int64_t at = i * kSubBlockValues;
    std::copy_n(values, kSubBlockValues, q.values.data() + at);
    std::copy_n(high, kSubBlockValues, q.high.data() + at);
    std::copy_n(low, kSubBlockValues, q.low.data() + at);
    q.scales[i] = scale;
    q.sums[i] = scale * float(sum);
  }
  return q;
}

template QuantizedActivations quantize_activations(const float*, int64_t, int64_t, int);
template QuantizedActivations quantize_activations(const c10::BFloat16*, int64_t, int64_t, int);
template QuantizedActivations quantize_activations(const c10::Half*, int64_t, int64_t, int);

CpuKernels isa_kernels(BlockFormat format) {
  CpuKernels kernels{};
  switch (cpu_isa()) {
    case CpuIsa::kAmx:  // the AVX-512 kernels; prefill rows take oneDNN's GEMM
    case CpuIsa::kAvx512: kernels = cpu_kernels_avx512(format); break;
    case CpuIsa::kAvx2: kernels = cpu_kernels_avx2(format); break;
    case CpuIsa::kScalar: kernels = cpu_kernels_scalar(format); break;
  }
  TORCH_INTERNAL_ASSERT(
      (kernels.decode_rows || kernels.float_decode_rows) && kernels.dequantize_rows, "no ",
      cpu_isa_name(cpu_isa()), " kernels in this build");
  return kernels;
}

namespace {

at::Tensor dequantize_cpu(const at::Tensor& weight_in, int64_t weight_type,
                          at::ScalarType dtype) {
  int64_t in_features = 0;
  bool interleaved = false;
  const BlockFormat format = check_quantized_weight(weight_in, weight_type, in_features,
                                                    &interleaved);
  const at::Tensor weight = interleaved ? deinterleave_rows(weight_in, format) : weight_in;
  const int64_t rows = weight.size(0);
  auto out = at::empty({rows, in_features}, weight.options().dtype(at::kFloat));
  const uint8_t* w = weight.const_data_ptr<uint8_t>();
  float* dst = out.mutable_data_ptr<float>();
  const DequantizeRowsFn dequantize_rows = isa_kernels(format).dequantize_rows;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    dequantize_rows(w, weight.stride(0), begin, end, in_features, dst + begin * in_features);
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

// Rows from quantized activations (decode rows, or the byte GEMM's prefill rows: `rows_fn`):
// the activations quantized from x's dtype, the float32 sums of each task's block of at least
// `grain` weight rows (whole units of `unit` rows) rounded to y's dtype by the task (no
// float32 copies of x or y).
template <typename scalar_t>
void quantized_activation_rows(const at::Tensor& x, DecodeRowsFn rows_fn, BlockFormat format,
                               const uint8_t* w, int64_t ldw,
                               const std::optional<at::Tensor>& bias, int64_t grain,
                               int64_t unit, at::Tensor& y) {
  const int64_t rows = x.size(0), n_out = y.size(1), k_len = x.size(1);
  const auto x_c = x.contiguous();
  const QuantizedActivations xq = quantize_activations(x_c.const_data_ptr<scalar_t>(), rows,
                                                       k_len, activation_max(format));
  const ActivationBlocks activations = xq.view();
  const auto bias_float = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bias_data = bias_float.defined() ? bias_float.const_data_ptr<float>() : nullptr;
  constexpr bool direct = std::is_same_v<scalar_t, float>;
  std::vector<float> sums(direct ? 0 : rows * n_out);
  scalar_t* out = y.mutable_data_ptr<scalar_t>();
  float* dst = direct ? reinterpret_cast<float*>(out) : sums.data();
  at::parallel_for(0, n_out / unit, (grain + unit - 1) / unit, [&](int64_t first, int64_t last) {
    const int64_t begin = first * unit, end = last * unit;
    rows_fn(activations, w, ldw, begin, end, bias_data, dst, n_out);
    if constexpr (!direct)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = begin; j < end; ++j) out[r * n_out + j] = scalar_t(dst[r * n_out + j]);
  });
}

at::Tensor quantized_linear_cpu(const at::Tensor& x, const at::Tensor& weight_in,
                                int64_t weight_type, const std::optional<at::Tensor>& bias) {
  bool interleaved = false;
  const BlockFormat format =
      check_quantized_linear_inputs(x, weight_in, weight_type, bias, &interleaved);
  const int64_t rows = x.size(0), n_out = weight_in.size(0), k_len = x.size(1);
  auto y = at::empty({rows, n_out}, x.options());
  if (rows == 0 || n_out == 0) return y;
  if (k_len == 0) return bias.has_value() ? y.copy_(bias->expand({rows, n_out})) : y.zero_();
  const CpuKernels cpu = isa_kernels(format);
  const bool decode = rows <= kMaxStreamRows || batch_invariant();  // batch-invariant: all rows
  // The interleaved layout's own kernel, or (prefill; an instruction set without that kernel)
  // the weight back in rows for the others.
  const bool interleaved_kernel = interleaved && decode && cpu.interleaved_decode_rows;
  const at::Tensor weight =
      interleaved && !interleaved_kernel ? deinterleave_rows(weight_in, format) : weight_in;
  const uint8_t* w = weight.const_data_ptr<uint8_t>();
  const int64_t ldw = weight.stride(0);
  // Enough weight rows per decode task that their bytes (>= 64 KiB) dwarf its scheduling cost.
  const int64_t grain = std::max<int64_t>(4, (64 << 10) / std::max<int64_t>(1, ldw));
  if (decode && cpu.float_decode_rows) {
    // FP8: the activations as float32, as they are (no quantization).
    const auto x_float = x.to(at::kFloat).contiguous();
    auto y_float = x.scalar_type() == at::kFloat ? y : at::empty({rows, n_out}, x_float.options());
    const auto bias_float = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
    const float* bias_data = bias_float.defined() ? bias_float.const_data_ptr<float>() : nullptr;
    const float* xp = x_float.const_data_ptr<float>();
    float* yp = y_float.mutable_data_ptr<float>();
    at::parallel_for(0, n_out, grain, [&](int64_t begin, int64_t end) {
      cpu.float_decode_rows(xp, rows, k_len, w, ldw, begin, end, bias_data, yp, n_out);
    });
    return x.scalar_type() == at::kFloat ? y : y.copy_(y_float);
  }
  if (decode) {
    const DecodeRowsFn rows_fn =
        interleaved_kernel ? cpu.interleaved_decode_rows : cpu.decode_rows;
    const int64_t unit = interleaved_kernel ? kInterleavedRows : 1;
    FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fastllm::quantized_linear_cpu", [&] {
      quantized_activation_rows<scalar_t>(x, rows_fn, format, w, ldw, bias, grain, unit, y);
    });
    return y;
  }
  // Compute-bound. The byte GEMM where the ISA has one for the format: it beats the float32
  // GEMM below with AVX2 and oneDNN's bfloat16 GEMM without AMX with AVX-512 (it wins from a
  // few rows on, but decode rows keep up to kMaxStreamRows, each row's bits the same in any
  // batch of them). Not with AMX: there oneDNN's bfloat16 GEMM on AMX tiles is faster.
  const CpuIsa isa = cpu_isa();
  if (cpu.byte_gemm_rows && isa != CpuIsa::kAmx) {
    FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fastllm::quantized_linear_cpu", [&] {
      quantized_activation_rows<scalar_t>(x, cpu.byte_gemm_rows, format, w, ldw, bias, 32, 1, y);
    });
    return y;
  }
  // Where the CPU multiplies bfloat16 natively, dequantized tiles of weight rows and the
  // activations go through ATen's bfloat16 GEMM (float32 sums, a bfloat16 result): faster than
  // the float32 GEMM, within 2^-7 of the sum of |x w| (llama.cpp's 8-bit activations
  // err about as much). Elsewhere the ISA's float32 GEMM takes the weight rows dequantized a
  // panel at a time (gemm_rows).
  const auto x_float = x.to(at::kFloat).contiguous();
  auto y_float = x.scalar_type() == at::kFloat ? y : at::empty({rows, n_out}, x_float.options());
  const bool bf16_gemm =
      isa == CpuIsa::kAmx || (isa == CpuIsa::kAvx512 && cpu_has_avx512_bf16());
  if (!bf16_gemm) {
    const auto bias_float = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
    const float* bias_data = bias_float.defined() ? bias_float.const_data_ptr<float>() : nullptr;
    const float* xp = x_float.const_data_ptr<float>();
    float* yp = y_float.mutable_data_ptr<float>();
    // Tasks of 32 weight rows, enough of them (4 a thread) that threads finish together.
    constexpr int64_t kTaskRows = 32;
    at::parallel_for(0, (n_out + kTaskRows - 1) / kTaskRows, 1, [&](int64_t begin, int64_t end) {
      cpu.gemm_rows(xp, rows, k_len, w, ldw, begin * kTaskRows,
                    std::min(n_out, end * kTaskRows), bias_data, yp, n_out);
    });
    return x.scalar_type() == at::kFloat ? y : y.copy_(y_float);
  }
  const auto x_bf16 = x_float.to(at::kBFloat16);
  auto tile = at::empty({std::min(kGemmTileRows, n_out), k_len}, x_float.options());
  for (int64_t n = 0; n < n_out; n += kGemmTileRows) {
    const int64_t end = std::min(n_out, n + kGemmTileRows);
    auto w_tile = tile.narrow(0, 0, end - n);
    float* dst = w_tile.mutable_data_ptr<float>();
    at::parallel_for(n, end, 16, [&](int64_t begin, int64_t stop) {
      cpu.dequantize_rows(w, ldw, begin, stop, k_len, dst + (begin - n) * k_len);
    });
    y_float.narrow(1, n, end - n).copy_(at::mm(x_bf16, w_tile.to(at::kBFloat16).t()));
  }
  if (bias.has_value()) y_float.add_(bias->to(at::kFloat));
  return x.scalar_type() == at::kFloat ? y : y.copy_(y_float);
}

// Row r of a group in the interleaved layout (`group`: kInterleavedRows * row bytes) and the
// same row's blocks (`row`): copies each block's fields chunk by chunk from one to the other.
template <bool kToInterleaved>
void exchange_row(const std::vector<InterleavedField>& fields, int64_t block_bytes,
                  int64_t blocks, int64_t r,
                  std::conditional_t<kToInterleaved, const uint8_t*, uint8_t*> row,
                  std::conditional_t<kToInterleaved, uint8_t*, const uint8_t*> group) {
  for (int64_t b = 0; b < blocks; ++b) {
    for (const InterleavedField& f : fields) {
      const int64_t in_row = b * block_bytes + f.offset;
      const int64_t in_group = kInterleavedRows * in_row + r * f.chunk;
      // A constant chunk size: each copy a single load and store.
      const auto copy_chunks = [&](auto chunk) {
        constexpr int64_t kChunk = decltype(chunk)::value;
        for (int64_t c = 0; c < f.bytes / kChunk; ++c) {
          if constexpr (kToInterleaved)
            std::memcpy(group + in_group + c * kInterleavedRows * kChunk,
                        row + in_row + c * kChunk, kChunk);
          else
            std::memcpy(row + in_row + c * kChunk,
                        group + in_group + c * kInterleavedRows * kChunk, kChunk);
        }
      };
      switch (f.chunk) {
        case 1: copy_chunks(std::integral_constant<int64_t, 1>()); break;
        case 2: copy_chunks(std::integral_constant<int64_t, 2>()); break;
        case 4: copy_chunks(std::integral_constant<int64_t, 4>()); break;
        default: TORCH_INTERNAL_ASSERT(false, "an interleaved chunk of ", f.chunk, " bytes");
      }
    }
  }
}

// Every group of a contiguous weight's rows through exchange_row, into the interleaved layout
// or out of it: a group a task.
template <bool kToInterleaved>
at::Tensor exchange_groups(const at::Tensor& weight, BlockFormat format) {
  const auto fields = interleaved_fields(format);
  const int64_t row_bytes = weight.size(1), bytes = block_layout(format).bytes;
  auto out = at::empty_like(weight);
  const uint8_t* src = weight.const_data_ptr<uint8_t>();
  uint8_t* dst = out.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, weight.size(0) / kInterleavedRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t group = g * kInterleavedRows * row_bytes;
      for (int64_t r = 0; r < kInterleavedRows; ++r) {
        const int64_t row = group + r * row_bytes;
        if constexpr (kToInterleaved)
          exchange_row<true>(fields, bytes, row_bytes / bytes, r, src + row, dst + group);
        else
          exchange_row<false>(fields, bytes, row_bytes / bytes, r, dst + row, src + group);
      }
    }
  });
  return out;
}

}  // namespace

at::Tensor interleave_rows(const at::Tensor& weight, BlockFormat format) {
  int64_t in_features = 0;
  check_quantized_weight(weight, int64_t(format), in_features);
  TORCH_CHECK_VALUE(weight.size(0) % kInterleavedRows == 0,
                    "interleaving takes whole groups of ", kInterleavedRows, " rows, got ",
                    weight.size(0));
  return exchange_groups<true>(weight.contiguous(), format);
}

at::Tensor deinterleave_rows(const at::Tensor& weight, BlockFormat format) {
  return exchange_groups<false>(weight, format);
}

at::Tensor deinterleave_rows(const at::Tensor& weight, BlockFormat format,
                             const at::Tensor& rows) {
  const auto fields = interleaved_fields(format);
  const int64_t row_bytes = weight.size(1), bytes = block_layout(format).bytes;
  const int64_t count = rows.numel();
  auto out = at::empty({count, row_bytes}, weight.options());
  const uint8_t* w = weight.const_data_ptr<uint8_t>();
  const int64_t* index = rows.const_data_ptr<int64_t>();
  uint8_t* dst = out.mutable_data_ptr<uint8_t>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK_INDEX(index[i] >= 0 && index[i] < weight.size(0), "row ", index[i],
                      " is out of range for a weight of ", weight.size(0), " rows");
    exchange_row<false>(fields, bytes, row_bytes / bytes, index[i] % kInterleavedRows,
                        dst + i * row_bytes,
                        w + index[i] / kInterleavedRows * kInterleavedRows * row_bytes);
  }
  return out;
}

TORCH_LIBRARY_IMPL(fastllm, CPU, m) {
  m.impl("quantized_linear", &quantized_linear_cpu);
  m.impl("dequantize", &dequantize_cpu);
}

}  // namespace fastllm
