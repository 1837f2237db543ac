// Sampling on the CPU, one row per task, without sorting the vocabulary.
//
// Every filter keeps an upper set of the row's values, so each is a threshold:
// - top-k: the k-th largest value, from a bounded heap filled in one vectorized scan (rows
//   whose block maximum cannot enter the heap are skipped sixteen values at a time), or
//   std::nth_element when k is large;
// - top-p: a three-way quickselect over the top-k survivors' weights that stops at the value
//   whose strictly-larger mass first reaches top_p (tied values stay together);
// - min-p: max + temperature * log(min_p), in logit space.
// The draw inverts one Philox uniform through the kept weights in vocabulary order, so a row's
// token depends on its own logits, parameters, seed and offset only.
#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/dispatch.h"
#include "common/vec.h"
#include "sampling/philox.h"
#include "sampling/sampling.h"

namespace fastllm {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Top-k (or top-n logprobs) up to this size keeps a heap; larger k selects with nth_element.
constexpr int64_t kMaxHeap = 1024;

struct RowParams {
  float temperature, top_p, min_p;
  int64_t top_k;  // already clamped: 0 = off
  uint64_t seed, offset;
};

struct RowResult {
  int64_t token;
  float token_logprob;
};

// The `count` largest (value, id) of a row, most likely first, ties by lower id.
using Ranked = std::vector<std::pair<float, int32_t>>;

inline bool ranks_before(const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

void top_values(const float* x, int64_t vocab, int64_t count, Ranked& out) {
  out.clear();
  if (count <= 0) return;
  if (count > kMaxHeap) {
    out.resize(vocab);
    for (int64_t i = 0; i < vocab; ++i) out[i] = {x[i], int32_t(i)};
    std::nth_element(out.begin(), out.begin() + (count - 1), out.end(), ranks_before);
    out.resize(count);
  } else {
    // A heap whose front is the worst kept entry; a later id with an equal value never beats it.
    constexpr int64_t W = VecF::size();
    auto worst_first = [](const auto& a, const auto& b) { return ranks_before(a, b); };
    int64_t i = 0;
    for (; i < vocab && int64_t(out.size()) < count; ++i) {
      out.emplace_back(x[i], int32_t(i));
      std::push_heap(out.begin(), out.end(), worst_first);
    }
    auto offer = [&](int64_t j) {
      if (x[j] > out.front().first) {
        std::pop_heap(out.begin(), out.end(), worst_first);
        out.back() = {x[j], int32_t(j)};
        std::push_heap(out.begin(), out.end(), worst_first);
      }
    };
    for (; i + W <= vocab; i += W) {
      const VecF block = VecF::loadu(x + i);
      if (at::vec::vec_reduce_all<float>([](VecF& a, VecF& b) { return at::vec::maximum(a, b); },
                                         block) <= out.front().first)
        continue;
      for (int64_t j = i; j < i + W; ++j) offer(j);
    }
    for (; i < vocab; ++i) offer(i);
  }
  std::sort(out.begin(), out.end(), ranks_before);
}

// The smallest weight w* such that the mass of the weights strictly above w* is below `target`,
// i.e. the kept set of top-p is {w >= w*}. `weights` is scratch (reordered).
float top_p_threshold(std::vector<float>& weights, double target) {
  int64_t lo = 0, hi = int64_t(weights.size());
  double above = 0;  // mass known to be above weights[lo, hi)
  while (true) {
    // Median of three as the pivot; three-way partition: > pivot | == pivot | < pivot.
    const float a = weights[lo], b = weights[(lo + hi) / 2], c = weights[hi - 1];
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));
    auto gt_end = std::partition(weights.begin() + lo, weights.begin() + hi,
                                 [pivot](float w) { return w > pivot; });
    auto eq_end = std::partition(gt_end, weights.begin() + hi,
                                 [pivot](float w) { return w == pivot; });
    double mass_gt = 0, mass_eq = 0;
    for (auto it = weights.begin() + lo; it != gt_end; ++it) mass_gt += *it;
    for (auto it = gt_end; it != eq_end; ++it) mass_eq += *it;
    if (above + mass_gt >= target) {
      hi = gt_end - weights.begin();  // the boundary lies among the larger weights
    } else if (above + mass_gt + mass_eq >= target || eq_end == weights.begin() + hi) {
      return pivot;  // the pivot's tie group is the last one kept
    } else {
      above += mass_gt + mass_eq;
      lo = eq_end - weights.begin();
    }
  }
}

struct RowScratch {
  std::vector<float> x;                   // the row as float32 (non-float32 logits)
  std::vector<float> weights;             // top-p selection scratch
  std::vector<std::pair<int32_t, float>> candidates;  // (id, weight), in id order
  Ranked ranked;
};

// Samples one row; with want_logprobs, also the token's log-probability and the top
// num_logprobs entries (into top_ids / top_logprobs).
template <typename scalar_t>
RowResult sample_row(const scalar_t* row, int64_t vocab, int64_t r, const RowParams& p,
                     bool want_logprobs, int64_t num_logprobs, int64_t* top_ids,
                     float* top_logprobs, RowScratch& sc) {
  const float* x;
  if constexpr (std::is_same_v<scalar_t, float>) {
    x = row;
  } else {
    sc.x.resize(vocab);
    convert_to_float(row, sc.x.data(), vocab);
    x = sc.x.data();
  }
  // NaN propagates through maximum; +inf and all -inf show in the maximum too.
  const float max = at::vec::reduce_all<float>(
      [](VecF& a, VecF& b) { return at::vec::maximum(a, b); }, x, vocab);
  TORCH_CHECK_VALUE(!std::isnan(max), "logits row ", r, " contains NaN");
  TORCH_CHECK_VALUE(max != std::numeric_limits<float>::infinity(), "logits row ", r,
                    " contains +inf");
  TORCH_CHECK_VALUE(max != kNegInf, "logits row ", r, " has no finite value");

  // A temperature so small that 1 / T overflows leaves only the maximum: greedy (as on CUDA).
  const bool greedy = p.temperature == 0 || std::isinf(1.f / p.temperature);
  const int64_t heap = std::max(greedy ? 0 : p.top_k, num_logprobs);
  top_values(x, vocab, std::min(heap, vocab), sc.ranked);
  // Entries with probability: at or above the threshold and, for a sampled row, a nonzero
  // float32 weight (the same test that admits a token to the draw).
  auto fill_logprobs = [&](float threshold, float scale, double log_norm, bool weighted) {
    int64_t n = 0;
    for (; n < num_logprobs && n < int64_t(sc.ranked.size()); ++n) {
      const float value = sc.ranked[n].first;
      if (value < threshold || value == kNegInf) break;
      if (weighted && std::exp((value - max) * scale) == 0.f) break;
      top_ids[n] = sc.ranked[n].second;
      top_logprobs[n] = float((value - max) * scale - log_norm);
    }
    for (; n < num_logprobs; ++n) {
      top_ids[n] = -1;
      top_logprobs[n] = kNegInf;
    }
  };

  if (greedy) {
    const int64_t token = std::find(x, x + vocab, max) - x;  // the first maximum
    if (!want_logprobs) return {token, 0.f};
    double sum = 0;
    for (int64_t i = 0; i < vocab; ++i) sum += std::exp(x[i] - max);
    const double log_norm = std::log(sum);
    fill_logprobs(kNegInf, 1.f, log_norm, /*weighted=*/false);
    return {token, float(-log_norm)};
  }

  // Work with weights w = exp((x - max) / T) <= 1 of the top-k survivors.
  const float inv_t = 1.f / p.temperature;
  const float k_threshold = p.top_k > 0 ? sc.ranked[p.top_k - 1].first : kNegInf;
  const float min_p_threshold = p.min_p > 0 ? max + p.temperature * std::log(p.min_p) : kNegInf;
  // Without top-p, min-p can already prune the candidates; with it, top-p's mass counts them.
  const float collect = p.top_p < 1 ? k_threshold : std::max(k_threshold, min_p_threshold);
  sc.candidates.clear();
  {
    constexpr int64_t W = VecF::size();
    const VecF cut(collect);
    // Tokens of weight 0 (-inf, or too unlikely for float32) have no probability: never kept.
    auto take = [&](int64_t i) {
      if (x[i] < collect) return;
      const float w = std::exp((x[i] - max) * inv_t);
      if (w > 0.f) sc.candidates.emplace_back(int32_t(i), w);
    };
    int64_t i = 0;
    for (; i + W <= vocab; i += W) {
      // Skip blocks with no value at or above the cut (most of them under top-k).
      if ((VecF::loadu(x + i) >= cut).zero_mask() == (1 << W) - 1) continue;
      for (int64_t j = i; j < i + W; ++j) take(j);
    }
    for (; i < vocab; ++i) take(i);
  }
  float threshold = collect;
  if (p.top_p < 1) {
    sc.weights.resize(sc.candidates.size());
    double total = 0;
    for (size_t j = 0; j < sc.candidates.size(); ++j) {
      sc.weights[j] = sc.candidates[j].second;
      total += sc.weights[j];
    }
    const float w_star = top_p_threshold(sc.weights, p.top_p * total);
    // Back to logit space through the same candidates: the least logit whose weight >= w*.
    float x_star = std::numeric_limits<float>::infinity();
    for (const auto& [id, w] : sc.candidates)
      if (w >= w_star) x_star = std::min(x_star, x[id]);
    threshold = std::max({x_star, k_threshold, min_p_threshold});
  }

  double kept = 0;
  for (const auto& [id, w] : sc.candidates)
    if (x[id] >= threshold) kept += w;
  const double target = philox_uniform(p.seed, p.offset) * kept;
  double acc = 0;
  int64_t token = -1;
  for (const auto& [id, w] : sc.candidates) {
    if (x[id] < threshold) continue;
    token = id;  // the last kept token if rounding leaves acc <= target at the end
    acc += w;
    if (acc > target) break;
  }
  // The maximum always has weight 1 and passes every filter, so a row is never left empty.
  TORCH_INTERNAL_ASSERT(token >= 0, "logits row ", r, " kept no token to sample (temperature ",
                        p.temperature, ", top_k ", p.top_k, ", top_p ", p.top_p, ", min_p ",
                        p.min_p, ")");
  const double log_norm = std::log(kept);
  if (want_logprobs) fill_logprobs(threshold, inv_t, log_norm, /*weighted=*/true);
  return {token, float((x[token] - max) * inv_t - log_norm)};
}

void sample_cpu_impl(const at::Tensor& logits_in, const at::Tensor& temperature,
                     const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                     const at::Tensor& seeds, const at::Tensor& offsets, int64_t num_logprobs,
                     at::Tensor& tokens, at::Tensor* token_logprobs, at::Tensor* top_ids,
                     at::Tensor* top_logprobs) {
  check_sample_inputs(logits_in, temperature, top_k, top_p, min_p, seeds, offsets);
  check_sample_params(temperature, top_p, min_p);
  TORCH_CHECK_VALUE(num_logprobs >= 0, "num_logprobs must be >= 0, got ", num_logprobs);
  const auto logits = logits_in.contiguous();
  const int64_t batch = logits.size(0), vocab = logits.size(1);
  const auto t = temperature.contiguous(), p = top_p.contiguous(), m = min_p.contiguous();
  const auto k = top_k.contiguous(), s = seeds.contiguous(), o = offsets.contiguous();
  std::vector<RowParams> params(batch);
  for (int64_t r = 0; r < batch; ++r) {
    const int64_t kr = k.const_data_ptr<int32_t>()[r];
    params[r] = {t.const_data_ptr<float>()[r], p.const_data_ptr<float>()[r],
                 m.const_data_ptr<float>()[r], kr > 0 && kr < vocab ? kr : 0,
                 uint64_t(s.const_data_ptr<int64_t>()[r]), uint64_t(o.const_data_ptr<int64_t>()[r])};
  }
  int64_t* tok = tokens.mutable_data_ptr<int64_t>();
  float* tok_lp = token_logprobs ? token_logprobs->mutable_data_ptr<float>() : nullptr;
  int64_t* ids = top_ids ? top_ids->mutable_data_ptr<int64_t>() : nullptr;
  float* lps = top_logprobs ? top_logprobs->mutable_data_ptr<float>() : nullptr;
  FASTLLM_DISPATCH_FLOAT_TYPES(logits.scalar_type(), "fastllm::sample_cpu", [&] {
    const scalar_t* base = logits.const_data_ptr<scalar_t>();
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      RowScratch scratch;
      for (int64_t r = begin; r < end; ++r) {
        const RowResult res =
            sample_row(base + r * vocab, vocab, r, params[r], tok_lp != nullptr, num_logprobs,
                       ids ? ids + r * num_logprobs : nullptr,
                       lps ? lps + r * num_logprobs : nullptr, scratch);
        tok[r] = res.token;
        if (tok_lp) tok_lp[r] = res.token_logprob;
      }
    });
  });
}

void apply_penalties_cpu(at::Tensor& logits, const at::Tensor& prompt_mask,
                         const at::Tensor& output_counts, const at::Tensor& repetition_penalty,
                         const at::Tensor& frequency_penalty, const at::Tensor& presence_penalty,
                         const std::optional<at::Tensor>& logit_bias) {
  check_penalties_inputs(logits, prompt_mask, output_counts, repetition_penalty,
                         frequency_penalty, presence_penalty, logit_bias);
  check_penalty_values(repetition_penalty, frequency_penalty, presence_penalty);
  const int64_t batch = logits.size(0), vocab = logits.size(1);
  const auto mask = prompt_mask.contiguous();
  const auto counts = output_counts.contiguous();
  const auto bias = logit_bias.has_value() ? logit_bias->contiguous() : at::Tensor();
  const auto rp = repetition_penalty.contiguous(), fp = frequency_penalty.contiguous(),
             pp = presence_penalty.contiguous();
  FASTLLM_DISPATCH_FLOAT_TYPES(logits.scalar_type(), "fastllm::apply_penalties_cpu", [&] {
    scalar_t* x = logits.mutable_data_ptr<scalar_t>();
    const int64_t s0 = logits.stride(0), s1 = logits.stride(1);
    const bool* seen_prompt = mask.const_data_ptr<bool>();
    const int32_t* count = counts.const_data_ptr<int32_t>();
    const float* b = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float rep = rp.const_data_ptr<float>()[r], freq = fp.const_data_ptr<float>()[r],
                    pres = pp.const_data_ptr<float>()[r];
        for (int64_t t = 0; t < vocab; ++t) {
          scalar_t& slot = x[r * s0 + t * s1];
          const int32_t c = count[r * vocab + t];
          float v = float(slot);
          if (b) v += b[r * vocab + t];
          if (seen_prompt[r * vocab + t] || c > 0) v = v > 0 ? v / rep : v * rep;
          v -= freq * float(c) + (c > 0 ? pres : 0.f);
          slot = scalar_t(v);
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CPU, m) {
  m.impl("sample", &sample_op<sample_cpu_impl>);
  m.impl("sample_with_logprobs", &sample_with_logprobs_op<sample_cpu_impl>);
  m.impl("apply_penalties", &apply_penalties_cpu);
}

}  // namespace fastllm
