// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a
// counter-based generator, so a row's random number is a pure function of (seed, offset).
// Torch-free, for host and device code alike.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FASTLLM_HOST_DEVICE __host__ __device__
#else
#define FASTLLM_HOST_DEVICE
#endif

namespace fastllm {

// The uniform double in [0, 1) for (seed, offset): key (seed lo, seed hi), counter
// (offset lo, offset hi, 0, 0); 53 bits of the first two output words.
FASTLLM_HOST_DEVICE inline double philox_uniform(uint64_t seed, uint64_t offset) {
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  uint32_t c0 = uint32_t(offset), c1 = uint32_t(offset >> 32), c2 = 0, c3 = 0;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(0xD2511F53u) * c0, p1 = uint64_t(0xCD9E8D57u) * c2;
    const uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
    c1 = uint32_t(p1);
    c3 = uint32_t(p0);
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return (double(c0 >> 5) * 67108864.0 + double(c1 >> 6)) / 9007199254740992.0;
}

}  // namespace fastllm
