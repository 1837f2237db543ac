// Rotary position embedding on the CPU, in place, for the half-split (neox) and interleaved
// layouts, alone (rotary_embedding) or with the q/k norms before it and the cache write after it
// (rotary_and_cache). The rotation runs in float32 whatever the storage dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/dispatch.h"
#include "common/vec.h"
#include "kv_cache/cache_write.h"
#include "kv_cache/cache_write_cpu_kernel.h"
#include "norm/norm_cpu_kernel.h"
#include "rotary/rotary.h"

namespace fastllm {
namespace {

// The half-split layout with unit dim stride, a vector of channel pairs at a time.
template <typename scalar_t>
inline void rotate_heads_neox_vec(scalar_t* x, int64_t n_heads, int64_t head_stride,
                                  const float* cos, const float* sin, int64_t half) {
  constexpr int64_t W = VecF::size();
  for (int64_t h = 0; h < n_heads; ++h) {
    scalar_t* x1 = x + h * head_stride;
    scalar_t* x2 = x1 + half;
    for (int64_t i = 0; i < half; i += W) {
      const VecF a = load_as_float(x1 + i), b = load_as_float(x2 + i);
      const VecF c = VecF::loadu(cos + i), s = VecF::loadu(sin + i);
      store_from_float(a * c - b * s, x1 + i);
      store_from_float(b * c + a * s, x2 + i);
    }
  }
}

template <typename scalar_t>
inline void rotate_heads(scalar_t* x, int64_t n_heads, int64_t head_stride, int64_t dim_stride,
                         const float* cos, const float* sin, int64_t half, bool is_neox) {
  if (is_neox && dim_stride == 1 && half % VecF::size() == 0)
    return rotate_heads_neox_vec(x, n_heads, head_stride, cos, sin, half);
  // neox pairs channel i with i + half; the interleaved layout pairs 2i with 2i + 1.
  const int64_t second = is_neox ? half : 1;
  const int64_t step = is_neox ? 1 : 2;
  for (int64_t h = 0; h < n_heads; ++h) {
    scalar_t* xh = x + h * head_stride;
    for (int64_t i = 0; i < half; ++i) {
      scalar_t* a = xh + i * step * dim_stride;
      scalar_t* b = a + second * dim_stride;
      const float x1 = float(*a), x2 = float(*b);
      *a = scalar_t(x1 * cos[i] - x2 * sin[i]);
      *b = scalar_t(x2 * cos[i] + x1 * sin[i]);
    }
  }
}

template <typename scalar_t, typename cache_t, typename pos_t>
void rotary_kernel(const at::Tensor& positions, at::Tensor& q, const std::optional<at::Tensor>& k,
                   const at::Tensor& cache, int64_t rot, bool is_neox) {
  const int64_t tokens = q.size(0), half = rot / 2;
  const pos_t* pos = positions.const_data_ptr<pos_t>();
  const cache_t* cs = cache.const_data_ptr<cache_t>();
  const int64_t cs_row = cache.stride(0), cs_col = cache.stride(1);
  scalar_t* qp = q.mutable_data_ptr<scalar_t>();
  scalar_t* kp = k.has_value() ? k->mutable_data_ptr<scalar_t>() : nullptr;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> cos(half), sin(half);
    for (int64_t t = begin; t < end; ++t) {
      const cache_t* row = cs + int64_t(pos[t]) * cs_row;
      for (int64_t i = 0; i < half; ++i) {
        cos[i] = float(row[i * cs_col]);
        sin[i] = float(row[(half + i) * cs_col]);
      }
      rotate_heads(qp + t * q.stride(0), q.size(1), q.stride(1), q.stride(2), cos.data(),
                   sin.data(), half, is_neox);
      if (kp)
        rotate_heads(kp + t * k->stride(0), k->size(1), k->stride(1), k->stride(2), cos.data(),
                     sin.data(), half, is_neox);
    }
  });
}

void rotary_embedding_cpu(const at::Tensor& positions, at::Tensor& q,
                          const std::optional<at::Tensor>& k, const at::Tensor& cos_sin_cache,
                          bool is_neox, std::optional<int64_t> rotary_dim) {
  const int64_t rot = check_rotary_inputs(positions, q, k, cos_sin_cache, rotary_dim);
  const auto pos = positions.contiguous();
  // Every position checked before q or k is touched: bad input leaves them unchanged.
  check_position_values(pos, cos_sin_cache.size(0));
  FASTLLM_DISPATCH_FLOAT_TYPES(q.scalar_type(), "fastllm::rotary_embedding_cpu", [&] {
    using q_t = scalar_t;
    FASTLLM_DISPATCH_FLOAT_TYPES(cos_sin_cache.scalar_type(), "fastllm::rotary_cache", [&] {
      using cache_t = scalar_t;
      AT_DISPATCH_INDEX_TYPES(pos.scalar_type(), "fastllm::rotary_positions", [&] {
        rotary_kernel<q_t, cache_t, index_t>(pos, q, k, cos_sin_cache, rot, is_neox);
      });
    });
  });
}

// A token's cos | sin row of the table, in float32.
struct CosSinRows {
  const float* data;
  int64_t stride;
  bool by_token;  // rows gathered per token (row t), else the table's rows (row positions[t])
  const float* row(int64_t t, int64_t position) const {
    return data + (by_token ? t : position) * stride;
  }
};

// rotary_and_cache in one pass over the tokens: a token's q and k heads normalized (q_norm,
// k_norm) and rotated in place, then its K and V rows written to its slot. The arithmetic of
// the ops it fuses (rms_norm's normalize_row, rotate_heads, reshape_and_cache's
// copy_token_rows), without their intermediate tensors and separate passes.
template <typename scalar_t, typename cache_t>
void rotary_and_cache_kernel(const int64_t* positions, at::Tensor& q, at::Tensor& k,
                             const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                             const int64_t* slots, const std::optional<CosSinRows>& cos_sin,
                             int64_t rot, const scalar_t* q_norm, const scalar_t* k_norm,
                             float eps, bool is_neox, bool rotate_keys) {
  const int64_t head_dim = q.size(2), half = rot / 2;
  scalar_t* qp = q.mutable_data_ptr<scalar_t>();
  scalar_t* kp = k.mutable_data_ptr<scalar_t>();
  const scalar_t* vp = value.const_data_ptr<scalar_t>();
  cache_t* kc = k_cache.mutable_data_ptr<cache_t>();
  cache_t* vc = v_cache.mutable_data_ptr<cache_t>();
  at::parallel_for(0, q.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      scalar_t* qt = qp + t * q.stride(0);
      scalar_t* kt = kp + t * k.stride(0);
      if (q_norm) {
        for (int64_t h = 0; h < q.size(1); ++h)
          normalize_row(qt + h * q.stride(1), q_norm, qt + h * q.stride(1), head_dim, eps);
        for (int64_t h = 0; h < k.size(1); ++h)
          normalize_row(kt + h * k.stride(1), k_norm, kt + h * k.stride(1), head_dim, eps);
      }
      if (cos_sin.has_value()) {
        const float* cos = cos_sin->row(t, positions[t]);
        rotate_heads(qt, q.size(1), q.stride(1), q.stride(2), cos, cos + half, half, is_neox);
        if (rotate_keys)
          rotate_heads(kt, k.size(1), k.stride(1), k.stride(2), cos, cos + half, half, is_neox);
      }
      if (slots[t] < 0) continue;  // padding: no slot
      copy_token_rows(kt, k, kc, k_cache, slots[t]);
      copy_token_rows(vp + t * value.stride(0), value, vc, v_cache, slots[t]);
    }
  });
}

void rotary_and_cache_cpu(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                          const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                          const at::Tensor& slot_mapping,
                          const std::optional<at::Tensor>& cos_sin_cache,
                          const std::optional<at::Tensor>& q_norm,
                          const std::optional<at::Tensor>& k_norm, double eps, bool is_neox,
                          bool rotate_keys) {
  const int64_t rot = check_rotary_and_cache_inputs(positions, q, k, value, k_cache, v_cache,
                                                    slot_mapping, cos_sin_cache, q_norm, k_norm,
                                                    eps);
  // Every slot and position checked before anything is written: bad input changes nothing.
  const auto slots = slot_mapping.contiguous();
  check_slot_values(slots, k_cache.size(0) * k_cache.size(1));
  const auto pos = positions.to(at::kLong).contiguous();
  // The table's rows as float32: the table itself, or (another dtype or layout) the tokens'
  // rows gathered and converted.
  std::optional<CosSinRows> cos_sin;
  at::Tensor gathered;
  if (cos_sin_cache.has_value()) {
    check_position_values(pos, cos_sin_cache->size(0));
    const at::Tensor& table = *cos_sin_cache;
    if (table.scalar_type() == at::kFloat && table.stride(1) == 1) {
      cos_sin = CosSinRows{table.const_data_ptr<float>(), table.stride(0), false};
    } else {
      gathered = table.index_select(0, pos).to(at::kFloat).contiguous();
      cos_sin = CosSinRows{gathered.const_data_ptr<float>(), rot, true};
    }
  }
  const auto q_weight = q_norm.has_value() ? q_norm->contiguous() : at::Tensor();
  const auto k_weight = k_norm.has_value() ? k_norm->contiguous() : at::Tensor();
  FASTLLM_DISPATCH_KV_CACHE_TYPES(q.scalar_type(), k_cache.scalar_type(),
                                  "fastllm::rotary_and_cache_cpu", [&] {
    rotary_and_cache_kernel<scalar_t, cache_t>(
        pos.const_data_ptr<int64_t>(), q, k, value, k_cache, v_cache,
        slots.const_data_ptr<int64_t>(), cos_sin, rot,
        q_weight.defined() ? q_weight.const_data_ptr<scalar_t>() : nullptr,
        k_weight.defined() ? k_weight.const_data_ptr<scalar_t>() : nullptr, float(eps), is_neox,
        rotate_keys);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CPU, m) {
  m.impl("rotary_embedding", &rotary_embedding_cpu);
  m.impl("rotary_and_cache", &rotary_and_cache_cpu);
}

}  // namespace fastllm
