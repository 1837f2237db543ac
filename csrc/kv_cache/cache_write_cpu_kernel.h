// Writing one token's K or V rows into its slot of a paged CPU cache: reshape_and_cache's CPU
// kernel (cache_write_cpu.cpp) and rotary_and_cache's (rotary_cpu.cpp). Every TU that includes
// it compiles its own copy (an anonymous namespace).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>

namespace fastllm {
namespace {

// The rows of `token` (a token's [heads, dim] rows of `src`, [tokens, heads, dim]) written to
// slot `slot` of `cache` ([num_blocks, block_size, heads, dim]), converted to the cache's dtype
// (rounded to nearest even, as Tensor.to rounds) or copied as they are where the dtypes match.
template <typename scalar_t, typename cache_t>
inline void copy_token_rows(const scalar_t* token, const at::Tensor& src, cache_t* cache_data,
                            const at::Tensor& cache, int64_t slot) {
  const int64_t heads = src.size(1), dim = src.size(2);
  const int64_t in_head = src.stride(1), in_dim = src.stride(2);
  const int64_t out_head = cache.stride(2), out_dim = cache.stride(3);
  const int64_t block_size = cache.size(1);
  cache_t* row = cache_data + (slot / block_size) * cache.stride(0) +
                 (slot % block_size) * cache.stride(1);
  // Rows contiguous on both sides (the usual case: K/V are column slices of the fused QKV
  // output): one memcpy or vectorized conversion per head row instead of an element loop.
  const bool rows_contiguous = in_dim == 1 && out_dim == 1;
  for (int64_t h = 0; h < heads; ++h) {
    if (!rows_contiguous) {
      for (int64_t d = 0; d < dim; ++d)
        row[h * out_head + d * out_dim] = cache_t(token[h * in_head + d * in_dim]);
    } else if constexpr (std::is_same_v<scalar_t, cache_t>) {
      std::memcpy(row + h * out_head, token + h * in_head, dim * sizeof(scalar_t));
    } else {
      at::vec::convert(token + h * in_head, row + h * out_head, dim);
    }
  }
}

}  // namespace
}  // namespace fastllm
