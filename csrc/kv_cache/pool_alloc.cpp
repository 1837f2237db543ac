#include "kv_cache/pool_alloc.h"

#include <cstdint>
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
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // Fresh anonymous pages are zero and cost nothing until touched: the pool is committed as
  // sequences fill it, not at load (zeroing a pool of gigabytes would slow the load).
  // The mapping is padded to align the pool to a huge page, and advised before any touch, so
  // the pages come huge when they are first written.
  const size_t mapped = rounded + kHugePage;
  void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(base != MAP_FAILED, "zeros_huge_pages: cannot map ", mapped, " bytes");
  const uintptr_t start = reinterpret_cast<uintptr_t>(base);
  void* data = reinterpret_cast<void*>((start + kHugePage - 1) / kHugePage * kHugePage);
  madvise(data, rounded, MADV_HUGEPAGE);  // advice only: without THP the pages stay small
  return at::from_blob(data, sizes, [base, mapped](void*) { munmap(base, mapped); },
                       at::TensorOptions().dtype(dtype).device(at::kCPU));
#else
  void* data = std::aligned_alloc(kHugePage, rounded);
  TORCH_CHECK(data != nullptr, "zeros_huge_pages: cannot allocate ", rounded, " bytes");
  std::memset(data, 0, nbytes);
  return at::from_blob(data, sizes, [](void* p) { std::free(p); },
                       at::TensorOptions().dtype(dtype).device(at::kCPU));
#endif
}

}  // namespace fastllm
