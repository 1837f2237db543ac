#include "mask_cache/mask_cache.h"

#include <cmath>
#include <limits>

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "common/checks.h"

namespace fastllm {

MaskCache::MaskCache(int64_t max_bytes) : max_bytes_(max_bytes) {
  TORCH_CHECK_VALUE(max_bytes > 0, "MaskCache max_bytes must be positive, got ", max_bytes);
}

MaskCache::Key MaskCache::key_of(at::ScalarType dtype, at::Device device) {
  // "cpu" and "cpu:0" are one device; an accelerator without an index means the current one.
  int index = -1;
  if (device.type() != at::kCPU)
    index = device.has_index()
                ? device.index()
                : c10::impl::getDeviceGuardImpl(device.type())->getDevice().index();
  return {int(dtype), int(device.type()), index};
}

at::Tensor MaskCache::get(int64_t len_q, int64_t len_k, at::ScalarType dtype, at::Device device) {
  TORCH_CHECK_VALUE(len_q >= 0 && len_k >= 0, "MaskCache.get: lengths must be >= 0, got len_q=",
                    len_q, ", len_k=", len_k);
  TORCH_CHECK_VALUE(len_q <= len_k, "MaskCache.get: a causal mask needs len_q <= len_k (queries "
                    "are the last len_q of the len_k positions), got len_q=", len_q,
                    ", len_k=", len_k);
  TORCH_CHECK_TYPE(at::isFloatingType(dtype), "MaskCache.get: an additive mask needs a floating "
                   "dtype, got ", dtype_name(dtype));
  const Key key = key_of(dtype, device);
  const int64_t elem = int64_t(c10::elementSize(dtype));
  std::lock_guard<std::mutex> lock(mutex_);
  const auto found = buffers_.find(key);
  const int64_t old_side = found == buffers_.end() ? 0 : found->second.size(0);
  if (found == buffers_.end() || old_side < len_k) {
    int64_t others = 0;
    for (const auto& [other_key, other] : buffers_)
      if (other_key != key) others += other.nbytes();
    // Sizes in double: len_k may be large enough for side * side to overflow int64.
    const double budget = double(max_bytes_ - others) / double(elem);
    TORCH_CHECK_VALUE(double(len_k) * double(len_k) <= budget, "MaskCache: len_k=", len_k,
                      " needs a ", len_k, "x", len_k, " ", dtype_name(dtype), " mask (",
                      double(len_k) * double(len_k) * double(elem), " bytes), which with the ",
                      others, " bytes already held exceeds max_bytes=", max_bytes_);
    // Double the side until it covers len_k, but never past what the limit allows.
    const auto max_side = int64_t(std::sqrt(budget));
    int64_t side = std::max(kMinSide, 2 * old_side);
    while (side < len_k) side *= 2;
    side = std::max(len_k, std::min(side, max_side));
    // Row r may see columns c <= r; a [len_q, len_k] request is rows len_k-len_q .. len_k-1.
    auto buffer = at::full({side, side}, -std::numeric_limits<double>::infinity(),
                           at::TensorOptions().dtype(dtype).device(device))
                      .triu_(1);
    buffers_[key] = std::move(buffer);
  }
  return buffers_[key].narrow(0, len_k - len_q, len_q).narrow(1, 0, len_k);
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
