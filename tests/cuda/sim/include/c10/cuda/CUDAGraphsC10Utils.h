// The simulator's c10/cuda/CUDAGraphsC10Utils.h: "capturing" is a switch of the simulator
// (fastllm_sim::configure), so the host files' capture-time paths can be tested.
#pragma once

namespace cuda_sim {
bool capturing();
}

namespace c10::cuda {

enum class CaptureStatus { None, Active, Invalidated };

inline CaptureStatus currentStreamCaptureStatusMayInitCtx() {
  return ::cuda_sim::capturing() ? CaptureStatus::Active : CaptureStatus::None;
}

}  // namespace c10::cuda
