// Whether the caller vouches for the index values it passes (block tables, slots, cu_seqlens,
// positions, sampling parameters). Checking them costs nothing on the CPU, which always does;
// on a GPU it means copying them to the host and waiting for the device, so GPU ops skip those
// checks inside fastllm.ops.trusted_inputs() (the engine builds and checks its metadata on the
// host first). Kernels never read or write out of bounds either way. Per thread.
#pragma once

namespace fastllm {

bool trusted_inputs();
// Sets the calling thread's flag; returns its previous value.
bool set_trusted_inputs(bool trusted);

}  // namespace fastllm
