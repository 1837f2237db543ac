// A cache of additive causal masks: one square buffer per (dtype, device), grown by doubling,
// handed out as views. Paths that need a materialized mask (a plain matmul/softmax attention,
// SDPA with attn_mask) pay for building it once instead of on every forward.
#pragma once

#include <map>
#include <mutex>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace fastllm {

class MaskCache {
 public:
  static constexpr int64_t kDefaultMaxBytes = int64_t(1) << 30;  // 1 GiB
  static constexpr int64_t kMinSide = 64;

  explicit MaskCache(int64_t max_bytes = kDefaultMaxBytes);

  // [len_q, len_k] view: 0 where query i may see key j (j <= i + len_k - len_q), -inf elsewhere.
  at::Tensor get(int64_t len_q, int64_t len_k, at::ScalarType dtype, at::Device device);

  int64_t nbytes() const;     // bytes held by the cache's buffers
  int64_t max_bytes() const { return max_bytes_; }
  int64_t side(at::ScalarType dtype, at::Device device) const;  // buffer side, 0 if none
  void clear();

 private:
  using Key = std::tuple<int, int, int>;  // dtype, device type, device index
  static Key key_of(at::ScalarType dtype, at::Device device);

  mutable std::mutex mutex_;
  std::map<Key, at::Tensor> buffers_;
  const int64_t max_bytes_;
};

}  // namespace fastllm
