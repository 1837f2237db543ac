// Asynchronous global -> shared copies (cp.async, sm_80 and later), for the torch-free kernel
// templates that stage K/V tiles in shared memory.
#pragma once

#include <cstdint>

namespace fastllm {
namespace cuda {

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; with fill == false nothing is read and 16 zero bytes are written.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool fill) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(fill ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most kPending of this thread's committed copy groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Waits for all of this thread's copies, committed or not (a barrier then publishes them to the
// block).
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

}  // namespace cuda
}  // namespace fastllm
