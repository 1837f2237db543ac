// Batched LoRA on CUDA: checks, device guard and stream; the kernels are in lora_kernels.cuh.
#include <algorithm>
#include <cstdint>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/cuda_host.h"
#include "common/cuda_launch.cuh"
#include "common/dispatch.h"
#include "lora/lora.h"
#include "lora/lora_kernels.cuh"

namespace fastllm {
namespace {

static_assert(cuda::kLoraMaxRank >= kMaxLoraRank,
              "the expand kernel's shared memory must hold a shrink result of the largest rank");

// The expand's lanes per output row: the rank rounded up to a power of two, at most a warp.
int lora_lanes_per_row(int64_t rank) {
  int lanes = 1;
  while (lanes < 32 && lanes < rank) lanes *= 2;
  return lanes;
}

void add_lora_cuda(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
                   const at::Tensor& lora_b, const at::Tensor& token_slots) {
  check_lora_inputs(y, x, lora_a, lora_b, token_slots);
  const int64_t num_slots = lora_a.size(0), rank = lora_a.size(1);
  if (can_check_values()) check_token_slot_values(host_copy(token_slots), num_slots);
  const int64_t tokens = x.size(0), out = y.size(1);
  if (tokens == 0 || out == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const auto x_rows = dense_rows(x);
  const auto a = lora_a.contiguous(), b = lora_b.contiguous(), slots = token_slots.contiguous();
  auto h = at::empty({tokens, rank}, x.options());
  const int lanes = lora_lanes_per_row(rank);
  const int64_t row_blocks = std::min(kMaxGridY, ceil_div(out, cuda::kLoraThreads / lanes));
  FASTLLM_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fastllm::add_lora_cuda", [&] {
    using T = cuda_storage_t<scalar_t>;
    cuda::LoraParams<T> p{};
    p.x = cuda_ptr<scalar_t>(x_rows);
    p.lora_a = cuda_ptr<scalar_t>(a);
    p.lora_b = cuda_ptr<scalar_t>(b);
    p.token_slots = slots.const_data_ptr<int32_t>();
    p.h = cuda_mutable_ptr<scalar_t>(h);
    p.y = cuda_mutable_ptr<scalar_t>(y);
    p.x_stride = x_rows.stride(0);
    p.y_stride = y.stride(0);
    p.in = x.size(1);
    p.out = out;
    p.rank = int(rank);
    // int32 slots reach no further than INT32_MAX - 1.
    p.num_slots = int(std::min<int64_t>(num_slots, INT32_MAX));
    p.lanes_per_row = lanes;
    launch_kernel(&cuda::lora_shrink_kernel<T>,
                  dim3(unsigned(tokens), unsigned(ceil_div(rank, cuda::kLoraWarps))),
                  cuda::kLoraThreads, 0, p);
    launch_kernel(&cuda::lora_expand_kernel<T>, dim3(unsigned(tokens), unsigned(row_blocks)),
                  cuda::kLoraThreads, 0, p);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CUDA, m) { m.impl("add_lora", &add_lora_cuda); }

}  // namespace fastllm
