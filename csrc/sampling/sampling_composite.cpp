// Sampling written with ATen ops: what a device without a native kernel runs (MPS). It sorts
// each row once (a fallback may); the semantics and the Philox draw are those of the CPU kernel.
// No float64 tensor (MPS has none): sums are exact int64 sums of fixed-point weights instead.
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/composite.h"
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

// Fractional bits of the fixed-point weights: a row of `vocab` weights <= 1 sums below 2^62.
int weight_bits(int64_t vocab) { return 62 - std::bit_width(uint64_t(vocab - 1)); }

struct Filtered {
  at::Tensor x;         // float32 logits [batch, vocab]
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
  // A temperature so small that 1 / T overflows leaves only the maximum: greedy, as on the CPU.
  const auto greedy = temperature.eq(0).logical_or(temperature.reciprocal().isinf());
  const auto t = at::where(greedy, at::ones_like(temperature), temperature).unsqueeze(1);
  // Scaled relative to the maximum (x / t alone can overflow float32): z <= 0, max(z) = 0.
  const auto z = (x - std::get<0>(x.max(1, /*keepdim=*/true))) / t;
  const auto sorted = z.sort(/*stable=*/true, /*dim=*/1, /*descending=*/true);
  const auto& values = std::get<0>(sorted);
  const auto& order = std::get<1>(sorted);

  // top-k: every value >= the k-th largest.
  const auto k = top_k.to(at::kLong);
  const auto k_on = k.gt(0).logical_and(k.lt(vocab));
  const auto kth = values.gather(1, (k.clamp(1, vocab) - 1).unsqueeze(1));
  auto keep = z.ge(kth).logical_or(k_on.logical_not().unsqueeze(1));

  // The weights exp(z) <= 1 in fixed point, rounded up so that every token of nonzero float32
  // weight keeps a nonzero one: w * 2^bits is an integer already for w >= 2^(23 - bits), so
  // the int64 sums below are the exact sums of the float32 weights but for the tiniest.
  const int bits = weight_bits(vocab);
  const auto weights =
      z.exp().mul_(std::ldexp(1.0, bits)).ceil_().to(at::kLong).masked_fill_(keep.logical_not(), 0);

  // top-p: a token stays while the mass strictly above its tie group is below top_p.
  const auto sorted_weights = weights.gather(1, order);  // non-increasing
  const auto above = sorted_weights.cumsum(1) - sorted_weights;
  const auto descending = sorted_weights.neg().contiguous();
  const auto first_of_tie = at::searchsorted(descending, descending, false, false);
  const auto mass_above = at::empty_like(above).scatter_(1, order, above.gather(1, first_of_tie));
  const auto top_k_mass = weights.sum(1, /*keepdim=*/true).to(at::kFloat);
  // Exact integers compared as float32 ratios; top_p = 1 keeps every token whatever they round to.
  keep = keep.logical_and(mass_above.to(at::kFloat)
                              .div_(top_k_mass)
                              .lt(top_p.unsqueeze(1))
                              .logical_or(top_p.ge(1).unsqueeze(1)));

  // min-p: p >= min_p * p_max, i.e. z >= log(min_p).
  keep = keep.logical_and(z.ge(min_p.log().unsqueeze(1)));

  // Tokens of zero weight are not kept (as in the CPU kernel).
  const auto kept_weights = weights.masked_fill(keep.logical_not(), 0);
  keep = kept_weights.gt(0);
  const auto kept_mass = kept_weights.sum(1);
  const auto log_kept_mass = kept_mass.to(at::kFloat).mul_(std::ldexp(1.0, -bits)).log_();
  const auto logprobs =
      at::where(greedy.unsqueeze(1), x.log_softmax(1),
                (z - log_kept_mass.unsqueeze(1)).masked_fill_(keep.logical_not(), -kInf));

  // The draw: the first token, in vocab order, whose cumulative kept weight exceeds the row's
  // Philox uniform times the kept mass. That target is computed on the host (as the CPU kernel
  // does, in double), clamped below the mass so that a kept token is always found.
  const auto mass_cpu = kept_mass.cpu();
  const auto seeds_cpu = seeds.cpu().contiguous(), offsets_cpu = offsets.cpu().contiguous();
  auto target = at::empty({batch, 1}, at::kLong);
  for (int64_t r = 0; r < batch; ++r) {
    const int64_t mass = mass_cpu.const_data_ptr<int64_t>()[r];
    const double u = philox_uniform(uint64_t(seeds_cpu.const_data_ptr<int64_t>()[r]),
                                    uint64_t(offsets_cpu.const_data_ptr<int64_t>()[r]));
    target.mutable_data_ptr<int64_t>()[r] = std::min(int64_t(u * double(mass)), mass - 1);
  }
  const auto drawn = at::searchsorted(kept_weights.cumsum(1), target.to(x.device()), false,
                                      /*right=*/true);
  const auto tokens = at::where(greedy, x.argmax(1), drawn.squeeze(1));
  return {x, logprobs, tokens};
}

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

FASTLLM_COMPOSITE_IMPL(m) {
  m.impl("sample", &sample_composite);
  m.impl("sample_with_logprobs", &sample_with_logprobs_composite);
  m.impl("apply_penalties", &apply_penalties_composite);
}

}  // namespace
}  // namespace fastllm
