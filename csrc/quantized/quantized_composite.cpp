// Block-quantized matmul as an ATen composition: dequantize with tensor ops, then a float matmul.
// It serves MPS and any device without a kernel of its own (so: no float64, which MPS lacks).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/composite.h"
#include "quantized/quantized.h"

namespace fastllm {
namespace {

// A block's bit fields, read with tensor ops from blocks [R, B, bytes] (uint8).
struct BlockFields {
  at::Tensor blocks;

  // Bytes [start, start + n) as int16 [R, B, n].
  at::Tensor bytes(int64_t start, int64_t n) const {
    return blocks.narrow(2, start, n).to(at::kShort);
  }
  // The fp16 at byte `start` as float32 [R, B, 1].
  at::Tensor half(int64_t start) const {
    return blocks.narrow(2, start, 2).contiguous().view(at::kHalf).to(at::kFloat);
  }
  // Bits [shift, shift + width) of every byte in q [..., n], for each shift: [..., shifts, n].
  at::Tensor bits(const at::Tensor& q, at::IntArrayRef shifts, int64_t width) const {
    const auto by = at::tensor(shifts, q.options()).view({-1, 1});  // [shifts, 1]
    return at::bitwise_and(at::bitwise_right_shift(q.unsqueeze(-2), by), (1 << width) - 1);
  }
};

// The 32 values of Q4_x/Q5_x blocks as integers [R, B, 32]: low nibbles, then high ones, with
// qh's bits as the fifth bits when it is given.
at::Tensor small_block_ints(const BlockFields& f, int64_t nibbles_at, int64_t qh_at) {
  auto q = f.bits(f.bytes(nibbles_at, 16), {0, 4}, 4).flatten(-2);  // [R, B, 32]
  if (qh_at >= 0)  // bit j of the little-endian word: bit j % 8 of byte j / 8
    q = q + f.bits(f.bytes(qh_at, 4), {0, 1, 2, 3, 4, 5, 6, 7}, 1).transpose(-1, -2)
                .flatten(-2) * 16;
  return q;
}

}  // namespace

at::Tensor dequantize_composite(const at::Tensor& weight, int64_t weight_type,
                                at::ScalarType dtype) {
  int64_t in_features = 0;
  const BlockFormat format = check_quantized_weight(weight, weight_type, in_features);
  const BlockLayout layout = block_layout(format);
  const int64_t rows = weight.size(0), n_blocks = in_features / layout.values;
  const BlockFields f{weight.reshape({rows, n_blocks, layout.bytes})};
  const auto sub_blocks = [&](const at::Tensor& t) { return t.reshape({rows, n_blocks, 8, 32}); };
  at::Tensor values;  // float32, [R, B, values per block] (or [R, B, 8, 32])
  switch (format) {
    case BlockFormat::kQ4_0: values = f.half(0) * (small_block_ints(f, 2, -1) - 8); break;
    case BlockFormat::kQ4_1: values = f.half(0) * small_block_ints(f, 4, -1) + f.half(2); break;
    case BlockFormat::kQ5_0: values = f.half(0) * (small_block_ints(f, 6, 2) - 16); break;
    case BlockFormat::kQ5_1: values = f.half(0) * small_block_ints(f, 8, 4) + f.half(2); break;
    case BlockFormat::kQ8_0:
      values = f.half(0) * f.blocks.narrow(2, 2, 32).contiguous().view(at::kChar).to(at::kFloat);
      break;
    case BlockFormat::kQ4_K:
    case BlockFormat::kQ5_K: {
      // 6-bit scales and mins: low 6 bits of bytes 0-3 (4-7), then the low (high) nibbles of
      // bytes 8-11 with bytes 0-3's (4-7's) top 2 bits above them.
      const auto a = f.bytes(4, 4), b = f.bytes(8, 4), c = f.bytes(12, 4);  // [R, B, 4]
      const auto top = [](const at::Tensor& t) { return at::bitwise_right_shift(t, 6) * 16; };
      const auto scales = at::cat({at::bitwise_and(a, 63), at::bitwise_and(c, 15) + top(a)}, 2);
      const auto mins =
          at::cat({at::bitwise_and(b, 63), at::bitwise_right_shift(c, 4) + top(b)}, 2);
      // Bytes 32c.. hold sub-block 2c in their low nibbles, 2c + 1 in their high ones.
      const int64_t nibbles_at = format == BlockFormat::kQ4_K ? 16 : 48;
      const auto runs = f.bytes(nibbles_at, 128).view({rows, n_blocks, 4, 32});
      auto q = sub_blocks(f.bits(runs, {0, 4}, 4));
      if (format == BlockFormat::kQ5_K)  // bit s of qh byte l: sub-block s's value l
        q = q + f.bits(f.bytes(16, 32), {0, 1, 2, 3, 4, 5, 6, 7}, 1) * 16;
      values = (f.half(0) * scales).unsqueeze(-1) * q - (f.half(2) * mins).unsqueeze(-1);
      break;
    }
    case BlockFormat::kQ6_K: {
      // Per half of 128 values: low 4 bits in 64 bytes (values j, then 64 + j), high 2 bits in
      // 32 bytes (bits 2k, 2k + 1 of byte l: value 32k + l).
      const auto low = f.bits(f.bytes(0, 128).view({rows, n_blocks, 2, 64}), {0, 4}, 4);
      const auto high = f.bits(f.bytes(128, 64).view({rows, n_blocks, 2, 32}), {0, 2, 4, 6}, 2);
      const auto q = (low.flatten(-2) + high.flatten(-2) * 16 - 32).view({rows, n_blocks, 16, 16});
      const auto scales = f.blocks.narrow(2, 192, 16).contiguous().view(at::kChar).to(at::kFloat);
      values = (f.half(208) * scales).unsqueeze(-1) * q;  // a scale per 16 values
      break;
    }
    case BlockFormat::kFp8E4M3: {
      // Each code as the float16 of its bits (s << 15) | (eeeemmm << 7), e4m3's value times
      // 2^-8, with integer ops (MPS has no float8); the 2^8 is exact, scale * value one rounding.
      const auto codes = f.bytes(4, 32);  // [R, B, 32]
      const auto bits = at::bitwise_or(at::bitwise_left_shift(at::bitwise_and(codes, 0x80), 8),
                                       at::bitwise_left_shift(at::bitwise_and(codes, 0x7f), 7));
      const auto scale = f.blocks.narrow(2, 0, 4).contiguous().view(at::kFloat);  // [R, B, 1]
      values = scale * (bits.view(at::kHalf).to(at::kFloat) * 256);
      break;
    }
  }
  return values.reshape({rows, in_features}).to(dtype);
}

at::Tensor quantized_linear_composite(const at::Tensor& x, const at::Tensor& weight,
                                      int64_t weight_type, const std::optional<at::Tensor>& bias) {
  check_quantized_linear_inputs(x, weight, weight_type, bias);
  return at::linear(x, dequantize_composite(weight, weight_type, x.scalar_type()), bias);
}

FASTLLM_COMPOSITE_IMPL(m) {
  m.impl("quantized_linear", &quantized_linear_composite);
  m.impl("dequantize", &dequantize_composite);
}

}  // namespace fastllm
