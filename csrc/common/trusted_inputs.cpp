#include "common/trusted_inputs.h"

namespace fastllm {
namespace {
thread_local bool trusted = false;
}  // namespace

bool trusted_inputs() { return trusted; }

bool set_trusted_inputs(bool value) {
  const bool previous = trusted;
  trusted = value;
  return previous;
}

}  // namespace fastllm
