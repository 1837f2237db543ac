#include "common/batch_invariant.h"

namespace fastllm {
namespace {
thread_local bool invariant = false;
}  // namespace

bool batch_invariant() { return invariant; }

bool set_batch_invariant(bool value) {
  const bool previous = invariant;
  invariant = value;
  return previous;
}

}  // namespace fastllm
