// The CUDA simulator's device side: force-included (g++ -include) before every source of the
// simulator build, so the kernel templates and host files compile as plain C++ and run on the
// CPU. One block runs at a time; its threads are cooperative fibers that switch only at
// __syncthreads and the warp collectives, so a kernel that needs a barrier it does not have, or
// that reaches a barrier in only some threads, shows up as a wrong result or a reported deadlock.
// What the simulator knows of ldmatrix, mma.sync and cp.async is the PTX ISA's description
// (sim/include/common/cuda_ptx.cuh), not the hardware.
#pragma once

// Block-shared variables are function statics: blocks run one after another.
#define __shared__ static
#define __launch_bounds__(...)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

namespace cuda_sim {

struct ThreadPosition {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};

// The running simulated thread's position.
const ThreadPosition& position();
int lane();

// Stops the launch with `what`; the host call then raises it.
[[noreturn]] void fail(const char* what);

void sync_block();

// Warp collectives. The lanes of `mask` each give `bytes` (<= kLaneBytes) bytes; once all have,
// each gets the 32 lanes' values, lane l's at l * kLaneBytes (lanes outside `mask` undefined), and
// must call warp_done(mask) after reading them.
// `op` names the collective, so lanes meeting at different ones are reported.
constexpr size_t kLaneBytes = 32;
const unsigned char* warp_exchange(unsigned mask, const void* value, size_t bytes, const char* op);
void warp_done(unsigned mask);

// Runs `body` for every thread of every block of the grid (see sim/include/common/cuda_launch.cuh).
void launch(const void* kernel, dim3 grid, dim3 block, size_t smem_bytes,
            const std::function<void()>& body);

// The running block's dynamic shared memory, poisoned with 0xff bytes before the block starts.
unsigned char* dynamic_shared_memory();
size_t dynamic_shared_memory_bytes();

// cp.async of this thread: queued, and carried out only when a wait needs it, so a kernel that
// reads a tile before its wait reads the poison.
void cp_async_16(uint32_t dst, const void* src, bool fill);
void cp_async_commit();
void cp_async_wait(int pending);

template <typename T>
T shuffle(unsigned mask, T value, int source, const char* op) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= kLaneBytes);
  const unsigned char* all = warp_exchange(mask, &value, sizeof(T), op);
  if (source < 0 || source > 31 || !((mask >> source) & 1u)) fail("shuffle from a lane outside its mask");
  T result;
  std::memcpy(&result, all + size_t(source) * kLaneBytes, sizeof(T));
  warp_done(mask);
  return result;
}

}  // namespace cuda_sim

// The runtime's C++ overloads that take a kernel itself (nvcc's cuda_runtime.h declares them only
// for CUDA sources).
template <typename T>
cudaError_t cudaFuncSetAttribute(T* kernel, cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}
template <typename T>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, T* kernel, int block_size,
                                                          size_t dynamic_smem_bytes) {
  return ::cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      blocks, reinterpret_cast<const void*>(kernel), block_size, dynamic_smem_bytes);
}

#define threadIdx (::cuda_sim::position().thread_idx)
#define blockIdx (::cuda_sim::position().block_idx)
#define blockDim (::cuda_sim::position().block_dim)
#define gridDim (::cuda_sim::position().grid_dim)

inline void __syncthreads() { ::cuda_sim::sync_block(); }

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::cuda_sim::warp_exchange(mask, nullptr, 0, "__syncwarp");
  ::cuda_sim::warp_done(mask);
}

template <typename T>
T __shfl_sync(unsigned mask, T value, int source, int width = 32) {
  const int lane = ::cuda_sim::lane();
  return ::cuda_sim::shuffle(mask, value, (lane & ~(width - 1)) + (source & (width - 1)),
                             "__shfl_sync");
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  const int lane = ::cuda_sim::lane();
  const int source = lane ^ lane_mask;
  // A source past this lane's width-wide segment gives the lane's own value.
  return ::cuda_sim::shuffle(mask, value,
                             (source & ~(width - 1)) == (lane & ~(width - 1)) ? source : lane,
                             "__shfl_xor_sync");
}

template <typename T>
T __shfl_up_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  const int lane = ::cuda_sim::lane();
  const int source = (lane & (width - 1)) >= int(delta) ? lane - int(delta) : lane;
  return ::cuda_sim::shuffle(mask, value, source, "__shfl_up_sync");
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
  const int value = predicate != 0;
  const unsigned char* all = ::cuda_sim::warp_exchange(mask, &value, sizeof(value), "__ballot_sync");
  unsigned ballot = 0;
  for (int l = 0; l < 32; ++l) {
    int v = 0;
    if ((mask >> l) & 1u) std::memcpy(&v, all + l * ::cuda_sim::kLaneBytes, sizeof(v));
    ballot |= unsigned(v) << l;
  }
  ::cuda_sim::warp_done(mask);
  return ballot;
}

// Fibers never interleave between switch points, so a plain read-modify-write is atomic.
template <typename T>
T atomicAdd(T* address, T value) {
  const T old = *address;
  *address = old + value;
  return old;
}

template <typename T>
T atomicMin(T* address, T value) {
  const T old = *address;
  *address = value < old ? value : old;
  return old;
}

// CUDA's global min/max overloads for device code.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a < b ? b : a; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a < b ? b : a; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a < b ? b : a; }

inline int __ffs(int x) { return __builtin_ffs(x); }

inline float __uint_as_float(unsigned x) {
  float f;
  std::memcpy(&f, &x, sizeof(f));
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned x;
  std::memcpy(&x, &f, sizeof(x));
  return x;
}
inline float __int_as_float(int x) {
  float f;
  std::memcpy(&f, &x, sizeof(f));
  return f;
}
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline unsigned long long __float2ull_rn(float x) {
  return static_cast<unsigned long long>(std::nearbyint(x));
}
