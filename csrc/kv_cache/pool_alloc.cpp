#include "kv_cache/pool_alloc.h"

#include <cstdlib>
#include <cstring>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace fastllm {

at::Tensor zeros_huge_pages(at::IntArrayRef sizes, at::ScalarType dtype) {
  constexpr size_t kHugePage = size_t(2) << 20;
  int64_t numel = 1;
  for (const int64_t s : sizes) {
    TORCH_CHECK_VALUE(s >= 0, "zeros_huge_pages: negative size in ", sizes);
    numel *= s;
  }
  const size_t nbytes = size_t(numel) * c10::elementSize(dtype);
  const size_t rounded = (nbytes + kHugePage - 1) / kHugePage * kHugePage;
  if (rounded == 0) return at::zeros(sizes, at::TensorOptions().dtype(dtype));
  void* data = std::aligned_alloc(kHugePage, rounded);
  TORCH_CHECK(data != nullptr, "zeros_huge_pages: cannot allocate ", rounded, " bytes");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  madvise(data, rounded, MADV_HUGEPAGE);  // advice only: without THP the pages stay small
#endif
  std::memset(data, 0, nbytes);  // first touch, after the advice, so the pages come huge
  return at::from_blob(data, sizes, [](void* p) { std::free(p); },
                       at::TensorOptions().dtype(dtype).device(at::kCPU));
}

}  // namespace fastllm
