"""Integer weights as quantized checkpoints store them (``w = scale * (q - zero)`` per group of
columns), and the one place they become ggml blocks (exactly) or floats.

:meth:`IntegerWeight.blocks` repacks a weight into the block format that holds its values
exactly, or gives None where none does:

- Q4_0 (``d * (q - 8)``): 4-bit integers whose zero point is 8 everywhere (symmetric int4:
  compressed-tensors' W4A16, GPTQ with ``sym``);
- Q4_1 (``d * q + m``): 4-bit integers with zero points, where every block's ``m = -scale *
  zero`` is itself an fp16 (AWQ, asymmetric GPTQ and W4A16);
- Q8_0 (``d * q``, q int8): 8-bit symmetric integers, and any integers whose ``q - zero`` fits
  an int8 (4-bit ones with zero points whose minima fp16 cannot hold).

Each needs a block's 32 values to share one scale and zero (groups a multiple of 32 columns, or
one scale per row), columns in their stored order (no activation-order ``g_idx``) and every
scale an fp16 exactly (bf16 scales are, within fp16's range; float32 ones rarely). Q4_0's and
Q8_0's ``d * q`` and Q4_1's ``d * q + m`` are then exact in float32, so the blocks decode to
``scale * (q - zero)`` bit for bit. Anything else is dequantized: ``scale * (q - zero)`` in
float32, rounded once.

The blocks hold the weights exactly; the activations are another matter on the CPU, whose
decode kernels (up to 32 rows) quantize them per 32 values on the fly: to int16 for Q4_1 and
Q8_0, to int8 for Q4_0, as llama.cpp does (:func:`fastllm.ops.quantized_linear`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from gguf import GGMLQuantizationType
from torch import Tensor

from fastllm.models.quantized import QuantizedWeight, pack_blocks
from fastllm.models.tensor_parallel import TensorSlice

__all__ = ["IntegerWeight", "column_groups", "expand_blocks", "unpack_codes"]

_BLOCK = 32  # values per ggml block of Q4_0, Q4_1 and Q8_0


@dataclass(frozen=True)
class IntegerWeight:
    """``w[r, c] = scales[r, g] * (codes[r, c] - zeros[r, g])`` with ``g = c // group`` (or
    ``group_index[c]``).

    Attributes:
        codes: uint8 ``[rows, cols]``, unsigned ``bits``-bit integers (a signed format's
            ``q + 2**(bits - 1)``, its zero point shifted alike).
        bits: 4 or 8.
        scales: ``[rows, groups]``, float32, float16 or bfloat16.
        zeros: uint8 ``[rows, groups]``; None: ``2**(bits - 1)`` everywhere (symmetric).
        group: columns per scale (``cols`` for one scale per row).
        group_index: int64 ``[cols]``, each column's group where they are not in order (GPTQ's
            activation order), else None.
    """

    codes: Tensor
    bits: int
    scales: Tensor
    zeros: Tensor | None
    group: int
    group_index: Tensor | None = None

    def part(self, part: TensorSlice | None) -> IntegerWeight:
        """Rows or columns ``[part.start, part.stop)`` (None: all); a column cut must fall on a
        group boundary (:meth:`StoredWeight.check_cut` refuses others), or anywhere with
        ``group_index``."""
        if part is None:
            return self
        if part.dim == 0:
            rows = slice(part.start, part.stop)
            return replace(self, codes=self.codes[rows], scales=self.scales[rows],
                           zeros=None if self.zeros is None else self.zeros[rows])
        columns = slice(part.start, part.stop)
        if self.group_index is not None:
            return replace(self, codes=self.codes[:, columns],
                           group_index=self.group_index[columns])
        groups = slice(part.start // self.group, -(-part.stop // self.group))
        return replace(self, codes=self.codes[:, columns], scales=self.scales[:, groups],
                       zeros=None if self.zeros is None else self.zeros[:, groups])

    def dequantize(self) -> Tensor:
        """float32 ``[rows, cols]``: ``scale * (q - zero)`` rounded once (an integer
        difference times the scale)."""
        index = self._column_groups(torch.arange(self.codes.shape[1]))
        zeros = (torch.full_like(self.scales, 1 << (self.bits - 1), dtype=torch.int16)
                 if self.zeros is None else self.zeros.to(torch.int16))
        centered = self.codes.to(torch.int16) - zeros[:, index]
        return centered.to(torch.float32) * self.scales[:, index].to(torch.float32)

    def blocks(self) -> QuantizedWeight | None:
        """The weight as the ggml blocks that hold its values exactly (see the module's
        docstring for which), or None where no block format does."""
        rows, cols = self.codes.shape
        if (self.group_index is not None or cols % _BLOCK
                or (self.group % _BLOCK and self.scales.shape[1] > 1)):
            return None
        index = self._column_groups(torch.arange(0, cols, _BLOCK))  # each block's group
        scales = self.scales[:, index]  # [rows, blocks]
        d = scales.to(torch.float16)
        if not torch.equal(d.to(scales.dtype), scales):  # not fp16 exactly (or not finite)
            return None
        codes = self.codes.view(rows, -1, _BLOCK)  # [rows, blocks, 32]
        if self.bits == 4 and (self.zeros is None or bool((self.zeros[:, index] == 8).all())):
            return pack_blocks(GGMLQuantizationType.Q4_0, d, codes)
        zeros = (torch.full(d.shape, 1 << (self.bits - 1), dtype=torch.int16)
                 if self.zeros is None else self.zeros[:, index].to(torch.int16))
        if self.bits == 4:
            minima = -(zeros.to(torch.float64) * scales.to(torch.float64))  # exact in float64
            m = minima.to(torch.float16)
            if torch.equal(m.to(torch.float64), minima):
                return pack_blocks(GGMLQuantizationType.Q4_1, d, codes, m)
        centered = codes.to(torch.int16) - zeros.unsqueeze(-1)
        if int(centered.min()) >= -128 and int(centered.max()) <= 127:
            return pack_blocks(GGMLQuantizationType.Q8_0, d, centered.to(torch.int8))
        return None

    def _column_groups(self, columns: Tensor) -> Tensor:
        """The group of each of ``columns``."""
        if self.group_index is not None:
            return self.group_index[columns]
        return columns // self.group


def unpack_codes(packed: Tensor, bits: int, count: int) -> Tensor:
    """``count`` unsigned ``bits``-bit integers (4 or 8) a row from int32 words ``packed``
    ``[rows, words]`` that hold them in order from the least significant bits (integer ``j``
    in bits ``bits * (j % (32 // bits))`` onwards of word ``j // (32 // bits)``): uint8 ``[rows,
    count]``. The layout of compressed-tensors' ``pack_to_int32`` and of GPTQ, along their
    packed dimension; AWQ's words hold its integers in another order."""
    data = packed.contiguous().view(torch.uint8)  # little-endian: least significant byte first
    if bits == 4:
        data = torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2)
    return data[:, :count]


def expand_blocks(scales: Tensor, block: tuple[int, int], rows: int, cols: int) -> Tensor:
    """Per-block values (one per ``block = (rows, cols)`` of a ``[rows, cols]`` weight,
    ``[ceil(rows / block rows), ceil(cols / block cols)]``) repeated over their blocks:
    ``[rows, cols]``."""
    return (scales.repeat_interleave(block[0], dim=0)[:rows]
            .repeat_interleave(block[1], dim=1)[:, :cols])


def column_groups(g_idx: Tensor, cols: int, group: int, groups: int,
                  name: str) -> Tensor | None:
    """Each column's group as a checkpoint's ``g_idx`` gives it (GPTQ's activation order), for
    :attr:`IntegerWeight.group_index`: None where it is the columns' own order (``c // group``).
    A group outside ``[0, groups)`` is a ValueError naming tensor ``name``."""
    g_idx = g_idx.to(torch.int64)
    if torch.equal(g_idx, torch.arange(cols) // group):
        return None
    if g_idx.numel() and not (0 <= int(g_idx.min()) and int(g_idx.max()) < groups):
        raise ValueError(f"tensor {name} holds groups outside [0, {groups})")
    return g_idx
