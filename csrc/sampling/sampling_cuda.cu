// Sampling on CUDA: checks, device guard and stream; the kernels are in sampling_kernels.cuh.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/cuda_host.h"
#include "common/cuda_launch.cuh"
#include "common/dispatch.h"
#include "sampling/sampling.h"
#include "sampling/sampling_kernels.cuh"

namespace fastllm {
namespace {

// The errors the CPU raises, from the statuses the kernel wrote: the controls first (the CPU
// checks them before any row), then the first row whose logits are unusable.
void raise_row_errors(const at::Tensor& status, const at::Tensor& temperature,
                      const at::Tensor& top_p, const at::Tensor& min_p) {
  const auto host = host_copy(status);  // the call's one sync: its tokens are read next anyway
  const int32_t* s = host.const_data_ptr<int32_t>();
  const int64_t batch = host.numel();
  if (std::any_of(s, s + batch, [](int32_t v) { return (v & cuda::kRowBadControls) != 0; }))
    check_sample_params(host_copy(temperature), host_copy(top_p), host_copy(min_p));
  for (int64_t r = 0; r < batch; ++r) {
    TORCH_CHECK_VALUE(!(s[r] & cuda::kRowNaN), "logits row ", r, " contains NaN");
    TORCH_CHECK_VALUE(!(s[r] & cuda::kRowPosInf), "logits row ", r, " contains +inf");
    TORCH_CHECK_VALUE(!(s[r] & cuda::kRowNoFinite), "logits row ", r, " has no finite value");
  }
}

void sample_cuda_impl(const at::Tensor& logits_in, const at::Tensor& temperature,
                      const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                      const at::Tensor& seeds, const at::Tensor& offsets, int64_t num_logprobs,
                      at::Tensor& tokens, at::Tensor* token_logprobs, at::Tensor* top_ids,
                      at::Tensor* top_logprobs) {
  check_sample_inputs(logits_in, temperature, top_k, top_p, min_p, seeds, offsets);
  TORCH_CHECK_VALUE(num_logprobs >= 0, "num_logprobs must be >= 0, got ", num_logprobs);
  const int64_t batch = logits_in.size(0), vocab = logits_in.size(1);
  if (batch == 0) return;
  TORCH_CHECK_VALUE(vocab <= cuda::kMaxVocab, "on CUDA, logits rows may have at most ",
                    cuda::kMaxVocab, " tokens, got ", vocab);
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const auto logits = logits_in.contiguous();
  const auto t = temperature.contiguous(), p = top_p.contiguous(), m = min_p.contiguous();
  const auto k = top_k.contiguous(), s = seeds.contiguous(), o = offsets.contiguous();
  auto status = at::empty({batch}, logits.options().dtype(at::kInt));
  const cuda::SampleArgs args{
      t.const_data_ptr<float>(),
      k.const_data_ptr<int32_t>(),
      p.const_data_ptr<float>(),
      m.const_data_ptr<float>(),
      s.const_data_ptr<int64_t>(),
      o.const_data_ptr<int64_t>(),
      int(vocab),
      tokens.mutable_data_ptr<int64_t>(),
      status.mutable_data_ptr<int32_t>(),
      token_logprobs ? token_logprobs->mutable_data_ptr<float>() : nullptr,
      top_ids ? top_ids->mutable_data_ptr<int64_t>() : nullptr,
      top_logprobs ? top_logprobs->mutable_data_ptr<float>() : nullptr,
      token_logprobs ? num_logprobs : 0};
  // 16-byte loads need every row to start on a 16-byte boundary.
  const bool vector_rows = reinterpret_cast<uintptr_t>(logits.const_data_ptr()) % 16 == 0 &&
                           vocab * logits.element_size() % 16 == 0;
  FASTLLM_DISPATCH_FLOAT_TYPES(logits.scalar_type(), "fastllm::sample_cuda", [&] {
    using storage_t = cuda_storage_t<scalar_t>;
    constexpr int kVec = 16 / sizeof(storage_t);
    launch_kernel(vector_rows ? &cuda::sample_kernel<storage_t, kVec>
                              : &cuda::sample_kernel<storage_t, 1>,
                  unsigned(batch), cuda::kSampleThreads, 0, cuda_ptr<scalar_t>(logits), args);
  });
  // Out-of-range controls and unusable rows still sampled safely; raise where the host can look.
  if (can_check_values()) raise_row_errors(status, temperature, top_p, min_p);
}

constexpr int kPenaltyThreads = 256;

void apply_penalties_cuda(at::Tensor& logits, const at::Tensor& prompt_mask,
                          const at::Tensor& output_counts, const at::Tensor& repetition_penalty,
                          const at::Tensor& frequency_penalty, const at::Tensor& presence_penalty,
                          const std::optional<at::Tensor>& logit_bias) {
  check_penalties_inputs(logits, prompt_mask, output_counts, repetition_penalty,
                         frequency_penalty, presence_penalty, logit_bias);
  const c10::cuda::CUDAGuard guard(logits.device());
  // Before the kernel: a rejected call leaves the logits as they were.
  if (can_check_values()) {
    const auto host = host_copy(
        at::stack({repetition_penalty, frequency_penalty, presence_penalty}));
    check_penalty_values(host[0], host[1], host[2]);
  }
  const int64_t batch = logits.size(0), vocab = logits.size(1);
  if (batch == 0) return;
  const auto mask = prompt_mask.contiguous();
  const auto counts = output_counts.contiguous();
  const auto bias = logit_bias.has_value() ? logit_bias->contiguous() : at::Tensor();
  const auto rp = repetition_penalty.contiguous(), fp = frequency_penalty.contiguous(),
             pp = presence_penalty.contiguous();
  const dim3 grid(unsigned(ceil_div(vocab, kPenaltyThreads)),
                  unsigned(std::min<int64_t>(batch, 65535)));
  FASTLLM_DISPATCH_FLOAT_TYPES(logits.scalar_type(), "fastllm::apply_penalties_cuda", [&] {
    launch_kernel(&cuda::apply_penalties_kernel<cuda_storage_t<scalar_t>>, grid,
                  kPenaltyThreads, 0, cuda_mutable_ptr<scalar_t>(logits), logits.stride(0),
                  logits.stride(1), mask.const_data_ptr<bool>(), counts.const_data_ptr<int32_t>(),
                  rp.const_data_ptr<float>(), fp.const_data_ptr<float>(),
                  pp.const_data_ptr<float>(),
                  bias.defined() ? bias.const_data_ptr<float>() : nullptr, batch, vocab);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CUDA, m) {
  m.impl("sample", &sample_op<sample_cuda_impl>);
  m.impl("sample_with_logprobs", &sample_with_logprobs_op<sample_cuda_impl>);
  m.impl("apply_penalties", &apply_penalties_cuda);
}

}  // namespace fastllm
