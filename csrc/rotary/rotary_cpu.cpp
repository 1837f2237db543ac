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

// The tokens' cos | sin rows of a table in float32: the table's own rows where it is float32
// with unit column stride, else the tokens' rows gathered and converted once a call.
// `positions` int64, each inside the table.
class CosSinRows {
 public:
  CosSinRows(const at::Tensor& table, const at::Tensor& positions) {
    if (table.scalar_type() == at::kFloat && table.stride(1) == 1) {
      data_ = table.const_data_ptr<float>();
      stride_ = table.stride(0);
    } else {
      gathered_ = table.index_select(0, positions).to(at::kFloat).contiguous();
      data_ = gathered_.const_data_ptr<float>();
      stride_ = table.size(1);
    }
  }
  // Token t's row, at `position`: cos in its first half, sin in its second.
  const float* row(int64_t t, int64_t position) const {
    return data_ + (gathered_.defined() ? t : position) * stride_;
  }

 private:
  at::Tensor gathered_;
  const float* data_;
  int64_t stride_;
};

void rotary_embedding_cpu(const at::Tensor& positions, at::Tensor& q,
                          const std::optional<at::Tensor>& k, const at::Tensor& cos_sin_cache,
                          bool is_neox, std::optional<int64_t> rotary_dim) {
  const int64_t rot = check_rotary_inputs(positions, q, k, cos_sin_cache, rotary_dim);
  const int64_t half = rot / 2;
  const auto pos = positions.to(at::kLong).contiguous();
  // Every position checked before q or k is touched: bad input leaves them unchanged.
  check_position_values(pos, cos_sin_cache.size(0));
  const CosSinRows cos_sin(cos_sin_cache, pos);
  const int64_t* p = pos.const_data_ptr<int64_t>();
  FASTLLM_DISPATCH_FLOAT_TYPES(q.scalar_type(), "fastllm::rotary_embedding_cpu", [&] {
    scalar_t* qp = q.mutable_data_ptr<scalar_t>();
    scalar_t* kp = k.has_value() ? k->mutable_data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, q.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = cos_sin.row(t, p[t]);
        rotate_heads(qp + t * q.stride(0), q.size(1), q.stride(1), q.stride(2), cos, cos + half,
                     half, is_neox);
        if (kp)
          rotate_heads(kp + t * k->stride(0), k->size(1), k->stride(1), k->stride(2), cos,
                       cos + half, half, is_neox);
      }
    });
  });
}

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
  std::optional<CosSinRows> cos_sin;
  if (cos_sin_cache.has_value()) {
    check_position_values(pos, cos_sin_cache->size(0));
    cos_sin.emplace(*cos_sin_cache, pos);
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
