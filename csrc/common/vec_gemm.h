// A small register-blocked float32 matrix product for the CPU kernels' tiles:
//   C[M, N] (+)= A[M, K] * B[K, N], all row-major, N a multiple of the SIMD width.
// Attention tiles are small and many; a BLAS call per tile would cost more in dispatch than
// it saves, and this keeps the kernels free of any particular BLAS.
#pragma once

#include "common/vec.h"

namespace fastllm {

namespace detail {

// Register blocking: MR rows x (NV vectors) accumulators. 12x2 zmm fills 24 of AVX-512's 32
// registers, 6x2 ymm 12 of AVX2's 16; the B panel (k_len x 2 vectors) stays in L1 across rows.
constexpr int kGemmColVecs = 2;
constexpr int kGemmRows = VecF::size() >= 16 ? 12 : 6;

template <int MR, int NV>
inline void gemm_tile(const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                      int64_t ldc, int64_t k_len, bool accumulate) {
  constexpr int64_t W = VecF::size();
  VecF acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v)
      acc[r][v] = accumulate ? VecF::loadu(c + r * ldc + v * W) : VecF(0.f);
  for (int64_t k = 0; k < k_len; ++k) {
    VecF bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = VecF::loadu(b + k * ldb + v * W);
    for (int r = 0; r < MR; ++r) {
      const VecF av(a[r * lda + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(av, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v].store(c + r * ldc + v * W);
}

// The last m_len % kGemmRows rows, with a tile of exactly that height.
template <int NV, int MR = kGemmRows - 1>
inline void gemm_row_tail(int64_t m_len, const float* a, int64_t lda, const float* b, int64_t ldb,
                          float* c, int64_t ldc, int64_t k_len, bool accumulate) {
  if constexpr (MR > 0) {
    if (m_len == MR)
      gemm_tile<MR, NV>(a, lda, b, ldb, c, ldc, k_len, accumulate);
    else
      gemm_row_tail<NV, MR - 1>(m_len, a, lda, b, ldb, c, ldc, k_len, accumulate);
  }
}

template <int NV>
inline void gemm_cols(int64_t m_len, const float* a, int64_t lda, const float* b, int64_t ldb,
                      float* c, int64_t ldc, int64_t k_len, bool accumulate) {
  int64_t m = 0;
  for (; m + kGemmRows <= m_len; m += kGemmRows)
    gemm_tile<kGemmRows, NV>(a + m * lda, lda, b, ldb, c + m * ldc, ldc, k_len, accumulate);
  gemm_row_tail<NV>(m_len - m, a + m * lda, lda, b, ldb, c + m * ldc, ldc, k_len, accumulate);
}

}  // namespace detail

// C = A * B (accumulate=false) or C += A * B (accumulate=true). n_len % VecF::size() == 0.
inline void gemm_f32(int64_t m_len, int64_t n_len, int64_t k_len, const float* a, int64_t lda,
                     const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  constexpr int64_t W = VecF::size();
  constexpr int NV = detail::kGemmColVecs;
  int64_t n = 0;
  for (; n + NV * W <= n_len; n += NV * W)
    detail::gemm_cols<NV>(m_len, a, lda, b + n, ldb, c + n, ldc, k_len, accumulate);
  for (; n < n_len; n += W)
    detail::gemm_cols<1>(m_len, a, lda, b + n, ldb, c + n, ldc, k_len, accumulate);
}

}  // namespace fastllm
