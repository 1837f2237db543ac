// Memory for paged KV pools on the CPU.
#pragma once

#include <ATen/core/Tensor.h>

namespace fastllm {

// A zero-filled CPU tensor in memory aligned to 2 MiB and advised for transparent huge pages
// (Linux: a fresh anonymous mapping, committed page by page as it is first touched; elsewhere
// an ordinary allocation, zeroed). Paged attention reads blocks scattered over the
// whole pool: with 4 KiB pages nearly every block costs a TLB miss, with 2 MiB pages few do.
at::Tensor zeros_huge_pages(at::IntArrayRef sizes, at::ScalarType dtype);

}  // namespace fastllm
