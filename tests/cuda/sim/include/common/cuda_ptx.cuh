// The simulator's csrc/common/cuda_ptx.cuh: the same functions, done on the CPU as the PTX ISA
// describes them. Shared-memory "addresses" are byte offsets into the block's dynamic shared
// memory, the only shared memory the kernels copy into or load fragments from.
#pragma once

#include <cstdint>
#include <cstring>

#include "cuda_sim.h"

namespace fastllm {
namespace cuda {

inline unsigned char* dynamic_shared_memory() { return ::cuda_sim::dynamic_shared_memory(); }

inline uint32_t smem_address(const void* p) {
  const auto* byte = static_cast<const unsigned char*>(p);
  const unsigned char* base = ::cuda_sim::dynamic_shared_memory();
  if (byte < base || byte > base + ::cuda_sim::dynamic_shared_memory_bytes())
    ::cuda_sim::fail("smem_address of a pointer outside the dynamic shared memory");
  return uint32_t(byte - base);
}

inline void cp_async_16(uint32_t dst, const void* src, bool fill) {
  ::cuda_sim::cp_async_16(dst, src, fill);
}
inline void cp_async_commit() { ::cuda_sim::cp_async_commit(); }
template <int kPending>
void cp_async_wait() {
  ::cuda_sim::cp_async_wait(kPending);
}
inline void cp_async_wait_all() { ::cuda_sim::cp_async_wait(-1); }

namespace sim_detail {

// The 16-bit element at byte offset `offset` of shared memory (checked against its size).
inline uint16_t shared_b16(uint32_t offset) {
  if (offset % 2 != 0 || offset + 2 > ::cuda_sim::dynamic_shared_memory_bytes())
    ::cuda_sim::fail("ldmatrix reads outside the dynamic shared memory or misaligned");
  uint16_t v;
  std::memcpy(&v, ::cuda_sim::dynamic_shared_memory() + offset, 2);
  return v;
}

// ldmatrix .m8n8.x4: lanes 8i..8i+7 address the rows of matrix i (16-byte aligned). Lane t gets,
// of each matrix, row t/4's elements 2(t%4), 2(t%4)+1; transposed, column t/4's elements at rows
// 2(t%4), 2(t%4)+1. The lower element goes in the lower 16 bits.
inline void ldmatrix(uint32_t (&r)[4], uint32_t address, bool transpose) {
  const unsigned char* all = ::cuda_sim::warp_exchange(0xffffffffu, &address, sizeof(address),
                                                       transpose ? "ldmatrix.trans" : "ldmatrix");
  uint32_t rows[32];
  for (int l = 0; l < 32; ++l) {
    std::memcpy(&rows[l], all + l * ::cuda_sim::kLaneBytes, sizeof(uint32_t));
    if (rows[l] % 16 != 0) ::cuda_sim::fail("ldmatrix row address not 16-byte aligned");
  }
  const int t = ::cuda_sim::lane();
  for (int i = 0; i < 4; ++i) {
    uint16_t lo, hi;
    if (transpose) {
      lo = shared_b16(rows[8 * i + 2 * (t % 4)] + 2 * (t / 4));
      hi = shared_b16(rows[8 * i + 2 * (t % 4) + 1] + 2 * (t / 4));
    } else {
      lo = shared_b16(rows[8 * i + t / 4] + 4 * (t % 4));
      hi = shared_b16(rows[8 * i + t / 4] + 4 * (t % 4) + 2);
    }
    r[i] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
  ::cuda_sim::warp_done(0xffffffffu);
}

template <typename scalar_t>
float b16_to_float(uint16_t bits) {
  if constexpr (std::is_same_v<scalar_t, __half>) {
    __half_raw raw;
    raw.x = bits;
    return __half2float(__half(raw));
  } else {
    __nv_bfloat16_raw raw;
    raw.x = bits;
    return __bfloat162float(__nv_bfloat16(raw));
  }
}

struct MmaOperands {
  uint32_t a[4];
  uint32_t b[2];
};

}  // namespace sim_detail

inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  sim_detail::ldmatrix(r, address, false);
}
inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  sim_detail::ldmatrix(r, address, true);
}

// mma.m16n8k16 .row.col, float32 accumulators. With g = lane / 4 and q = lane % 4: A's registers
// hold (row g, cols 2q..2q+1), (row g+8, same), (row g, cols 2q+8..), (row g+8, cols 2q+8..);
// B's hold (rows 2q..2q+1, col g) and (rows 2q+8.., col g); C's (row g, cols 2q..2q+1) and
// (row g+8, same).
template <typename scalar_t>
void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  using sim_detail::b16_to_float;
  const sim_detail::MmaOperands mine{{a[0], a[1], a[2], a[3]}, {b0, b1}};
  const unsigned char* all =
      ::cuda_sim::warp_exchange(0xffffffffu, &mine, sizeof(mine), "mma.m16n8k16");
  sim_detail::MmaOperands lanes[32];
  for (int l = 0; l < 32; ++l)
    std::memcpy(&lanes[l], all + l * ::cuda_sim::kLaneBytes, sizeof(sim_detail::MmaOperands));
  ::cuda_sim::warp_done(0xffffffffu);
  auto half_of = [](uint32_t reg, int k) { return uint16_t(k % 2 == 0 ? reg : reg >> 16); };
  auto a_at = [&](int row, int k) {
    const auto& l = lanes[(row % 8) * 4 + (k % 8) / 2];
    return b16_to_float<scalar_t>(half_of(l.a[(row / 8) + 2 * (k / 8)], k));
  };
  auto b_at = [&](int k, int col) {
    const auto& l = lanes[col * 4 + (k % 8) / 2];
    return b16_to_float<scalar_t>(half_of(l.b[k / 8], k));
  };
  const int g = ::cuda_sim::lane() / 4, q = ::cuda_sim::lane() % 4;
  for (int j = 0; j < 4; ++j) {
    const int row = g + 8 * (j / 2), col = 2 * q + j % 2;
    float sum = c[j];
    for (int k = 0; k < 16; ++k) sum += a_at(row, k) * b_at(k, col);
    c[j] = sum;
  }
}

// ex2.approx.ftz: 2^x, subnormal results flushed to zero.
inline float fast_exp2(float x) {
  const float y = std::exp2(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y;
}

}  // namespace cuda
}  // namespace fastllm
