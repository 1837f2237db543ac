// Whether the CPU ops compute each row the same way whatever the other rows of the call are
// (fastllm.ops.batch_invariant()): linear and quantized_linear keep their few-row kernels for
// any number of rows instead of switching to a GEMM past a threshold, and attention gives every
// query row the same tile shape and key blocks whether it decodes alone or comes in a prefill
// chunk or a batch, with no split over the keys. A seeded request's tokens then do not depend on
// the batch, the chunking or a preemption, in every dtype; prefill is slower. Per thread, read
// by the ops on the calling thread.
#pragma once

namespace fastllm {

bool batch_invariant();
// Sets the calling thread's flag; returns its previous value.
bool set_batch_invariant(bool invariant);

}  // namespace fastllm
