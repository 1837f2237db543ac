#include <cmath>

#include "common/checks.h"
#include "sampling/sampling.h"

namespace fastllm {
namespace {

void check_row_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype,
                      const at::Tensor& logits) {
  check_rank(t, 1, name, "[batch]");
  check_dtype(t, dtype, name);
  check_same_device(t, name, logits, "logits");
  TORCH_CHECK_VALUE(t.size(0) == logits.size(0), name, " has ", t.size(0),
                    " rows but logits has ", logits.size(0));
}

void check_matrix(const at::Tensor& t, const char* name, at::ScalarType dtype,
                  const at::Tensor& logits) {
  check_dtype(t, dtype, name);
  check_same_device(t, name, logits, "logits");
  TORCH_CHECK_VALUE(t.sizes() == logits.sizes(), name, " must have logits' shape ",
                    logits.sizes(), ", got ", t.sizes());
}

void check_logits(const at::Tensor& logits) {
  check_rank(logits, 2, "logits", "[batch, vocab]");
  check_float_storage(logits, "logits");
  TORCH_CHECK_VALUE(logits.size(1) > 0 || logits.size(0) == 0,
                    "logits must have a non-empty vocabulary, got shape ", logits.sizes());
}

}  // namespace

void check_sample_inputs(const at::Tensor& logits, const at::Tensor& temperature,
                         const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                         const at::Tensor& seeds, const at::Tensor& offsets) {
  check_logits(logits);
  check_row_tensor(temperature, "temperature", at::kFloat, logits);
  check_row_tensor(top_k, "top_k", at::kInt, logits);
  check_row_tensor(top_p, "top_p", at::kFloat, logits);
  check_row_tensor(min_p, "min_p", at::kFloat, logits);
  check_row_tensor(seeds, "seeds", at::kLong, logits);
  check_row_tensor(offsets, "offsets", at::kLong, logits);
}

void check_sample_params(const at::Tensor& temperature, const at::Tensor& top_p,
                         const at::Tensor& min_p) {
  const auto t = temperature.contiguous(), p = top_p.contiguous(), m = min_p.contiguous();
  const float *tp = t.const_data_ptr<float>(), *pp = p.const_data_ptr<float>(),
              *mp = m.const_data_ptr<float>();
  for (int64_t r = 0; r < t.numel(); ++r) {
    TORCH_CHECK_VALUE(std::isfinite(tp[r]) && tp[r] >= 0, "temperature[", r, "]=", tp[r],
                      " must be >= 0 (0 = greedy)");
    TORCH_CHECK_VALUE(pp[r] > 0 && pp[r] <= 1, "top_p[", r, "]=", pp[r], " must be in (0, 1]");
    TORCH_CHECK_VALUE(mp[r] >= 0 && mp[r] <= 1, "min_p[", r, "]=", mp[r], " must be in [0, 1]");
  }
}

void check_penalties_inputs(const at::Tensor& logits, const at::Tensor& prompt_mask,
                            const at::Tensor& output_counts,
                            const at::Tensor& repetition_penalty,
                            const at::Tensor& frequency_penalty, const at::Tensor& presence_penalty,
                            const std::optional<at::Tensor>& logit_bias) {
  check_logits(logits);
  check_matrix(prompt_mask, "prompt_mask", at::kBool, logits);
  check_matrix(output_counts, "output_counts", at::kInt, logits);
  check_row_tensor(repetition_penalty, "repetition_penalty", at::kFloat, logits);
  check_row_tensor(frequency_penalty, "frequency_penalty", at::kFloat, logits);
  check_row_tensor(presence_penalty, "presence_penalty", at::kFloat, logits);
  if (logit_bias.has_value()) check_matrix(*logit_bias, "logit_bias", at::kFloat, logits);
  // Updated in place: an element reached through several indices would be penalized each time.
  check_no_internal_overlap(logits, "logits");
}

void check_penalty_values(const at::Tensor& repetition_penalty, const at::Tensor& frequency_penalty,
                          const at::Tensor& presence_penalty) {
  const auto rp = repetition_penalty.contiguous(), fp = frequency_penalty.contiguous(),
             pp = presence_penalty.contiguous();
  const float *r = rp.const_data_ptr<float>(), *f = fp.const_data_ptr<float>(),
              *p = pp.const_data_ptr<float>();
  for (int64_t i = 0; i < rp.numel(); ++i) {
    TORCH_CHECK_VALUE(std::isfinite(r[i]) && r[i] > 0, "repetition_penalty[", i, "]=", r[i],
                      " must be > 0 (1 = off)");
    TORCH_CHECK_VALUE(std::isfinite(f[i]), "frequency_penalty[", i, "]=", f[i], " must be finite");
    TORCH_CHECK_VALUE(std::isfinite(p[i]), "presence_penalty[", i, "]=", p[i], " must be finite");
  }
}

}  // namespace fastllm
