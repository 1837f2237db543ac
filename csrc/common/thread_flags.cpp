// The per-thread flags the ops read on the calling thread: trusted inputs
// (common/trusted_inputs.h) and batch invariance (common/batch_invariant.h).
#include "common/batch_invariant.h"
#include "common/trusted_inputs.h"

namespace fastllm {
namespace {
thread_local bool trusted = false;
thread_local bool invariant = false;

bool exchange(bool& flag, bool value) {
  const bool previous = flag;
  flag = value;
  return previous;
}
}  // namespace

bool trusted_inputs() { return trusted; }
bool set_trusted_inputs(bool value) { return exchange(trusted, value); }

bool batch_invariant() { return invariant; }
bool set_batch_invariant(bool value) { return exchange(invariant, value); }

}  // namespace fastllm
