// Memory in transparent huge pages on the CPU: the paged KV pools, and the arena of the weight
// blocks written at load (fastllm.models.build).
#pragma once

#include <ATen/core/Tensor.h>

namespace fastllm {

// A zero-filled CPU tensor in memory aligned to 2 MiB and advised for transparent huge pages
// (Linux: a fresh anonymous mapping, committed page by page as it is first touched; elsewhere
// an ordinary allocation, zeroed). Paged attention reads blocks scattered over the
// whole pool, and a decode step streams every weight: with 4 KiB pages nearly every block, and
// every 4 KiB of weights, costs a TLB miss; with 2 MiB pages few do.
at::Tensor zeros_huge_pages(at::IntArrayRef sizes, at::ScalarType dtype);

}  // namespace fastllm
