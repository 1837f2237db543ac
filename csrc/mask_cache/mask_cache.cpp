#include "mask_cache/mask_cache.h"

#include <limits>

#include <ATen/ATen.h>

#include "common/checks.h"

namespace fastllm {

MaskCache::MaskCache(int64_t max_bytes) : max_bytes_(max_bytes) {
  TORCH_CHECK_VALUE(max_bytes > 0, "MaskCache max_bytes must be positive, got ", max_bytes);
}

MaskCache::Key MaskCache::key_of(at::ScalarType dtype, at::Device device) {
  return {int(dtype), int(device.type()), int(device.index())};
}

at::Tensor MaskCache::get(int64_t len_q, int64_t len_k, at::ScalarType dtype, at::Device device) {
  TORCH_CHECK_VALUE(len_q >= 0 && len_k >= 0, "MaskCache.get: lengths must be >= 0, got len_q=",
                    len_q, ", len_k=", len_k);
  TORCH_CHECK_VALUE(len_q <= len_k, "MaskCache.get: a causal mask needs len_q <= len_k (queries "
                    "are the last len_q of the len_k positions), got len_q=", len_q,
                    ", len_k=", len_k);
  TORCH_CHECK_TYPE(at::isFloatingType(dtype), "MaskCache.get: an additive mask needs a floating "
                   "dtype, got ", dtype_name(dtype));
  std::lock_guard<std::mutex> lock(mutex_);
  at::Tensor& buffer = buffers_[key_of(dtype, device)];
  const int64_t old_side = buffer.defined() ? buffer.size(0) : 0;
  if (!buffer.defined() || old_side < len_k) {
    int64_t side = std::max(kMinSide, 2 * old_side);
    while (side < len_k) side *= 2;
    const int64_t bytes = side * side * int64_t(c10::elementSize(dtype));
    int64_t total = bytes;
    for (const auto& [key, other] : buffers_)
      if (other.defined() && &other != &buffer) total += other.nbytes();
    if (total > max_bytes_) {
      if (!buffer.defined()) buffers_.erase(key_of(dtype, device));
      TORCH_CHECK_VALUE(false, "MaskCache: len_k=", len_k, " needs a ", side, "x", side, " ",
                        dtype_name(dtype), " mask (", bytes, " bytes), bringing the cache to ", total,
                        " bytes, over its max_bytes=", max_bytes_);
    }
    // Row r may see columns c <= r; a [len_q, len_k] request is rows len_k-len_q .. len_k-1.
    buffer = at::full({side, side}, -std::numeric_limits<double>::infinity(),
                      at::TensorOptions().dtype(dtype).device(device))
                 .triu_(1);
  }
  return buffer.narrow(0, len_k - len_q, len_q).narrow(1, 0, len_k);
}

int64_t MaskCache::nbytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t total = 0;
  for (const auto& [key, buffer] : buffers_) total += buffer.nbytes();
  return total;
}

int64_t MaskCache::side(at::ScalarType dtype, at::Device device) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = buffers_.find(key_of(dtype, device));
  return it == buffers_.end() ? 0 : it->second.size(0);
}

void MaskCache::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  buffers_.clear();
}

}  // namespace fastllm
