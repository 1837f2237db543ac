// The CPU linear layer's few-row kernel: each weight row streamed from memory once for all the
// activation rows, which stay in L1. linear_cpu.cpp runs it over a weight; moe_cpu.cpp over the
// chosen experts' weights in one parallel region. Every TU that includes it compiles its own
// copy (an anonymous namespace), with the build's flags.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <ATen/Parallel.h>
#include <ATen/core/ScalarType.h>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#include <immintrin.h>
#define FASTLLM_BF16_DOT 1
#endif

#include <vector>

#include "common/vec.h"
#include "common/vec_gemm.h"

namespace fastllm {
namespace {

// Up to this many activation rows the kernel below beats ATen's GEMM; past it the product is
// compute-bound and GEMM's blocking wins. Halves convert every weight vector, so they switch
// over early; bfloat16 does too without the BF16 dot-product instruction.
inline int64_t max_stream_rows(at::ScalarType dtype) {
  if (dtype == at::kFloat) return 64;
#ifdef FASTLLM_BF16_DOT
  if (dtype == at::kBFloat16) return 8;
#endif
  return 4;
}

// float32 activations with 16-bit weights convert every weight vector on each pass over the
// activation rows, so they switch to GEMM (on an upcast copy) earlier.
constexpr int64_t kMaxUpcastStreamRows = 16;

// Each weight row is read whole and in address order, for kActRows activation rows at a time:
// the hardware prefetchers follow one stream far better than the short interleaved ones that a
// tile of several rows about 1 KB apart makes, which draw less from memory.
constexpr int kActRows = 4;
// The float path asks for weights ahead of the ones it reads (as the quantized kernel does),
// into L2: a core keeps more L2 misses in flight than L1 ones, so more of the memory bandwidth
// is drawn. Rows are short (a few KiB), so it asks several rows ahead, past what the hardware
// prefetcher already fetches.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kPrefetchRows = 8;
#else
constexpr int kPrefetchRows = 16;
#endif
constexpr int kPrefetchIntoL2 = 2;  // __builtin_prefetch's locality for _MM_HINT_T1
constexpr int64_t kCacheLine = 64;

// Prefetches the `bytes` from p on into L2, a cache line at a time.
template <int64_t bytes>
inline void prefetch_lines(const void* p) {
  for (int64_t offset = 0; offset < bytes; offset += kCacheLine)
    __builtin_prefetch(static_cast<const char*>(p) + offset, 0, kPrefetchIntoL2);
}

// out[m] = dot(x[m], w) for M activation rows and one weight row, float32 sums. Vectors of the
// row alternate between two sums per activation row: one chain of dependent multiply-adds
// would bound a long row by their latency. A row's sum takes the same steps whatever M.
template <int M, typename scalar_t>
inline void dot_row(const float* x, const scalar_t* w, int64_t ldw, int64_t k_len,
                    float (&out)[M]) {
  constexpr int64_t W = VecF::size();
  VecF even[M], odd[M];
  for (int m = 0; m < M; ++m) even[m] = odd[m] = VecF(0.f);
  int64_t k = 0;
  for (; k + 2 * W <= k_len; k += 2 * W) {
    prefetch_lines<2 * W * sizeof(scalar_t)>(w + kPrefetchRows * ldw + k);
    const VecF w0 = load_as_float(w + k), w1 = load_as_float(w + k + W);
    for (int m = 0; m < M; ++m) {
      even[m] = at::vec::fmadd(VecF::loadu(x + m * k_len + k), w0, even[m]);
      odd[m] = at::vec::fmadd(VecF::loadu(x + m * k_len + k + W), w1, odd[m]);
    }
  }
  if (k + W <= k_len) {
    const VecF w0 = load_as_float(w + k);
    for (int m = 0; m < M; ++m)
      even[m] = at::vec::fmadd(VecF::loadu(x + m * k_len + k), w0, even[m]);
    k += W;
  }
  for (int m = 0; m < M; ++m) {
    float sum = at::vec::vec_reduce_all<float>(
        [](const VecF& a, const VecF& b) { return a + b; }, even[m] + odd[m]);
    // An explicit fused multiply-add: left to the compiler, the tail could be contracted
    // differently in each instantiation, and a row's result would depend on M.
    for (int64_t j = k; j < k_len; ++j) sum = std::fma(x[m * k_len + j], float(w[j]), sum);
    out[m] = sum;
  }
}

#ifdef FASTLLM_BF16_DOT
// bfloat16 activations and weights: AVX512-BF16 multiplies bf16 pairs exactly and sums them in
// float32, 32 elements (one cache line) per instruction, with no conversion of the weights.
template <int M>
inline void dot_row(const c10::BFloat16* x, const c10::BFloat16* w, int64_t ldw, int64_t k_len,
                    float (&out)[M]) {
  constexpr int64_t W = 32;
  const auto load = [](const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); };
  __m512 even[M], odd[M];
  for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 * W <= k_len; k += 2 * W) {
    prefetch_lines<2 * W * sizeof(c10::BFloat16)>(w + kPrefetchRows * ldw + k);
    const __m512bh w0 = load(w + k), w1 = load(w + k + W);
    for (int m = 0; m < M; ++m) {
      even[m] = _mm512_dpbf16_ps(even[m], load(x + m * k_len + k), w0);
      odd[m] = _mm512_dpbf16_ps(odd[m], load(x + m * k_len + k + W), w1);
    }
  }
  if (k + W <= k_len) {
    const __m512bh w0 = load(w + k);
    for (int m = 0; m < M; ++m)
      even[m] = _mm512_dpbf16_ps(even[m], load(x + m * k_len + k), w0);
    k += W;
  }
  for (int m = 0; m < M; ++m) {
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m]));
    for (int64_t j = k; j < k_len; ++j)
      sum = std::fma(float(x[m * k_len + j]), float(w[j]), sum);
    out[m] = sum;
  }
}
#endif

template <int M, typename out_t>
inline void store_row(const float (&sums)[M], const out_t* bias, out_t* y, int64_t ldy,
                      int64_t n) {
  for (int m = 0; m < M; ++m) y[m * ldy + n] = out_t(sums[m] + (bias ? float(bias[n]) : 0.f));
}

// y[rows, n] for every activation row, kActRows rows at a time: the weight row comes from
// memory for the first group and from L1 for the others.
template <typename x_t, typename w_t, typename out_t>
inline void stream_weight_row(const x_t* x, int64_t rows, const w_t* w, int64_t ldw,
                              const out_t* bias, out_t* y, int64_t ldy, int64_t n,
                              int64_t k_len) {
  int64_t m = 0;
  for (; m + kActRows <= rows; m += kActRows) {
    float sums[kActRows];
    dot_row<kActRows>(x + m * k_len, w, ldw, k_len, sums);
    store_row<kActRows>(sums, bias, y + m * ldy, ldy, n);
  }
  const x_t* xm = x + m * k_len;
  out_t* ym = y + m * ldy;
  switch (rows - m) {
    case 3: { float sums[3]; dot_row<3>(xm, w, ldw, k_len, sums);
              store_row<3>(sums, bias, ym, ldy, n); break; }
    case 2: { float sums[2]; dot_row<2>(xm, w, ldw, k_len, sums);
              store_row<2>(sums, bias, ym, ldy, n); break; }
    case 1: { float sums[1]; dot_row<1>(xm, w, ldw, k_len, sums);
              store_row<1>(sums, bias, ym, ldy, n); break; }
    default: break;
  }
}

// y[m * ldy + n] = x[m] . w[n] (+ bias[n]) for the activation rows m < rows (x dense
// [rows, k_len]) and the weight rows n in [begin, end) (w: rows ldw apart).
template <typename x_t, typename w_t, typename out_t>
inline void stream_weight_rows(const x_t* x, int64_t rows, const w_t* w, int64_t ldw,
                               const out_t* bias, out_t* y, int64_t ldy, int64_t begin,
                               int64_t end, int64_t k_len) {
  for (int64_t n = begin; n < end; ++n)
    stream_weight_row(x, rows, w + n * ldw, ldw, bias, y, ldy, n, k_len);
}

// Many activation rows against 16-bit weights (compute-bound): y[m * ldy + n] = x[m] . w[n]
// (+ bias[n]) for every row m of x and the weight rows n in [begin, end). x comes packed in
// tiles of kPanelTileRows rows (pack_row_tiles): a tile's rows are broadcast from one pointer.
// kPanelRows weight rows at a time are converted to float32 and laid out k-major, then every
// tile meets them in register tiles, k in blocks of kPanelBlockK (a block of the panel stays in
// L1); no float32 copy of the whole weight is made. Each (row, weight row) sum takes the same
// blocks of k in the same order whatever the tile, so a row's result does not depend on the
// others.
constexpr int64_t kPanelRows = 32;
constexpr int64_t kPanelBlockK = 128;
constexpr int64_t kPanelTileRows = detail::kGemmRows;

// x [rows, k_len] in tiles of kPanelTileRows rows: tile t starts at t * kPanelTileRows * k_len
// and holds x[t * kPanelTileRows + r, k] at k * h + r, h the tile's rows (fewer in the last).
inline void pack_row_tiles(const float* x, int64_t rows, int64_t k_len, float* packed) {
  const int64_t tiles = (rows + kPanelTileRows - 1) / kPanelTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t m = t * kPanelTileRows, h = std::min(kPanelTileRows, rows - m);
      at::vec::transpose_mxn<float>(x + m * k_len, k_len, packed + m * k_len, h, int(h),
                                    int(k_len));
    }
  });
}

// c[r, :] (+)= the sums over one block of k of a tile's MR rows (a: [k_len][MR]) times the
// panel's columns (b: [k_len][kPanelRows]), c's rows kPanelRows apart: the block's products
// are summed apart from c and then added to it (add), or stored.
template <int MR>
inline void panel_block(const float* a, const float* b, int64_t k_len, float* c, bool add) {
  constexpr int64_t W = VecF::size();
  constexpr int NV = detail::kGemmColVecs;
  for (int64_t n = 0; n < kPanelRows; n += NV * W) {
    VecF acc[MR][NV];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = VecF(0.f);
    for (int64_t k = 0; k < k_len; ++k) {
      VecF bv[NV];
      for (int v = 0; v < NV; ++v) bv[v] = VecF::loadu(b + k * kPanelRows + n + v * W);
      for (int r = 0; r < MR; ++r) {
        const VecF av(a[k * MR + r]);
        for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(av, bv[v], acc[r][v]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) {
        float* dst = c + r * kPanelRows + n + v * W;
        (add ? VecF::loadu(dst) + acc[r][v] : acc[r][v]).store(dst);
      }
  }
}

// panel_block for a tile of h <= MR rows.
template <int MR = kPanelTileRows>
inline void panel_block_rows(int64_t h, const float* a, const float* b, int64_t k_len, float* c,
                             bool add) {
  if constexpr (MR > 0) {
    if (h == MR)
      panel_block<MR>(a, b, k_len, c, add);
    else
      panel_block_rows<MR - 1>(h, a, b, k_len, c, add);
  }
}

template <typename w_t>
void gemm_weight_panels(const float* x_tiles, int64_t rows, int64_t k_len, const w_t* w,
                        int64_t ldw, const float* bias, float* y, int64_t ldy, int64_t begin,
                        int64_t end) {
  constexpr int64_t W = VecF::size();
  std::vector<float> converted(kPanelRows * k_len), panel(kPanelRows * k_len),
      sums(rows * kPanelRows);
  for (int64_t n0 = begin; n0 < end; n0 += kPanelRows) {
    const int64_t cols = std::min(kPanelRows, end - n0);
    for (int64_t j = 0; j < cols; ++j)
      convert_to_float(w + (n0 + j) * ldw, converted.data() + j * k_len, k_len);
    if (cols < kPanelRows) std::fill(panel.begin(), panel.end(), 0.f);
    at::vec::transpose_mxn<float>(converted.data(), k_len, panel.data(), kPanelRows, int(cols),
                                  int(k_len));
    // A tile's activation rows stay in L1 across the panel's columns. Each block's products
    // are summed apart and then added to the row's sums: a float32 sum of k_len terms in one
    // chain errs far more than ATen's GEMM.
    for (int64_t k0 = 0; k0 < k_len; k0 += kPanelBlockK) {
      const int64_t block = std::min(kPanelBlockK, k_len - k0);
      for (int64_t m = 0; m < rows; m += kPanelTileRows) {
        const int64_t h = std::min(kPanelTileRows, rows - m);
        panel_block_rows(h, x_tiles + m * k_len + k0 * h, panel.data() + k0 * kPanelRows, block,
                         sums.data() + m * kPanelRows, /*add=*/k0 > 0);
      }
    }
    for (int64_t m = 0; m < rows; ++m) {
      const float* src = sums.data() + m * kPanelRows;
      float* dst = y + m * ldy + n0;
      int64_t j = 0;
      if (cols == kPanelRows)
        for (; j < kPanelRows; j += W)
          (bias ? VecF::loadu(src + j) + VecF::loadu(bias + n0 + j) : VecF::loadu(src + j))
              .store(dst + j);
      for (; j < cols; ++j) dst[j] = src[j] + (bias ? bias[n0 + j] : 0.f);
    }
  }
}

// Weight rows per parallel task: enough that a task's weights (>= 64 KiB) dwarf its
// scheduling cost.
inline int64_t stream_grain(int64_t k_len, int64_t weight_element_bytes) {
  return std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, k_len * weight_element_bytes));
}

}  // namespace
}  // namespace fastllm
