// The simulator's c10/cuda/CUDAGuard.h: one simulated device, nothing to switch.
#pragma once

#include <c10/core/Device.h>

namespace c10::cuda {

struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
  explicit CUDAGuard(c10::DeviceIndex) {}
};

}  // namespace c10::cuda
