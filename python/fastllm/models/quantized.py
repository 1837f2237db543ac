"""Weights kept block-quantized (ggml's formats, :data:`fastllm.ops.BLOCK_FORMATS`, and
fastllm's FP8 blocks, :data:`fastllm.ops.FP8_E4M3`) in the model: a linear layer and an
embedding whose weight is the blocks, row by row, run by :func:`fastllm.ops.quantized_linear`
and :func:`fastllm.ops.dequantize`; :func:`quantize_weight`, which writes float weights as Q8_0
or Q4_1 blocks (``load_model(..., quantization="int8" | "int4")``); and the packers of fields a
quantized checkpoint already holds exactly, :func:`pack_blocks` and :func:`pack_fp8`.

The quantizer lives here rather than in :mod:`fastllm.ops`: it is a load-time transform in
plain PyTorch, not a device op, and its output is a :class:`QuantizedWeight`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import Tensor, nn

from fastllm import ops

__all__ = ["QUANTIZATIONS", "QuantizedEmbedding", "QuantizedLinear", "QuantizedWeight",
           "Quantization", "SegmentedQuantizedLinear", "check_quantization", "pack_blocks",
           "pack_fp8", "quantize_weight"]


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight as blocks: ``data`` uint8 ``[rows, row bytes]`` of ggml type ``weight_type``."""

    data: Tensor
    weight_type: int

    @property
    def shape(self) -> tuple[int, int]:
        """The float weight's shape, ``(rows, values per row)``."""
        _, values, block_bytes = ops.block_format(self.weight_type)
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

    def projection_parts(self) -> list[ops.ProjectionPart]:
        """This layer as :class:`fastllm.ops.DecoderLayers` runs it."""
        return [ops.ProjectionPart(self.weight, self.weight_type, self.bias)]

    def extra_repr(self) -> str:
        name, _, _ = ops.block_format(self.weight_type)
        rows, values = QuantizedWeight(self.weight, self.weight_type).shape
        return f"{name}, in_features={values}, out_features={rows}, bias={self.bias is not None}"


class SegmentedQuantizedLinear(nn.Module):
    """A fused projection whose parts are blocks of different formats (a Q4_K_M file keeps
    ``attn_v`` in Q6_K beside Q4_K q and k): each run of output rows in one format is its own
    buffer (``segment0``, ``segment1``, ...) and :func:`fastllm.ops.quantized_linear` call, the
    outputs side by side, so every part streams in its own bits."""

    def __init__(self, segments: list[tuple[Tensor, int]], bias: Tensor | None = None) -> None:
        super().__init__()
        for i, (weight, _) in enumerate(segments):
            self.register_buffer(f"segment{i}", weight)
        self.weight_types = tuple(weight_type for _, weight_type in segments)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([ops.quantized_linear(x, part.weight, part.weight_type, part.bias)
                          for part in self.projection_parts()], dim=1)

    def projection_parts(self) -> list[ops.ProjectionPart]:
        """This layer as :class:`fastllm.ops.DecoderLayers` runs it: a part per segment."""
        parts, start = [], 0
        for i, weight_type in enumerate(self.weight_types):
            weight = getattr(self, f"segment{i}")
            bias = None if self.bias is None else self.bias[start:start + weight.shape[0]]
            parts.append(ops.ProjectionPart(weight, weight_type, bias))
            start += weight.shape[0]
        return parts

    def extra_repr(self) -> str:
        return ", ".join(f"{ops.block_format(t)[0]} x {getattr(self, f'segment{i}').shape[0]}"
                         for i, t in enumerate(self.weight_types))


class QuantizedEmbedding(nn.Module):
    """An embedding table kept block-quantized: looked-up rows are dequantized to ``dtype``. A
    table that is also the LM head may be in the CPU's interleaved layout
    (:func:`fastllm.ops.cpu_decode_layout`)."""

    def __init__(self, weight: Tensor, weight_type: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.weight_type = weight_type
        self.dtype = dtype

    def forward(self, input_ids: Tensor) -> Tensor:
        return ops.dequantize(*ops.quantized_rows(self.weight, self.weight_type, input_ids),
                              self.dtype)


@dataclass(frozen=True)
class Quantization:
    """The ggml block formats a ``quantization=`` choice writes: one for the projections (and an
    untied input embedding), one for the LM head (the tied embedding when there is no head).

    As in llama.cpp's own 4-bit files, the head keeps 8 bits: its errors go straight into the
    logits, and it is read once per token, not once per layer.
    """

    projections: int
    head: int


# quantization= value -> the formats it writes. Q4_1 (a scale and a minimum per block) rather
# than Q4_0 (a scale only): it costs 5 bits per weight instead of 4.5 and rounds real weights
# more closely (tests/models/test_quantize.py measures both).
QUANTIZATIONS = {
    "int8": Quantization(projections=GGMLQuantizationType.Q8_0, head=GGMLQuantizationType.Q8_0),
    "int4": Quantization(projections=GGMLQuantizationType.Q4_1, head=GGMLQuantizationType.Q8_0),
}


def check_quantization(quantization: str | None) -> Quantization | None:
    """The :class:`Quantization` named by ``quantization`` ("int8", "int4"), or None for None."""
    if quantization is None:
        return None
    if not isinstance(quantization, str) or quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None, {' or '.join(map(repr, QUANTIZATIONS))}, "
                         f"got {quantization!r}")
    return QUANTIZATIONS[quantization]


# Float values quantized per call: bounds the float32 temporaries (a few of this size) whatever
# the matrix, and keeps them in cache.
_CHUNK_VALUES = 1 << 20


def quantize_weight(weight: Tensor, weight_type: int) -> QuantizedWeight:
    """``weight`` (``[rows, values per row]``, any float dtype) as ggml blocks of ``weight_type``:
    Q8_0 (8) or Q4_1 (3), byte for byte as ``gguf.quants.quantize`` writes them (which follows
    ggml's reference quantizers, ``quantize_row_q8_0_ref`` and ``quantize_row_q4_1_ref``).

    Values are rounded in float32 as ggml rounds them (Q8_0: to nearest, ties away from zero;
    Q4_1: ``trunc(x + 0.5)``), scaled by the block's float32 scale, which is then stored in fp16.
    A block so small that the reciprocal of its scale overflows float32 (absolute maximum below
    about 4e-37) has an fp16 scale of 0, so it decodes to zeros (Q8_0) or its minimum (Q4_1)
    whatever its quants hold; ggml leaves those quants undefined, here they are clamped. A Q4_1
    block whose minimum is zero, among ``-0.0`` and ``0.0``, may store either sign (a min
    reduction's pick is unspecified: ggml's C loop keeps the first, numpy the last); both decode
    the same. The row length must be a multiple of 32. A block whose fp16 fields would overflow (Q8_0: ``|w|``
    above about ``127 * 65504``; Q4_1: a minimum beyond about ``±65504`` or a range above about
    ``15 * 65504``), or that holds a non-finite value, is a ``ValueError``.
    """
    if weight_type not in _QUANTIZERS:
        names = ", ".join(f"{GGMLQuantizationType(t).name} ({t})" for t in _QUANTIZERS)
        raise ValueError(f"weight_type must be one of {names}, got {weight_type!r}")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D float tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(weight_type)]
    rows, values = weight.shape
    if values == 0 or values % block_values:
        raise ValueError(f"a {GGMLQuantizationType(weight_type).name} weight's rows must hold a "
                         f"positive multiple of {block_values} values, got {values}")
    n_blocks = values // block_values
    data = torch.empty(rows, n_blocks, block_bytes, dtype=torch.uint8, device=weight.device)
    step = max(1, _CHUNK_VALUES // values)
    for start in range(0, rows, step):
        blocks = weight[start:start + step].to(torch.float32).reshape(-1, n_blocks, block_values)
        _QUANTIZERS[weight_type](blocks, data[start:start + step])
    return QuantizedWeight(data.reshape(rows, n_blocks * block_bytes), int(weight_type))


def _quantize_q8_0(blocks: Tensor, out: Tensor) -> None:
    """Q8_0: an fp16 scale ``d = amax / 127``, then 32 int8 ``round(x / d)``. blocks float32
    ``[rows, n, 32]`` -> out uint8 ``[rows, n, 34]``."""
    d = blocks.abs().amax(-1, keepdim=True) / 127  # [rows, n, 1]
    inverse = torch.where(d == 0, 0.0, 1 / d)
    quants = _round_half_away(blocks * inverse).nan_to_num_(0.0).clamp_(-127, 127)
    _write_blocks(out, _fp16(d, blocks), quants.to(torch.int8))


def _quantize_q4_1(blocks: Tensor, out: Tensor) -> None:
    """Q4_1: fp16 ``d = (max - min) / 15`` and ``m = min``, then 32 nibbles
    ``trunc((x - min) / d + 0.5)``: values 0-15 in the low nibbles, 16-31 in the high ones.
    blocks float32 ``[rows, n, 32]`` -> out uint8 ``[rows, n, 20]``."""
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)  # [rows, n, 1]
    d = (high - low) / 15
    inverse = torch.where(d == 0, 0.0, 1 / d)
    quants = ((blocks - low).mul_(inverse).add_(0.5).trunc_()
              .nan_to_num_(0.0).clamp_(0, 15).to(torch.uint8))  # [rows, n, 32]
    _write_blocks(out, _fp16(d, blocks), quants, _fp16(low, blocks))


_QUANTIZERS = {GGMLQuantizationType.Q8_0: _quantize_q8_0,
               GGMLQuantizationType.Q4_1: _quantize_q4_1}


def pack_blocks(weight_type: int, d: Tensor, quants: Tensor,
                m: Tensor | None = None) -> QuantizedWeight:
    """ggml blocks of Q4_0 (2), Q4_1 (3) or Q8_0 (8) from fields already known exactly (a
    quantized checkpoint's integers and scales; :mod:`fastllm.models.formats`): ``d`` (and
    Q4_1's minimum ``m``) float16 ``[rows, n]``, one per block of 32 values; ``quants``
    ``[rows, n, 32]``, Q8_0's int8 values or Q4_0's and Q4_1's 4-bit integers (0-15, uint8).
    Returns ``[rows, n * block bytes]`` blocks, laid out as :func:`quantize_weight` writes
    them."""
    block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(weight_type)][1]
    rows, n, _ = quants.shape
    out = torch.empty(rows, n, block_bytes, dtype=torch.uint8, device=quants.device)
    _write_blocks(out, d.unsqueeze(-1), quants, None if m is None else m.unsqueeze(-1))
    return QuantizedWeight(out.view(rows, n * block_bytes), int(weight_type))


# Values per FP8 block (ops.FP8_E4M3): a float32 scale and 32 codes, 36 bytes.
_FP8_BLOCK_VALUES = 32
_FP8_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def pack_fp8(weight: Tensor, scales: Tensor, block: tuple[int, int]) -> QuantizedWeight:
    """fastllm's FP8 blocks (:data:`fastllm.ops.FP8_E4M3`) of an FP8 checkpoint's weight, which
    they hold exactly.

    Args:
        weight: float8_e4m3fn ``[rows, cols]``, ``cols`` a multiple of 32, no NaN codes.
        scales: float32, bfloat16 or float16, one per ``block`` of the weight:
            ``[ceil(rows / block rows), ceil(cols / block cols)]``; value ``weight * scale``.
        block: ``(block rows, block cols)`` one scale covers: ``(rows, cols)`` per tensor,
            ``(1, cols)`` per channel, ``(128, 128)`` DeepSeek's blocks. Every 32 consecutive
            columns must share a scale: ``block cols`` a multiple of 32, or at least ``cols``.

    Returns uint8 ``[rows, cols / 32 * 36]``: per 32 values of a row, their scale as a
    little-endian float32, then their 32 codes. A TypeError names a wrong dtype, a ValueError
    a wrong shape or a NaN code (its row and column).
    """
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"weight must be torch.float8_e4m3fn, got {weight.dtype}")
    if scales.dtype not in _FP8_SCALE_DTYPES:
        raise TypeError(f"scales must be torch.float32, torch.bfloat16 or torch.float16, got "
                        f"{scales.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [rows, cols], got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    if cols % _FP8_BLOCK_VALUES:
        raise ValueError(f"an FP8 weight's rows must hold a multiple of {_FP8_BLOCK_VALUES} "
                         f"values, got {cols}")
    block_rows, block_cols = block
    if block_rows < 1 or block_cols < 1 or (block_cols % _FP8_BLOCK_VALUES
                                            and block_cols < cols):
        raise ValueError(f"block must be (rows, cols) of positive ints whose cols are a multiple "
                         f"of {_FP8_BLOCK_VALUES} or at least the weight's {cols}: every "
                         f"{_FP8_BLOCK_VALUES} columns share a scale; got {tuple(block)}")
    grid = (-(-rows // block_rows), -(-cols // block_cols))
    if tuple(scales.shape) != grid:
        raise ValueError(f"scales must be {list(grid)} for a [{rows}, {cols}] weight in blocks of "
                         f"{tuple(block)}, got shape {tuple(scales.shape)}")
    codes = weight.view(torch.uint8)
    nan = (codes & 0x7F) == 0x7F  # e4m3fn's NaN codes
    if nan.any():
        row, col = nan.nonzero()[0].tolist()
        raise ValueError(f"weight holds a NaN code at row {row}, column {col}")
    n = cols // _FP8_BLOCK_VALUES
    row_scales = scales.repeat_interleave(block_rows, dim=0)[:rows]  # [rows, grid cols]
    block_scales = row_scales[:, torch.arange(n) * _FP8_BLOCK_VALUES // block_cols]  # [rows, n]
    out = torch.empty(rows, n, 36, dtype=torch.uint8, device=weight.device)
    out[..., :4] = block_scales.to(torch.float32).unsqueeze(-1).view(torch.uint8)
    out[..., 4:] = codes.reshape(rows, n, _FP8_BLOCK_VALUES)
    return QuantizedWeight(out.view(rows, n * 36), ops.FP8_E4M3)


def _write_blocks(out: Tensor, d: Tensor, quants: Tensor, m: Tensor | None = None) -> None:
    """ggml's block layout into ``out`` (uint8 ``[rows, n, block bytes]``): the fp16 scale ``d``
    (``[rows, n, 1]``), Q4_1's fp16 minimum ``m``, then the 32 quants: int8 (Q8_0) as they are,
    4-bit integers (uint8) as 16 bytes, values 0-15 in the low nibbles, 16-31 in the high
    ones."""
    out[..., :2] = d.view(torch.uint8)
    start = 2
    if m is not None:
        out[..., 2:4] = m.view(torch.uint8)
        start = 4
    if quants.dtype == torch.int8:
        out[..., start:] = quants.view(torch.uint8)
    else:
        out[..., start:] = quants[..., :16] | (quants[..., 16:] << 4)


def _round_half_away(x: Tensor) -> Tensor:
    """C's ``roundf``, which ggml rounds with (``torch.round`` sends ties to even). Exact: the
    fraction ``|x| - floor(|x|)`` of a float32 is itself a float32."""
    magnitude = x.abs()
    rounded = magnitude.floor()
    rounded += (magnitude - rounded) >= 0.5
    return rounded.copysign_(x)


def _fp16(field: Tensor, blocks: Tensor) -> Tensor:
    """A per-block field (float32 ``[..., 1]``: a scale or a minimum) in fp16; one that fp16
    cannot hold is a ``ValueError`` quoting its block's range."""
    half = field.to(torch.float16)
    if not torch.isfinite(half).all():
        bad = (~torch.isfinite(half)).flatten().nonzero()[0].item()
        block = blocks.reshape(-1, blocks.shape[-1])[bad]
        raise ValueError(f"the weight holds values too large for fp16 block scales, or non-finite "
                         f"ones: a block spans [{block.min().item():.4g}, "
                         f"{block.max().item():.4g}]")
    return half
