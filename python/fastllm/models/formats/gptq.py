"""GPTQ (``quant_method: "gptq"``: AutoGPTQ, GPTQModel, optimum) and AWQ (``quant_method:
"awq"``: AutoAWQ's GEMM layout) checkpoints. Both store a quantized Linear of ``[rows, cols]``
(out, in features) transposed, as int32 words of unsigned integers, with one scale and zero
point per group of ``group_size`` input columns (``-1``: one group), ``w = scale * (q - zero)``:

GPTQ, ``bits`` 4 or 8, ``32 / bits`` integers a word from its least significant bits:
    ``qweight`` ``[cols * bits / 32, rows]`` (packed along the input columns), ``qzeros``
    ``[groups, rows * bits / 32]`` (packed along the output rows), ``scales`` ``[groups, rows]``
    (float16), ``g_idx`` ``[cols]`` (each column's group: with ``desc_act``, the activation
    order). ``checkpoint_format`` (or ``format``) ``"gptq"`` (v1) stores ``zero - 1``, read as
    AutoGPTQ reads it, ``(stored + 1) mod 2**bits``; ``"gptq_v2"`` stores the zero itself.
    Symmetric files (``sym``) hold zero ``2**(bits - 1)`` everywhere.

AWQ, 4 bits, ``version`` (or ``format``) ``"gemm"``:
    ``qweight`` ``[cols, rows / 8]`` and ``qzeros`` ``[groups, rows / 8]`` (packed along the
    output rows, nibble ``i`` of a word holding its ``[0, 2, 4, 6, 1, 3, 5, 7][i]``-th row),
    ``scales`` ``[groups, rows]``.

Where the groups are a multiple of 32 columns in order (no activation order, or a ``g_idx``
that is the columns' own) and the scales are fp16 (they are), the weights become ggml blocks
exactly (:mod:`fastllm.models.formats.integers`): symmetric 4-bit GPTQ Q4_0, AWQ and
asymmetric 4-bit GPTQ Q4_1 (or Q8_0, where a minimum ``-scale * zero`` is no fp16), 8-bit GPTQ
Q8_0 (where ``q - zero`` fits an int8); the others are dequantized at load. A projection is
quantized where the checkpoint holds its ``qweight``; the rest (the LM head, the modules of
``modules_to_not_convert``) are plain tensors.

Refused, naming the field: GPTQ of 2 or 3 bits, or in another ``checkpoint_format`` (Marlin,
BitBLAS: repacked for their kernels); AWQ other than 4-bit with zero points in the GEMM layout
(``gemv``, ``gemv_fast``, ``marlin``, ``exllama``, ``llm-awq``).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

import torch

from fastllm.models.formats.base import (SCALE_DTYPES, CheckpointFormat, ConfigSection,
                                         StoredTensor, StoredWeight, TensorGetter)
from fastllm.models.formats.integers import IntegerWeight, column_groups, unpack_codes

__all__ = ["AWQ", "GPTQ"]

# AWQ's words hold the rows 8 w + [0, 2, 4, 6, 1, 3, 5, 7][i] in nibble i: row 8 w + k is in
# nibble _AWQ_NIBBLE[k].
_AWQ_NIBBLE = [0, 4, 1, 5, 2, 6, 3, 7]


def _group_size(config: ConfigSection) -> int:
    group = config.get("group_size", int)
    if group != -1 and group < 1:
        raise ValueError(config.refusal("group_size", group, "it must be -1 (one group) or "
                                        "positive"))
    return group


class GPTQ(CheckpointFormat):
    """A ``quant_method: "gptq"`` config (see the module's docstring)."""

    def __init__(self, config: ConfigSection) -> None:
        self.bits = config.choice("bits", (4, 8), what="fastllm loads GPTQ weights of 4 or 8 "
                                  "bits")
        self.group = _group_size(config)
        key = "format" if "format" in config.values else "checkpoint_format"
        layout = config.get(key, str, "gptq").lower()
        if layout not in ("gptq", "gptq_v2"):
            raise ValueError(config.refusal(key, layout, "fastllm loads GPTQ's own layouts, "
                                            "'gptq' (v1) and 'gptq_v2'"))
        if config.get("is_marlin_format", bool, False):
            raise ValueError(config.refusal("is_marlin_format", True, "fastllm loads GPTQ's "
                                            "own layouts, not Marlin's"))
        self.v1 = layout == "gptq"

    def stored_weight(self, hf_name: str, shape: tuple[int, ...],
                      names: Container[str]) -> StoredWeight | None:
        module = hf_name.removesuffix(".weight")
        if len(shape) != 2 or module == hf_name or f"{module}.qweight" not in names:
            return None
        return _GPTQWeight(module, *shape, self.bits, self.group, self.v1)


class AWQ(CheckpointFormat):
    """A ``quant_method: "awq"`` config (see the module's docstring)."""

    def __init__(self, config: ConfigSection) -> None:
        config.choice("bits", (4,), 4, "fastllm loads 4-bit AWQ weights")
        self.group = _group_size(config)
        config.choice("zero_point", (True,), True, "fastllm loads AWQ weights with zero points")
        if config.get("backend", str, "") == "llm-awq":
            raise ValueError(config.refusal("backend", "llm-awq", "fastllm loads AutoAWQ's "
                                            "GEMM layout"))
        key = "format" if "format" in config.values else "version"
        layout = config.get(key, str, "gemm").lower()
        if layout != "gemm":
            raise ValueError(config.refusal(key, layout, "fastllm loads AutoAWQ's GEMM "
                                            "layout ('gemm')"))

    def stored_weight(self, hf_name: str, shape: tuple[int, ...],
                      names: Container[str]) -> StoredWeight | None:
        module = hf_name.removesuffix(".weight")
        if len(shape) != 2 or module == hf_name or f"{module}.qweight" not in names:
            return None
        return _AWQWeight(module, *shape, 4, self.group)


@dataclass(frozen=True)
class _GroupedWeight(StoredWeight):
    """``qweight``, ``qzeros`` and ``scales`` of ``bits``-bit integers in groups of ``group``
    input columns (-1: one group)."""

    bits: int
    group: int

    @property
    def columns_per_group(self) -> int:
        return self.cols if self.group == -1 else self.group

    @property
    def groups(self) -> int:
        return -(-self.cols // self.columns_per_group)

    @property
    def group_columns(self) -> int | None:
        return None if self.columns_per_group >= self.cols else self.columns_per_group

    def _tensors(self, qweight: tuple[int, int]) -> list[StoredTensor]:
        words = -(-self.rows * self.bits // 32)
        return [StoredTensor(f"{self.module}.qweight", ("I32",), (qweight,)),
                StoredTensor(f"{self.module}.qzeros", ("I32",), ((self.groups, words),)),
                StoredTensor(f"{self.module}.scales", SCALE_DTYPES, ((self.groups, self.rows),))]


@dataclass(frozen=True)
class _GPTQWeight(_GroupedWeight):
    v1: bool

    @property
    def method(self) -> str:
        return "GPTQ"

    @property
    def tensors(self) -> tuple[StoredTensor, ...]:
        return (*self._tensors((-(-self.cols * self.bits // 32), self.rows)),
                StoredTensor(f"{self.module}.g_idx", ("I32", "I64"), ((self.cols,),)))

    def decode(self, get: TensorGetter) -> IntegerWeight:
        codes = unpack_codes(get(f"{self.module}.qweight").T, self.bits, self.cols)
        zeros = unpack_codes(get(f"{self.module}.qzeros"), self.bits, self.rows).T
        if self.v1:  # zero - 1 stored, wrapped as AutoGPTQ wraps it
            zeros = ((zeros.to(torch.int16) + 1) % (1 << self.bits)).to(torch.uint8)
        group_index = column_groups(get(f"{self.module}.g_idx"), self.cols,
                                    self.columns_per_group, self.groups, f"{self.module}.g_idx")
        return IntegerWeight(codes, self.bits, get(f"{self.module}.scales").T, zeros,
                             self.columns_per_group, group_index)


@dataclass(frozen=True)
class _AWQWeight(_GroupedWeight):
    @property
    def method(self) -> str:
        return "AWQ"

    @property
    def tensors(self) -> tuple[StoredTensor, ...]:
        return tuple(self._tensors((self.cols, -(-self.rows // 8))))

    def decode(self, get: TensorGetter) -> IntegerWeight:
        codes = self._rows(get(f"{self.module}.qweight"))  # [rows, cols]
        zeros = self._rows(get(f"{self.module}.qzeros"))  # [rows, groups]
        return IntegerWeight(codes, 4, get(f"{self.module}.scales").T, zeros,
                             self.columns_per_group)

    def _rows(self, packed: torch.Tensor) -> torch.Tensor:
        """AWQ's words ``[n, rows / 8]`` as the integers of each row, ``[rows, n]``."""
        words = packed.shape[1]
        nibbles = unpack_codes(packed, 4, 8 * words)  # [n, 8 * words], AWQ's order in each 8
        rows = nibbles.view(-1, words, 8)[..., _AWQ_NIBBLE].flatten(1)[:, :self.rows]
        return rows.T.contiguous()  # the blocks are cut along its rows
