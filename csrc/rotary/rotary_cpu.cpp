// Rotary position embedding on the CPU, in place, for the half-split (neox) and interleaved
// layouts. The rotation runs in float32 whatever the storage dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/dispatch.h"
#include "common/vec.h"
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
  // Validate every position before touching q or k, so bad input leaves them unchanged.
  AT_DISPATCH_INDEX_TYPES(pos.scalar_type(), "fastllm::rotary_positions", [&] {
    const index_t* p = pos.const_data_ptr<index_t>();
    for (int64_t t = 0; t < pos.numel(); ++t)
      TORCH_CHECK_VALUE(p[t] >= 0 && p[t] < cos_sin_cache.size(0), "positions[", t, "]=", p[t],
                        " is outside the cos_sin_cache, which covers positions [0, ",
                        cos_sin_cache.size(0), ")");
  });
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

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CPU, m) { m.impl("rotary_embedding", &rotary_embedding_cpu); }

}  // namespace fastllm
