"""The gated MLP activations over a fused gate|up projection (``csrc/activation``):
:func:`silu_and_mul` (SwiGLU) and :func:`gelu_tanh_and_mul` (GeGLU)."""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm.ops.fake_kernels import fake_kernel

__all__ = ["gelu_tanh_and_mul", "silu_and_mul"]


def silu_and_mul(x: Tensor) -> Tensor:
    """SwiGLU's gate: ``silu(x[:, :d]) * x[:, d:]`` for a fused gate|up projection
    ``x`` ``[rows, 2 * d]`` (unit stride in the last dim), with the eager form's roundings
    (silu rounded to x's dtype before the product). Returns ``[rows, d]``."""
    return torch.ops.fastllm.silu_and_mul.default(x)


@fake_kernel("silu_and_mul")
def _silu_and_mul_fake(x):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    """GeGLU's gate (Gemma's MLP): ``gelu(x[:, :d], approximate="tanh") * x[:, d:]`` for a fused
    gate|up projection ``x`` ``[rows, 2 * d]`` (unit stride in the last dim), with the eager
    form's roundings (gelu rounded to x's dtype before the product), as :func:`silu_and_mul`.
    Returns ``[rows, d]``."""
    return torch.ops.fastllm.gelu_tanh_and_mul.default(x)


@fake_kernel("gelu_tanh_and_mul")
def _gelu_tanh_and_mul_fake(x):
    return x.new_empty((x.shape[0], x.shape[1] // 2))
