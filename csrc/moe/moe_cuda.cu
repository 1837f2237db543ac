// The mixture-of-experts block on CUDA: checks, device guard, stream and the choice of path; the
// kernels are in moe_kernels.cuh.
//
// Up to cuda::kMaxGemvRows tokens (decode), or while a CUDA graph is being captured: the
// routing kernel, then per projection one GEMV launch over every (token, expert) pair, a warp
// per pair and weight row reading the pair's expert's row (float, or ggml blocks decoded in
// registers as quantized_linear's GEMV decodes them), silu_and_mul and the combine: five
// launches, no grouping, no host sync. More tokens: the routing, the pairs grouped by expert
// (a count and a scatter kernel: each expert's pairs in token order), one wait for the
// per-expert row counts on the host (they size the GEMMs), the tokens' rows gathered by
// expert, each expert with rows through cuBLAS (float experts) or quantized_linear's CUDA path
// (its GEMV up to 8 rows, dequantize + cuBLAS past them), silu_and_mul over all rows, the same
// for down, and the combine.
#include <algorithm>
#include <cstdint>
#include <optional>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "activation/activation.h"
#include "common/cuda_host.h"
#include "common/cuda_launch.cuh"
#include "common/dispatch.h"
#include "moe/moe.h"
#include "moe/moe_kernels.cuh"
#include "quantized/quantized.h"

namespace fastllm {
namespace {

// One GEMV launch over pairs [begin, begin + grid.y) with float weights (x's dtype, or 16 bits
// under float32 x).
template <typename x_t, typename w_t>
void float_gemv(dim3 grid, const at::Tensor& x, int64_t pair_divisor, const int32_t* experts,
                const at::Tensor& w, at::Tensor& y, int64_t begin) {
  launch_kernel(&cuda::moe_gemv_kernel<cuda_storage_t<x_t>, cuda_storage_t<w_t>>, grid,
                cuda::kGemvWarps * 32, 0, cuda_ptr<x_t>(x), x.stride(0), pair_divisor, experts,
                cuda_ptr<w_t>(w), w.stride(0), w.stride(1), cuda_mutable_ptr<x_t>(y), y.size(1),
                x.size(1), begin);
}

// The same with ggml blocks of `type`.
template <typename x_t>
void quantized_gemv(dim3 grid, const at::Tensor& x, int64_t pair_divisor,
                    const int32_t* experts, const at::Tensor& w, int64_t type, at::Tensor& y,
                    int64_t begin) {
  visit_block_format(static_cast<BlockFormat>(type), [&](auto f) {
    constexpr BlockFormat F = decltype(f)::value;
    launch_kernel(&cuda::moe_quantized_gemv_kernel<F, cuda_storage_t<x_t>>, grid,
                  cuda::kGemvWarps * 32, 0, cuda_ptr<x_t>(x), x.stride(0), pair_divisor,
                  experts, w.const_data_ptr<uint8_t>(), w.stride(0), w.stride(1),
                  cuda_mutable_ptr<x_t>(y), y.size(1), x.size(1), begin);
  });
}

// y [pairs, n_out] = each pair's input row (x's row pair / pair_divisor) times its expert's
// weight transposed: one GEMV launch per 65535 pairs.
void expert_gemv(const at::Tensor& x, int64_t pair_divisor, const at::Tensor& experts,
                 const at::Tensor& w, const std::optional<int64_t>& type, at::Tensor& y) {
  const int64_t pairs = y.size(0);
  const auto blocks = unsigned(ceil_div(y.size(1), cuda::kGemvWarps));
  const int32_t* ids = experts.const_data_ptr<int32_t>();
  for (int64_t begin = 0; begin < pairs; begin += kMaxGridY) {
    const dim3 grid(blocks, unsigned(std::min(kMaxGridY, pairs - begin)));
    if (type.has_value()) {
      FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fastllm::moe_cuda", [&] {
        quantized_gemv<scalar_t>(grid, x, pair_divisor, ids, w, *type, y, begin);
      });
    } else {
      FASTLLM_DISPATCH_FLOAT_TYPES(w.scalar_type(), "fastllm::moe_cuda", [&] {
        if (x.scalar_type() == w.scalar_type())
          float_gemv<scalar_t, scalar_t>(grid, x, pair_divisor, ids, w, y, begin);
        else  // 16-bit weights under float32 x (check_moe_inputs)
          float_gemv<float, scalar_t>(grid, x, pair_divisor, ids, w, y, begin);
      });
    }
  }
}

// out [rows, n_out] = x [rows, in] times expert e's weight transposed: cuBLAS in x's dtype, or
// quantized_linear's CUDA path.
void expert_matmul(const at::Tensor& x, const at::Tensor& weights,
                   const std::optional<int64_t>& type, int64_t e, at::Tensor out) {
  const auto w = weights.select(0, e);
  if (type.has_value()) {
    out.copy_(quantized_linear_cuda(x, w, *type, std::nullopt));
  } else {
    // 16-bit weights under float32 x are converted exactly (check_moe_inputs).
    at::mm_out(out, x, (w.scalar_type() == x.scalar_type() ? w : w.to(x.scalar_type())).t());
  }
}

at::Tensor moe_cuda(const at::Tensor& x_in, const at::Tensor& router_logits,
                    const at::Tensor& gate_up, const at::Tensor& down, int64_t top_k,
                    bool renormalize, std::optional<int64_t> gate_up_type,
                    std::optional<int64_t> down_type) {
  const MoeShape s =
      check_moe_inputs(x_in, router_logits, gate_up, down, top_k, gate_up_type, down_type);
  auto out = at::empty({s.tokens, s.hidden}, x_in.options());
  if (out.numel() == 0) return out;
  if (s.intermediate == 0) return out.zero_();
  const int64_t pairs = s.tokens * top_k, I = s.intermediate;
  TORCH_CHECK_VALUE(pairs <= INT32_MAX && s.num_experts <= INT32_MAX,
                    "moe on CUDA takes fewer than 2^31 (token, expert) pairs, got ", pairs);
  const c10::cuda::CUDAGuard guard(x_in.device());
  // The kernels read rows densely, x.stride(0) apart.
  const auto x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const auto logits = router_logits.stride(1) == 1 ? router_logits : router_logits.contiguous();
  const auto index_options = x.options().dtype(at::kInt);
  auto experts = at::empty({s.tokens, top_k}, index_options);
  auto weights = at::empty({s.tokens, top_k}, x.options().dtype(at::kFloat));
  FASTLLM_DISPATCH_FLOAT_TYPES(logits.scalar_type(), "fastllm::moe_cuda", [&] {
    using logit_t = cuda_storage_t<scalar_t>;
    FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fastllm::moe_cuda", [&] {
      launch_kernel(&cuda::moe_route_kernel<logit_t, cuda_storage_t<scalar_t>>,
                    unsigned(ceil_div(s.tokens, cuda::kMoeRouteWarps)), cuda::kMoeRouteWarps * 32,
                    0, reinterpret_cast<const logit_t*>(logits.const_data_ptr()), logits.stride(0),
                    s.tokens, int(s.num_experts), int(top_k), renormalize,
                    experts.mutable_data_ptr<int32_t>(), weights.mutable_data_ptr<float>());
    });
  });

  const bool capturing =
      c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  at::Tensor y, position;  // y [pairs, hidden]; pair a's row of y (undefined: row a)
  if (s.tokens <= cuda::kMaxGemvRows || capturing) {
    // Decode: every pair's GEMV reads its expert's rows; no grouping, no wait for the device.
    auto h = at::empty({pairs, 2 * I}, x.options());
    expert_gemv(x, top_k, experts, gate_up, gate_up_type, h);
    const auto gated = silu_and_mul_cuda(h);
    y = at::empty({pairs, s.hidden}, x.options());
    expert_gemv(gated, 1, experts, down, down_type, y);
  } else {
    auto counts = at::empty({s.num_experts}, index_options);
    auto offsets = at::empty({s.num_experts + 1}, index_options);
    auto rows = at::empty({pairs}, index_options);
    position = at::empty({pairs}, index_options);
    const int32_t* ids = experts.const_data_ptr<int32_t>();
    launch_kernel(&cuda::moe_count_kernel, unsigned(s.num_experts), cuda::kMoeSortThreads, 0, ids,
                  pairs, counts.mutable_data_ptr<int32_t>());
    launch_kernel(&cuda::moe_scatter_kernel, unsigned(s.num_experts), cuda::kMoeSortThreads, 0,
                  ids, pairs, counts.const_data_ptr<int32_t>(), int(s.num_experts),
                  offsets.mutable_data_ptr<int32_t>(), rows.mutable_data_ptr<int32_t>(),
                  position.mutable_data_ptr<int32_t>());
    const auto host_offsets = offsets.to(at::kCPU);  // the one wait: the GEMMs' sizes
    const int32_t* first = host_offsets.const_data_ptr<int32_t>();
    const auto x_rows = x.index_select(0, at::div(rows, top_k, "floor"));  // by expert
    auto h = at::empty({pairs, 2 * I}, x.options());
    for (int64_t e = 0; e < s.num_experts; ++e)
      if (first[e + 1] > first[e])
        expert_matmul(x_rows.narrow(0, first[e], first[e + 1] - first[e]), gate_up,
                      gate_up_type, e, h.narrow(0, first[e], first[e + 1] - first[e]));
    const auto gated = silu_and_mul_cuda(h);
    y = at::empty({pairs, s.hidden}, x.options());
    for (int64_t e = 0; e < s.num_experts; ++e)
      if (first[e + 1] > first[e])
        expert_matmul(gated.narrow(0, first[e], first[e + 1] - first[e]), down, down_type, e,
                      y.narrow(0, first[e], first[e + 1] - first[e]));
  }

  const auto blocks = unsigned(ceil_div(s.hidden, cuda::kMoeCombineThreads));
  FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fastllm::moe_cuda", [&] {
    for (int64_t begin = 0; begin < s.tokens; begin += kMaxGridY) {
      launch_kernel(&cuda::moe_combine_kernel<cuda_storage_t<scalar_t>>,
                    dim3(blocks, unsigned(std::min(kMaxGridY, s.tokens - begin))),
                    cuda::kMoeCombineThreads, 0, cuda_ptr<scalar_t>(y),
                    experts.const_data_ptr<int32_t>(), weights.const_data_ptr<float>(),
                    position.defined() ? position.const_data_ptr<int32_t>() : nullptr, int(top_k),
                    s.hidden, cuda_mutable_ptr<scalar_t>(out), begin);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CUDA, m) { m.impl("moe", &moe_cuda); }

}  // namespace fastllm
