"""The float projection op, :func:`linear` (``csrc/linear``); block-quantized weights run
through :mod:`fastllm.ops.quantized_ops`."""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm.ops.fake_kernels import check_one_device, fake_kernel

__all__ = ["linear"]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias``: ``torch.nn.functional.linear`` for 2-D inputs.

    Args:
        x: ``[rows, in_features]``.
        weight: ``[out_features, in_features]`` with contiguous rows (an ``nn.Linear`` weight),
            on x's device, in x's dtype; or, under float32 ``x``, in bfloat16 or float16
            (weights stored in 16 bits, converted exactly as they are read).
        bias: ``[out_features]`` or None.

    Returns ``[rows, out_features]`` in x's dtype, summed in float32. On the CPU, few rows (a
    decode step: up to 64 in float32, 8 in bfloat16, 4 in float16) run a kernel that streams
    each weight row from memory once, near the memory bandwidth; more rows use ATen's GEMM.
    """
    return torch.ops.fastllm.linear.default(x, weight, bias)


@fake_kernel("linear")
def _linear_fake(x, weight, bias=None):
    check_one_device(x=x, weight=weight, bias=bias)
    return x.new_empty((x.shape[0], weight.shape[0]))
