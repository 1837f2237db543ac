"""The block-quantized ops (``csrc/quantized``): :func:`quantized_linear` and :func:`dequantize`,
the ggml block formats they take (:data:`BLOCK_FORMATS`, :func:`block_format`), fastllm's FP8
blocks (:data:`FP8_E4M3`), and the CPU's interleaved weight layout (:func:`cpu_decode_layout`,
:func:`quantized_rows`)."""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm import _C
from fastllm.ops.fake_kernels import check_one_device, fake_kernel

__all__ = ["BLOCK_FORMATS", "FP8_E4M3", "INTERLEAVED_Q4_0", "INTERLEAVED_Q4_1", "INTERLEAVED_Q4_K",
           "INTERLEAVED_Q5_0", "INTERLEAVED_Q6_K", "INTERLEAVED_Q8_0", "INTERLEAVED_TYPES",
           "block_format", "cpu_decode_layout", "dequantize", "quantized_linear",
           "quantized_rows"]

# The ggml block formats the quantized ops take (csrc/quantized/block_formats.h): type id ->
# (name, values per block, bytes per block). A K-quant's block is a super-block of 256 values.
BLOCK_FORMATS = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
                 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144),
                 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}
# fastllm's own weight types, never in a file: Q4_0's, Q4_1's, Q5_0's, Q8_0's, Q4_K's and Q6_K's
# blocks with each group of 16 rows interleaved, the layout of the CPU's AVX-512 decode kernels
# (and AVX2's for Q4_0, Q4_1, Q5_0 and Q8_0: :func:`cpu_decode_layout`): ``INTERLEAVED_TYPES +``
# the ggml type. The CPU ops take them; other devices take the ggml blocks.
INTERLEAVED_TYPES = 1000
(INTERLEAVED_Q4_0, INTERLEAVED_Q4_1, INTERLEAVED_Q5_0, INTERLEAVED_Q8_0, INTERLEAVED_Q4_K,
 INTERLEAVED_Q6_K) = (INTERLEAVED_TYPES + t for t in (2, 3, 6, 8, 12, 14))
_INTERLEAVED = (INTERLEAVED_Q4_0, INTERLEAVED_Q4_1, INTERLEAVED_Q5_0, INTERLEAVED_Q8_0,
                INTERLEAVED_Q4_K, INTERLEAVED_Q6_K)
_INTERLEAVED_NAMES = [f"{BLOCK_FORMATS[t - INTERLEAVED_TYPES][0]} ({t})" for t in _INTERLEAVED]
# fastllm's FP8 weight type, never in a file (csrc/quantized/block_formats.h): an FP8
# checkpoint's float8_e4m3fn weights kept in their byte, every 32 values of a row one 36-byte
# block of a little-endian float32 scale and 32 e4m3 codes, value ``scale * e4m3(code)``
# (:func:`fastllm.models.quantized.pack_fp8`). Every device's ops take it.
FP8_E4M3 = 2000
_FP8_FORMAT = ("FP8_E4M3", 32, 36)


def block_format(weight_type: int) -> tuple[str, int, int]:
    """``(name, values per block, bytes per block)`` of a weight type the quantized ops take:
    :data:`BLOCK_FORMATS`, :data:`FP8_E4M3`, or an interleaved one (``INTERLEAVED_*``: their
    blocks, each row's bytes in another order). A ValueError names the types for any other."""
    if weight_type == FP8_E4M3:
        return _FP8_FORMAT
    if weight_type in _INTERLEAVED:
        name, values, block_bytes = BLOCK_FORMATS[weight_type - INTERLEAVED_TYPES]
        return f"{name} interleaved by 16", values, block_bytes
    if weight_type not in BLOCK_FORMATS:
        names = ", ".join(f"{name} ({type_id})" for type_id, (name, _, _) in BLOCK_FORMATS.items())
        interleaved = ", ".join(_INTERLEAVED_NAMES[:-1]) + " or " + _INTERLEAVED_NAMES[-1]
        raise ValueError(f"weight_type must be a ggml type id of {names}, or fastllm's "
                         f"FP8_E4M3 blocks ({FP8_E4M3}), got {weight_type} (the CPU also takes "
                         f"{interleaved} with rows interleaved by 16)")
    return BLOCK_FORMATS[weight_type]


def cpu_decode_layout(weight: Tensor, weight_type: int) -> tuple[Tensor, int]:
    """``(weight, weight_type)`` in the layout the CPU's decode kernels read fastest, for a
    weight of :func:`quantized_linear` kept on this CPU: a weight with a multiple of 16 rows
    whose type has an interleaved kernel in the instruction set in use
    (``fastllm._C.cpu_interleaved_types()``: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K with AVX-512
    or AMX; Q4_0, Q4_1, Q5_0 and Q8_0 with AVX2) becomes its interleaved type
    (``INTERLEAVED_TYPES + weight_type``, a copy): one 64-byte load then holds 4 values of each
    of 16 rows, and one integer multiply-add serves several rows. Anything else is returned as
    it is. The result is the same weight to :func:`quantized_linear` and :func:`dequantize` on
    the CPU (decode rows' last bits aside: other sums in another order); with another
    instruction set chosen later (``fastllm._C.set_cpu_isa``) they put its rows back in order at
    each call where that set has no kernel for them."""
    if (INTERLEAVED_TYPES + weight_type in _INTERLEAVED and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.shape[0] % 16 == 0
            and weight_type in _C.cpu_interleaved_types()):
        return _C.interleave_rows(weight, weight_type), INTERLEAVED_TYPES + weight_type
    return weight, weight_type


def quantized_rows(weight: Tensor, weight_type: int, rows: Tensor) -> tuple[Tensor, int]:
    """Rows ``rows`` (integer indices, any shape) of a weight of :func:`quantized_linear` as
    ``(blocks, ggml type)``, ``blocks`` uint8 ``[*rows.shape, row bytes]``: ``weight[rows]``, or,
    for an interleaved type (:func:`cpu_decode_layout`), those rows of the ggml blocks it came
    from. An embedding looks its rows up so in a table that is also the LM head."""
    if weight_type not in _INTERLEAVED:
        return weight[rows], weight_type
    ggml_type = weight_type - INTERLEAVED_TYPES
    blocks = _C.deinterleave_rows(weight, weight_type, rows.reshape(-1))
    return blocks.view(*rows.shape, weight.shape[1]), ggml_type


def quantized_linear(x: Tensor, weight: Tensor, weight_type: int,
                     bias: Tensor | None = None) -> Tensor:
    """``x @ W.T + bias`` with ``W`` block-quantized.

    Args:
        x: ``[rows, in_features]``, float32, bfloat16 or float16.
        weight: uint8 ``[out_features, row bytes]``: ggml's blocks of ``weight_type``, row by row
            (:data:`BLOCK_FORMATS`: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K;
            ``in_features`` values per row, whole blocks: a multiple of 256 for the K-quants),
            or fastllm's FP8 blocks (:data:`FP8_E4M3`: a multiple of 32), on x's device; on
            the CPU also in :func:`cpu_decode_layout`'s order.
        weight_type: the ggml type id (``gguf.GGMLQuantizationType``), :data:`FP8_E4M3`, or
            on the CPU an interleaved type (``INTERLEAVED_*``).
        bias: ``[out_features]`` in x's dtype, or None.

    Returns ``[rows, out_features]`` in x's dtype. On the CPU a few rows (a decode step, up to
    32) quantize the activations to int16 blocks of 32 (int8 for Q4_0 and the K-quants, as
    llama.cpp does) and take integer dot products with the weight's blocks (AVX-512 VNNI, or
    AVX2, or plain C++: the widest the CPU has, or the environment variable
    ``FASTLLM_CPU_ISA=amx|avx512|avx2|scalar``), streaming the weight once in its own size;
    more rows take a GEMM: with AMX, oneDNN's bfloat16 GEMM on dequantized tiles; with AVX-512
    or AVX2, Q4_0's and the K-quants' on those 8-bit activations; else on dequantized tiles of
    the weight. FP8 weights keep the activations in float32: decode rows decode the codes in
    registers for float32 multiply-adds (AVX-512, AVX2 with F16C, or plain C++), prefill rows
    take the dequantized weight as the other formats do. On CUDA up to 8 rows run a GEMV
    that decodes the blocks in registers (float32 sums); more rows dequantize the weight to x's
    dtype for cuBLAS. Within those decode rows a row's result does not depend on the others.
    """
    return torch.ops.fastllm.quantized_linear.default(x, weight, weight_type, bias)


@fake_kernel("quantized_linear")
def _quantized_linear_fake(x, weight, weight_type, bias=None):
    check_one_device(x=x, weight=weight, bias=bias)
    return x.new_empty(x.shape[0], weight.shape[0])


def dequantize(weight: Tensor, weight_type: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The rows of a block-quantized weight (as :func:`quantized_linear` takes it) as
    ``[rows, in_features]`` floats of ``dtype``."""
    return torch.ops.fastllm.dequantize.default(weight, weight_type, dtype)


@fake_kernel("dequantize")
def _dequantize_fake(weight, weight_type, dtype):
    _, values, block_bytes = block_format(weight_type)
    return weight.new_empty(weight.shape[0], weight.shape[1] // block_bytes * values, dtype=dtype)
