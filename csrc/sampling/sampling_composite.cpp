// Sampling written with ATen ops: what a device without a native kernel runs (MPS). It sorts
// each row once (a fallback may); the semantics and the Philox draw are those of the CPU kernel.
#include <cmath>
#include <limits>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "sampling/philox.h"
#include "sampling/sampling.h"

namespace fastllm {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Raises for a row with NaN, +inf or no finite value (host sync: this is the fallback path).
void check_logit_values(const at::Tensor& x) {
  if (x.size(0) == 0) return;
  const auto nan = x.isnan().any(1).cpu();
  const auto pos_inf = x.isposinf().any(1).cpu();
  const auto no_finite = x.isfinite().any(1).logical_not().cpu();
  for (int64_t r = 0; r < x.size(0); ++r) {
    TORCH_CHECK_VALUE(!nan[r].item<bool>(), "logits row ", r, " contains NaN");
    TORCH_CHECK_VALUE(!pos_inf[r].item<bool>(), "logits row ", r, " contains +inf");
    TORCH_CHECK_VALUE(!no_finite[r].item<bool>(), "logits row ", r, " has no finite value");
  }
}

struct Filtered {
  at::Tensor x;         // float32 logits [batch, vocab]
  at::Tensor greedy;    // bool [batch]
  at::Tensor logprobs;  // float32 [batch, vocab]: the distribution each row is drawn from
  at::Tensor tokens;    // int64 [batch]
};

Filtered filter_and_draw(const at::Tensor& logits, const at::Tensor& temperature,
                         const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                         const at::Tensor& seeds, const at::Tensor& offsets) {
  check_sample_inputs(logits, temperature, top_k, top_p, min_p, seeds, offsets);
  check_sample_params(temperature.cpu(), top_p.cpu(), min_p.cpu());
  const auto x = logits.to(at::kFloat);
  check_logit_values(x);
  const int64_t batch = x.size(0), vocab = x.size(1);
  const auto greedy = temperature.eq(0);
  const auto t = at::where(greedy, at::ones_like(temperature), temperature).unsqueeze(1);
  // Scaled relative to the maximum (x / t alone can overflow float32): z <= 0, max(z) = 0.
  const auto z = (x - std::get<0>(x.max(1, /*keepdim=*/true))) / t;
  const auto max = at::zeros({batch, 1}, z.options());
  const auto sorted = z.sort(/*stable=*/true, /*dim=*/1, /*descending=*/true);
  const auto& values = std::get<0>(sorted);
  const auto& order = std::get<1>(sorted);
  auto keep = at::ones_like(z, z.options().dtype(at::kBool));

  // top-k: every value >= the k-th largest.
  const auto k = top_k.to(at::kLong);
  const auto k_on = k.gt(0).logical_and(k.lt(vocab));
  const auto kth = values.gather(1, (k.clamp(1, vocab) - 1).unsqueeze(1));
  keep = keep.logical_and(z.ge(kth).logical_or(k_on.logical_not().unsqueeze(1)));

  // top-p: a token stays while the mass strictly above its tie group is below top_p.
  const auto probs = z.masked_fill(keep.logical_not(), -kInf).softmax(1);
  const auto sorted_probs = probs.gather(1, order);
  const auto above = sorted_probs.to(at::kDouble).cumsum(1) - sorted_probs.to(at::kDouble);
  const auto first_of_tie = at::searchsorted(sorted_probs.neg().contiguous(),
                                             sorted_probs.neg().contiguous(), false, false);
  const auto above_sorted = above.gather(1, first_of_tie);
  const auto mass_above = at::empty_like(above_sorted).scatter_(1, order, above_sorted);
  keep = keep.logical_and(mass_above.lt(top_p.to(at::kDouble).unsqueeze(1)));

  // min-p: p >= min_p * p_max, i.e. z >= max + log(min_p).
  keep = keep.logical_and(z.ge(max + min_p.log().unsqueeze(1)));

  // Weights of zero probability are not kept (as in the CPU kernel).
  const auto weights = (z - max).exp().masked_fill(keep.logical_not(), 0.0);
  keep = weights.gt(0);
  const auto kept_mass = weights.to(at::kDouble).sum(1, /*keepdim=*/true);
  auto logprobs = at::where(greedy.unsqueeze(1), x.log_softmax(1),
                            ((z - max).to(at::kDouble) - kept_mass.log())
                                .to(at::kFloat)
                                .masked_fill(keep.logical_not(), -kInf));

  // The draw: the row's Philox uniform through the cumulative kept weights, in vocab order.
  auto uniform = at::empty({batch}, at::kDouble);
  const auto seeds_cpu = seeds.cpu().contiguous(), offsets_cpu = offsets.cpu().contiguous();
  for (int64_t r = 0; r < batch; ++r)
    uniform.mutable_data_ptr<double>()[r] =
        philox_uniform(uint64_t(seeds_cpu.const_data_ptr<int64_t>()[r]),
                       uint64_t(offsets_cpu.const_data_ptr<int64_t>()[r]));
  const auto cdf = weights.to(at::kDouble).cumsum(1);
  const auto target = uniform.to(x.device()).unsqueeze(1) * kept_mass;
  const auto last_kept = (keep.to(at::kLong) * at::arange(vocab, x.options().dtype(at::kLong)))
                             .amax(1, /*keepdim=*/true);
  const auto drawn = at::searchsorted(cdf, target, false, /*right=*/true).minimum(last_kept);
  const auto tokens = at::where(greedy, x.argmax(1), drawn.squeeze(1));
  return {x, greedy, logprobs, tokens};
}

}  // namespace

at::Tensor sample_composite(const at::Tensor& logits, const at::Tensor& temperature,
                            const at::Tensor& top_k, const at::Tensor& top_p,
                            const at::Tensor& min_p, const at::Tensor& seeds,
                            const at::Tensor& offsets) {
  return filter_and_draw(logits, temperature, top_k, top_p, min_p, seeds, offsets).tokens;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sample_with_logprobs_composite(
    const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
    const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& seeds,
    const at::Tensor& offsets, int64_t num_logprobs) {
  TORCH_CHECK_VALUE(num_logprobs >= 0, "num_logprobs must be >= 0, got ", num_logprobs);
  const auto f = filter_and_draw(logits, temperature, top_k, top_p, min_p, seeds, offsets);
  const int64_t n = std::min<int64_t>(num_logprobs, f.x.size(1));
  const auto token_logprobs = f.logprobs.gather(1, f.tokens.unsqueeze(1)).squeeze(1);
  // Most likely first, ties by lower id: a stable descending sort.
  const auto ranked = f.logprobs.sort(/*stable=*/true, /*dim=*/1, /*descending=*/true);
  auto top_logprobs = std::get<0>(ranked).narrow(1, 0, n);
  auto top_ids = std::get<1>(ranked).narrow(1, 0, n).masked_fill(top_logprobs.isneginf(), -1);
  if (n < num_logprobs) {  // more asked for than the vocabulary has
    top_logprobs = at::constant_pad_nd(top_logprobs, {0, num_logprobs - n}, -kInf);
    top_ids = at::constant_pad_nd(top_ids, {0, num_logprobs - n}, -1);
  }
  return {f.tokens, token_logprobs, top_ids.contiguous(), top_logprobs.contiguous()};
}

void apply_penalties_composite(at::Tensor& logits, const at::Tensor& prompt_mask,
                               const at::Tensor& output_counts,
                               const at::Tensor& repetition_penalty,
                               const at::Tensor& frequency_penalty,
                               const at::Tensor& presence_penalty,
                               const std::optional<at::Tensor>& logit_bias) {
  check_penalties_inputs(logits, prompt_mask, output_counts, repetition_penalty,
                         frequency_penalty, presence_penalty, logit_bias);
  check_penalty_values(repetition_penalty.cpu(), frequency_penalty.cpu(), presence_penalty.cpu());
  auto x = logits.to(at::kFloat);
  if (logit_bias.has_value()) x = x + *logit_bias;
  const auto counts = output_counts.to(at::kFloat);
  const auto in_output = output_counts.gt(0);
  const auto rep = repetition_penalty.unsqueeze(1);
  x = at::where(prompt_mask.logical_or(in_output), at::where(x.gt(0), x / rep, x * rep), x);
  x = x - frequency_penalty.unsqueeze(1) * counts - presence_penalty.unsqueeze(1) * in_output;
  logits.copy_(x);
}

namespace {

// Any device without a native kernel (MPS, XPU, ...) falls back to these.
TORCH_LIBRARY_IMPL(fastllm, CompositeExplicitAutograd, m) {
  m.impl("sample", &sample_composite);
  m.impl("sample_with_logprobs", &sample_with_logprobs_composite);
  m.impl("apply_penalties", &apply_penalties_composite);
}

}  // namespace
}  // namespace fastllm
