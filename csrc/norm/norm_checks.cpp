#include <ATen/MemoryOverlap.h>

#include "common/checks.h"
#include "norm/norm.h"

namespace fastllm {

void check_rms_norm_inputs(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.dim() <= 3, "x must be [rows, hidden] (or [tokens, heads, "
                    "head_dim]), got shape ", x.sizes());
  check_float_storage(x, "x");
  check_rank(weight, 1, "weight", "[hidden]");
  check_same_dtype(weight, "weight", x, "x");
  check_same_device(weight, "weight", x, "x");
  TORCH_CHECK_VALUE(weight.size(0) == x.size(-1), "weight has ", weight.size(0),
                    " elements but x's last dim is ", x.size(-1));
  TORCH_CHECK_VALUE(x.size(-1) == 1 || x.stride(-1) == 1,
                    "x's last dim must be contiguous, got strides ", x.strides());
  TORCH_CHECK_VALUE(eps >= 0 && std::isfinite(eps), "eps must be finite and >= 0, got ", eps);
}

void check_add_rms_norm_inputs(const at::Tensor& x, const at::Tensor& residual,
                               const at::Tensor& weight, double eps) {
  check_rms_norm_inputs(x, weight, eps);
  check_same_dtype(residual, "residual", x, "x");
  check_same_device(residual, "residual", x, "x");
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes(), "residual has shape ", residual.sizes(),
                    " but x has shape ", x.sizes());
  TORCH_CHECK_VALUE(x.is_contiguous() && residual.is_contiguous(),
                    "x and residual must be contiguous (both are written in place)");
  TORCH_CHECK_VALUE(at::get_overlap_status(x, residual) == at::MemOverlapStatus::No,
                    "x and residual must not share memory (both are written in place)");
}

}  // namespace fastllm
