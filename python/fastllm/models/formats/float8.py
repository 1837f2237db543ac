"""FP8 weights as checkpoints store them (float8_e4m3fn codes times a scale per block of rows
and columns), and the one place they become fastllm's FP8 blocks or floats.

:meth:`FP8Weight.blocks` repacks a weight into :data:`fastllm.ops.FP8_E4M3` blocks (a float32
scale and 32 codes, :func:`fastllm.models.quantized.pack_fp8`) wherever each 32 consecutive
columns of a row share a scale: per-tensor and per-channel scales, and blocks or groups of a
multiple of 32 columns, on rows of a multiple of 32 values. The blocks hold the checkpoint's
values exactly (a float32 holds any float32, bfloat16 or float16 scale), at 9 bits a value.
Anything else is dequantized: ``code * scale`` in float32, rounded once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor

from fastllm.models.formats.integers import expand_blocks
from fastllm.models.quantized import QuantizedWeight, pack_fp8
from fastllm.models.tensor_parallel import TensorSlice

__all__ = ["FP8Weight"]

_BLOCK = 32  # values per FP8 block


@dataclass(frozen=True)
class FP8Weight:
    """``w[r, c] = codes[r, c] * scales[r // block[0], c // block[1]]``.

    Attributes:
        codes: float8_e4m3fn ``[rows, cols]``.
        scales: ``[ceil(rows / block[0]), ceil(cols / block[1])]``, float32, float16 or
            bfloat16.
        block: the ``(rows, cols)`` one scale covers.
        name: the codes' checkpoint tensor, for messages.
    """

    codes: Tensor
    scales: Tensor
    block: tuple[int, int]
    name: str

    def part(self, part: TensorSlice | None) -> FP8Weight:
        """Rows or columns ``[part.start, part.stop)`` (None: all); a column cut must fall on a
        block boundary unless one block spans the columns (:meth:`StoredWeight.check_cut`
        refuses others). A row cut may fall anywhere: the scales are first repeated over the
        rows."""
        if part is None:
            return self
        if part.dim == 0:
            rows = self.scales.repeat_interleave(self.block[0], dim=0)[:self.codes.shape[0]]
            return replace(self, codes=self.codes[part.start:part.stop],
                           scales=rows[part.start:part.stop], block=(1, self.block[1]))
        columns = self.block[1]
        return replace(self, codes=self.codes[:, part.start:part.stop],
                       scales=self.scales[:, part.start // columns:-(-part.stop // columns)])

    def dequantize(self) -> Tensor:
        """float32 ``[rows, cols]``: ``code * scale``, rounded once."""
        rows, cols = self.codes.shape
        return self.codes.float() * expand_blocks(self.scales.float(), self.block, rows, cols)

    def blocks(self) -> QuantizedWeight | None:
        """The weight as FP8 blocks (see the module's docstring for when), else None. A NaN
        code is a ValueError naming the tensor."""
        cols = self.codes.shape[1]
        if cols % _BLOCK or (self.block[1] % _BLOCK and self.block[1] < cols):
            return None
        try:
            return pack_fp8(self.codes.contiguous(), self.scales, self.block)
        except ValueError as error:
            raise ValueError(f"tensor {self.name}: {error}") from error
