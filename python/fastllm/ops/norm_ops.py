"""RMSNorm (``csrc/norm``): :func:`rms_norm` and the residual step :func:`add_rms_norm`."""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm.ops.fake_kernels import check_one_device, fake_kernel

__all__ = ["add_rms_norm", "rms_norm"]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's RMSNorm: ``weight * (x * rsqrt(mean(x**2, -1) + eps))``, normalized in float32,
    rounded to x's dtype, then scaled by ``weight`` in that dtype.

    Args:
        x: ``[..., hidden]`` (at most 3-D, e.g. ``[tokens, heads, head_dim]`` for q/k norms),
            float32 / bfloat16 / float16, unit stride in the last dim (other strides free: a
            strided view of a fused projection needs no copy).
        weight: ``[hidden]``, x's dtype and device.
        eps: added to the mean square, finite and >= 0.

    Returns a new contiguous tensor of x's shape. Each row is computed on its own (same bits
    alone or in a batch).
    """
    return torch.ops.fastllm.rms_norm.default(x, weight, eps)


@fake_kernel("rms_norm")
def _rms_norm_fake(x, weight, eps):
    check_one_device(x=x, weight=weight)
    return x.new_empty(x.shape)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """A pre-norm block's residual step, in place: ``residual += x`` (rounded to the dtype, as
    the eager ``x + residual``), then ``x = rms_norm(residual, weight, eps)``.

    Args:
        x: contiguous ``[rows, hidden]``: a sublayer's output in, the next sublayer's normalized
            input out.
        residual: contiguous, x's shape, dtype and device, sharing no memory with x: the
            residual stream, updated in place.
        weight: ``[hidden]``; eps as in :func:`rms_norm`.
    """
    torch.ops.fastllm.add_rms_norm.default(x, residual, weight, eps)


@fake_kernel("add_rms_norm")
def _add_rms_norm_fake(x, residual, weight, eps):
    check_one_device(x=x, residual=residual, weight=weight)
