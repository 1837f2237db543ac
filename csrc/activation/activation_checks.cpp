#include "activation/activation.h"

#include "common/checks.h"

namespace fastllm {

int64_t check_gated_activation_inputs(const at::Tensor& x) {
  check_rank(x, 2, "x", "[rows, 2 * d] (gate | up)");
  check_float_storage(x, "x");
  TORCH_CHECK_VALUE(x.size(1) % 2 == 0, "x's last dim must be even (gate | up halves), got ",
                    x.size(1));
  TORCH_CHECK_VALUE(x.size(1) <= 1 || x.stride(1) == 1, "x's last dim must be contiguous, got "
                    "strides ", x.strides());
  return x.size(1) / 2;
}

}  // namespace fastllm
