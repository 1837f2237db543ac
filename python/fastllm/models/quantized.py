"""Weights kept block-quantized (ggml's formats, :data:`fastllm.ops.BLOCK_FORMATS`) in the
model: a linear layer and an embedding whose weight is the file's blocks, row by row, run by
:func:`fastllm.ops.quantized_linear` and :func:`fastllm.ops.dequantize`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fastllm import ops

__all__ = ["QuantizedEmbedding", "QuantizedLinear", "QuantizedWeight"]


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight as blocks: ``data`` uint8 ``[rows, row bytes]`` of ggml type ``weight_type``."""

    data: Tensor
    weight_type: int

    @property
    def shape(self) -> tuple[int, int]:
        """The float weight's shape, ``(rows, values per row)``."""
        _, values, block_bytes = ops.BLOCK_FORMATS[self.weight_type]
        return self.data.shape[0], self.data.shape[1] // block_bytes * values


class QuantizedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` block-quantized (``weight``: uint8 ``[out, row bytes]``)."""

    def __init__(self, weight: Tensor, weight_type: int, bias: Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.weight_type = weight_type
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return ops.quantized_linear(x, self.weight, self.weight_type, self.bias)

    def extra_repr(self) -> str:
        name, _, _ = ops.BLOCK_FORMATS[self.weight_type]
        rows, values = QuantizedWeight(self.weight, self.weight_type).shape
        return f"{name}, in_features={values}, out_features={rows}, bias={self.bias is not None}"


class QuantizedEmbedding(nn.Module):
    """An embedding table kept block-quantized: looked-up rows are dequantized to ``dtype``."""

    def __init__(self, weight: Tensor, weight_type: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.weight_type = weight_type
        self.dtype = dtype

    def forward(self, input_ids: Tensor) -> Tensor:
        return ops.dequantize(self.weight[input_ids], self.weight_type, self.dtype)
