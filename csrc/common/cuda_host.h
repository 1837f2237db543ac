// Host-side helpers shared by the *_cuda.cu files: storage-type mapping, pointers, launch checks
// and the policy for checks that must read tensor values.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/trusted_inputs.h"

namespace fastllm {

// The CUDA type that stores an ATen scalar type: the kernel templates know __half and
// __nv_bfloat16, not c10::Half and c10::BFloat16 (same bits).
template <typename T>
struct CudaStorage {
  using type = T;
};
template <>
struct CudaStorage<c10::Half> {
  using type = __half;
};
template <>
struct CudaStorage<c10::BFloat16> {
  using type = __nv_bfloat16;
};
template <typename T>
using cuda_storage_t = typename CudaStorage<T>::type;

template <typename T>
const cuda_storage_t<T>* cuda_ptr(const at::Tensor& t) {
  return reinterpret_cast<const cuda_storage_t<T>*>(t.const_data_ptr<T>());
}
template <typename T>
cuda_storage_t<T>* cuda_mutable_ptr(const at::Tensor& t) {
  return reinterpret_cast<cuda_storage_t<T>*>(t.mutable_data_ptr<T>());
}

// Checks that read index values (slots, block tables, cu_seqlens, positions, sampling
// parameters) need them on the host: a device-to-host copy and a wait for the device. They run
// unless the caller vouches for the values (fastllm.ops.trusted_inputs(), common/
// trusted_inputs.h) or the stream is being captured into a CUDA graph, where a wait is illegal.
// The kernels never read or write out of bounds on bad values either way.
inline bool can_check_values() {
  return !trusted_inputs() &&
         c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None;
}

// `t` on the host, contiguous, for the value checks.
inline at::Tensor host_copy(const at::Tensor& t) { return t.to(at::kCPU).contiguous(); }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The most blocks a grid takes along y: launches over more rows go in chunks of this many.
constexpr int64_t kMaxGridY = 65535;

// t when its last dimension is dense (the kernels step along rows by their strides), else a
// contiguous copy.
inline at::Tensor dense_rows(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

}  // namespace fastllm
