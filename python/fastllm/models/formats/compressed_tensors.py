"""compressed-tensors checkpoints (``quant_method: "compressed-tensors"``, as llm-compressor
writes them): W4A16, W8A16, W8A8 (int and FP8), with the tensors of compressed-tensors 0.20.

``quantization_config.config_groups`` maps each group to a scheme: ``targets`` (the class
``Linear``, or ``re:`` patterns matched against module names), ``weights`` (``num_bits``,
``type`` int or float, ``symmetric``, ``strategy`` tensor / channel / group / block,
``group_size``, ``block_structure``, ``actorder``) and the ``format`` its weights are stored
in (the group's own, else the config's):

- ``pack-quantized`` (int, 4 or 8 bits): ``weight_packed`` int32 ``[rows, cols * bits / 32]``,
  each word holding ``32 / bits`` consecutive integers from its least significant bits,
  stored as ``q + 2**(bits - 1)``; ``weight_shape`` ``[rows, cols]``; ``weight_scale``; with
  zero points (``symmetric: false``), ``weight_zero_point``, packed alike along the rows
  (``[rows * bits / 32, groups]``) for group and channel scales, else int8.
- ``int-quantized`` / ``naive-quantized`` (int): ``weight`` int8 ``q``, ``weight_scale``,
  ``weight_zero_point`` int8.
- ``float-quantized`` / ``naive-quantized`` (float, 8 bits): ``weight`` float8_e4m3fn,
  ``weight_scale``.

``w = scale * (q - zero_point)``; ``weight_scale`` is ``[1]`` (tensor), ``[rows, 1]`` (channel),
``[rows, cols / group_size]`` (group) or ``[ceil(rows / r), ceil(cols / c)]`` (block ``[r, c]``),
in float32, float16 or bfloat16. ``actorder: "group"`` (older files) adds ``weight_g_idx``,
each column's group.

Integer weights become ggml blocks where that is exact (:mod:`fastllm.models.formats.
integers`: symmetric int4 in Q4_0, int4 with zero points in Q4_1 or Q8_0, int8 in Q8_0, from
groups a multiple of 32 columns or per-channel scales that fp16 holds exactly), else floats.
FP8 weights stay in their byte as fastllm's FP8 blocks (:data:`fastllm.ops.FP8_E4M3`:
:mod:`fastllm.models.formats.float8`) wherever every 32 columns share a scale (tensor and
channel scales, groups and blocks of a multiple of 32 columns, on rows of a multiple of 32
values), else are dequantized at load: ``fp8 * scale`` in float32, then the model's dtype.
Activations are never quantized as the scheme's ``input_activations`` say (W8A8): fastllm's
float path runs them in the model's dtype, its CPU integer kernels quantize them per block of
32 values on the fly (int16, or int8 for Q4_0); a static scheme's ``input_scale`` and
``input_zero_point`` are read by no one.

Refused, each naming the field: weights of 2, 3, 5-7 bits, float weights other than 8-bit,
``nvfp4``/``mxfp4`` and other formats, strategies other than the four, targets other than
``Linear`` and ``re:`` patterns, ``sparsity_config`` (2:4 sparsity), ``transform_config``
(rotations), ``kv_cache_scheme`` and ``output_activations``.
"""

from __future__ import annotations

import re
from collections.abc import Container
from dataclasses import dataclass

import torch
from torch import Tensor

from fastllm.models.formats.base import (FP8_DTYPES, SCALE_DTYPES, CheckpointFormat,
                                         ConfigSection, StoredTensor, StoredWeight,
                                         TensorGetter)
from fastllm.models.formats.float8 import FP8Weight
from fastllm.models.formats.integers import IntegerWeight, column_groups, unpack_codes

__all__ = ["CompressedTensors", "Scheme", "WeightArgs"]

# format -> the weight types stored in it
_FORMATS = {"pack-quantized": ("int",), "int-quantized": ("int",),
            "naive-quantized": ("int", "float"), "float-quantized": ("float",)}
# actorder values: whether the weights' columns come with their groups (weight_g_idx). False
# and "weight" ("static") reorder only the calibration, not the stored layout.
_ACT_ORDERS = {False: False, "weight": False, "static": False,
               True: True, "group": True, "dynamic": True}
# Strategies whose zero points pack-quantized packs along the rows.
_PACKED_ZERO_POINTS = ("group", "channel")


@dataclass(frozen=True)
class WeightArgs:
    """A scheme's ``weights``.

    Attributes:
        num_bits: 4 or 8 for int, 8 for float.
        type: ``"int"`` or ``"float"``.
        symmetric: no zero points.
        strategy: ``"tensor"``, ``"channel"``, ``"group"`` or ``"block"``.
        group_size: columns per scale (group).
        block_structure: ``(rows, cols)`` per scale (block).
        act_order: each column's group is stored (``weight_g_idx``).
    """

    num_bits: int
    type: str
    symmetric: bool
    strategy: str
    group_size: int | None
    block_structure: tuple[int, int] | None
    act_order: bool

    @classmethod
    def from_config(cls, section: ConfigSection) -> WeightArgs:
        kind = section.choice("type", ("int", "float"), "int")
        bits = section.get("num_bits", int, 8)
        supported = (4, 8) if kind == "int" else (8,)
        if bits not in supported:
            raise ValueError(section.refusal("num_bits", bits, f"fastllm loads {kind} weights of "
                                             f"{' or '.join(map(str, supported))} bits"))
        symmetric = section.get("symmetric", bool, True)
        if kind == "float" and not symmetric:
            raise ValueError(section.refusal("symmetric", symmetric, "float weights with zero "
                                             "points are not supported"))
        group_size = section.get("group_size", int, None)
        strategy = section.get("strategy", str, None)
        if strategy is None:  # compressed-tensors infers it from group_size
            strategy = ("tensor" if group_size is None else "channel" if group_size == -1
                        else "group")
        if strategy not in ("tensor", "channel", "group", "block"):
            raise ValueError(section.refusal("strategy", strategy, "fastllm loads tensor, "
                                             "channel, group and block scales"))
        if strategy == "group" and (group_size is None or group_size < 1):
            raise ValueError(section.refusal("group_size", group_size, "a group strategy needs "
                                             "a positive group size"))
        block = section.get("block_structure", list, None)
        if strategy == "block" and not (block and len(block) == 2 and all(
                isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
            raise ValueError(section.refusal("block_structure", block, "a block strategy needs "
                                             "[rows, cols] of positive ints"))
        act_order = section.get("actorder", (bool, str), False)
        if act_order not in _ACT_ORDERS:
            raise ValueError(section.refusal("actorder", act_order, "fastllm loads "
                                             f"{', '.join(map(repr, _ACT_ORDERS))}"))
        return cls(bits, kind, symmetric, strategy,
                   group_size if strategy == "group" else None,
                   tuple(block) if strategy == "block" else None, _ACT_ORDERS[act_order])

    def scale_block(self, rows: int, cols: int) -> tuple[int, int]:
        """The ``(rows, cols)`` of the weight one scale covers."""
        if self.strategy == "tensor":
            return rows, cols
        if self.strategy == "channel":
            return 1, cols
        if self.strategy == "group":
            return 1, self.group_size
        return self.block_structure


@dataclass(frozen=True)
class Scheme:
    """One of ``config_groups``: the modules it quantizes (``targets``), how (``weights``), the
    format they are stored in, and the activation tensors a static scheme stores beside them
    (``input_scale``, ``input_zero_point``), which fastllm does not use."""

    name: str
    targets: tuple[str, ...]
    weights: WeightArgs
    format: str
    input_tensors: tuple[str, ...]

    @classmethod
    def from_config(cls, name: str, section: ConfigSection, default_format: str | None) -> Scheme:
        targets = section.get("targets", list)
        for target in targets:
            if not (isinstance(target, str) and (target == "Linear" or target.startswith("re:"))):
                raise ValueError(section.refusal("targets", targets, "fastllm loads quantized "
                                                 "Linear layers, named by the class Linear or by "
                                                 "re: patterns"))
        if section.values.get("output_activations") is not None:
            raise ValueError(section.refusal("output_activations",
                                             section.values["output_activations"],
                                             "quantized outputs are not supported"))
        weights = WeightArgs.from_config(section.section("weights"))
        fmt = section.get("format", str, default_format)
        if fmt not in _FORMATS or weights.type not in _FORMATS[fmt]:
            loadable = ", ".join(f for f, kinds in _FORMATS.items() if weights.type in kinds)
            raise ValueError(section.refusal("format", fmt, f"fastllm loads {weights.type} "
                                             f"weights stored as {loadable}"))
        inputs = section.values.get("input_activations")
        input_tensors: tuple[str, ...] = ()
        if inputs is not None:
            activations = ConfigSection.of(inputs, f"{section.path}.input_activations")
            if not activations.get("dynamic", (bool, str), False):
                input_tensors = ("input_scale",) if activations.get(
                    "symmetric", bool, True) else ("input_scale", "input_zero_point")
        return cls(name, tuple(targets), weights, fmt, input_tensors)

    def match(self, module: str) -> int:
        """How closely this scheme targets ``module`` (compressed-tensors' precedence): 2 by a
        pattern, 1 by the class ``Linear`` (every module with a 2-D weight but the embedding),
        0 not at all."""
        if any(t.startswith("re:") and re.match(t[3:], module) for t in self.targets):
            return 2
        if "Linear" in self.targets and not module.endswith("embed_tokens"):
            return 1
        return 0


class CompressedTensors(CheckpointFormat):
    """A compressed-tensors ``quantization_config`` (see the module's docstring)."""

    def __init__(self, config: ConfigSection) -> None:
        for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
            value = config.values.get(key)
            if value:  # null and {} are "none"
                what = value.get("format", value) if isinstance(value, dict) else value
                raise ValueError(config.refusal(key, what, f"fastllm does not load "
                                                f"compressed-tensors checkpoints with a {key}"))
        default_format = config.get("format", str, None)
        groups = config.section("config_groups")
        if not groups.values:
            raise ValueError(f"{groups.path} is empty")
        self.schemes = [Scheme.from_config(name, groups.section(name), default_format)
                        for name in groups.values]
        self.ignore = tuple(config.get("ignore", list, []))

    def scheme(self, module: str) -> Scheme | None:
        """The scheme quantizing ``module``: the first of those that target it most closely
        (compressed-tensors' order), None where none does or ``ignore`` names it (by name or
        ``re:`` pattern)."""
        if any(module == name or (isinstance(name, str) and name.startswith("re:")
                                  and re.match(name[3:], module)) for name in self.ignore):
            return None
        best = max(self.schemes, key=lambda s: s.match(module))
        return best if best.match(module) else None

    def stored_weight(self, hf_name: str, shape: tuple[int, ...],
                      names: Container[str]) -> StoredWeight | None:
        module = hf_name.removesuffix(".weight")
        held = [name for name in (f"{module}.weight_scale", f"{module}.weight_packed")
                if name in names]
        if len(shape) != 2 or module == hf_name or not held:
            return None
        scheme = self.scheme(module)
        if scheme is None:
            raise ValueError(f"the checkpoint holds {held[0]}, but its compressed-tensors "
                             f"quantization_config leaves {module} unquantized (no config "
                             "group targets it, or ignore names it)")
        kind = (_PackedWeight if scheme.format == "pack-quantized"
                else _FloatWeight if scheme.weights.type == "float" else _IntWeight)
        return kind(module, *shape, scheme)


@dataclass(frozen=True)
class _SchemeWeight(StoredWeight):
    """A weight of one compressed-tensors scheme: its scale (and zero point, and groups)."""

    scheme: Scheme

    @property
    def method(self) -> str:
        return f"compressed-tensors {self.scheme.format}"

    @property
    def scale_shape(self) -> tuple[int, ...]:
        rows, cols = self.weights.scale_block(self.rows, self.cols)
        return -(-self.rows // rows), -(-self.cols // cols)

    @property
    def weights(self) -> WeightArgs:
        return self.scheme.weights

    @property
    def group_columns(self) -> int | None:
        columns = self.weights.scale_block(self.rows, self.cols)[1]
        return None if columns >= self.cols else columns

    @property
    def skipped(self) -> tuple[str, ...]:
        return tuple(f"{self.module}.{name}" for name in self.scheme.input_tensors)

    @property
    def tensors(self) -> tuple[StoredTensor, ...]:
        scale = self.scale_shape
        # compressed-tensors writes a per-tensor scale as [1].
        shapes = (scale, (1,)) if self.weights.strategy == "tensor" else (scale,)
        tensors = [StoredTensor(f"{self.module}.weight_scale", SCALE_DTYPES, shapes)]
        if self.weights.act_order:
            tensors.append(StoredTensor(f"{self.module}.weight_g_idx", ("I32", "I64"),
                                        ((self.cols,),)))
        return tuple(tensors)

    def integers(self, get: TensorGetter, codes: Tensor, zeros: Tensor | None) -> IntegerWeight:
        """The weight of ``codes`` and ``zeros`` (unsigned, each ``[rows, ...]`` or scale-shaped)
        with its scales (repeated over a block's rows) and its groups."""
        block = self.weights.scale_block(self.rows, self.cols)
        scales = get(f"{self.module}.weight_scale").reshape(self.scale_shape)
        scales = scales.repeat_interleave(block[0], dim=0)[:self.rows]
        if zeros is not None:
            zeros = zeros.repeat_interleave(block[0], dim=0)[:self.rows]
        group_index = None
        if self.weights.act_order:
            group_index = column_groups(get(f"{self.module}.weight_g_idx"), self.cols,
                                       block[1], scales.shape[1], f"{self.module}.weight_g_idx")
        return IntegerWeight(codes, self.weights.num_bits, scales, zeros, block[1], group_index)


@dataclass(frozen=True)
class _PackedWeight(_SchemeWeight):
    """pack-quantized: ``weight_packed``, ``weight_shape``, packed zero points."""

    @property
    def tensors(self) -> tuple[StoredTensor, ...]:
        bits = self.weights.num_bits
        tensors = [*super().tensors,
                   StoredTensor(f"{self.module}.weight_packed", ("I32",),
                                ((self.rows, -(-self.cols * bits // 32)),)),
                   StoredTensor(f"{self.module}.weight_shape", ("I64", "I32"), ((2,),))]
        if not self.weights.symmetric:
            zero_shape = self.scale_shape
            if self.weights.strategy in _PACKED_ZERO_POINTS:
                tensors.append(StoredTensor(f"{self.module}.weight_zero_point", ("I32",),
                                            ((-(-zero_shape[0] * bits // 32), zero_shape[1]),)))
            else:
                tensors.append(StoredTensor(f"{self.module}.weight_zero_point", ("I8",),
                                            (zero_shape, (1,))))
        return tuple(tensors)

    def decode(self, get: TensorGetter) -> IntegerWeight:
        shape = get(f"{self.module}.weight_shape").tolist()
        if shape != [self.rows, self.cols]:
            raise ValueError(f"tensor {self.module}.weight_shape holds {shape}, expected "
                             f"{[self.rows, self.cols]} from config.json")
        bits = self.weights.num_bits
        codes = unpack_codes(get(f"{self.module}.weight_packed"), bits, self.cols)
        zeros = None
        if not self.weights.symmetric:
            stored = get(f"{self.module}.weight_zero_point")
            if self.weights.strategy in _PACKED_ZERO_POINTS:  # packed along the rows
                zeros = unpack_codes(stored.T, bits, self.scale_shape[0]).T
            else:
                zeros = _unsigned(stored.reshape(self.scale_shape), bits,
                                  f"{self.module}.weight_zero_point")
        return self.integers(get, codes, zeros)


@dataclass(frozen=True)
class _IntWeight(_SchemeWeight):
    """int-quantized / naive-quantized integers: ``weight`` int8, ``weight_zero_point`` int8."""

    @property
    def tensors(self) -> tuple[StoredTensor, ...]:
        tensors = [*super().tensors,
                   StoredTensor(f"{self.module}.weight", ("I8",), ((self.rows, self.cols),))]
        if not self.weights.symmetric:
            tensors.append(StoredTensor(f"{self.module}.weight_zero_point", ("I8",),
                                        (self.scale_shape, (1,))))
        return tuple(tensors)

    def decode(self, get: TensorGetter) -> IntegerWeight:
        bits = self.weights.num_bits
        codes = _unsigned(get(f"{self.module}.weight"), bits, f"{self.module}.weight")
        zeros = None
        if not self.weights.symmetric:
            zeros = _unsigned(get(f"{self.module}.weight_zero_point").reshape(self.scale_shape),
                              bits, f"{self.module}.weight_zero_point")
        return self.integers(get, codes, zeros)


@dataclass(frozen=True)
class _FloatWeight(_SchemeWeight):
    """float-quantized FP8: ``weight`` float8_e4m3fn times its scales."""

    @property
    def tensors(self) -> tuple[StoredTensor, ...]:
        return (*super().tensors,
                StoredTensor(f"{self.module}.weight", FP8_DTYPES, ((self.rows, self.cols),)))

    def decode(self, get: TensorGetter) -> FP8Weight:
        scales = get(f"{self.module}.weight_scale").reshape(self.scale_shape)
        return FP8Weight(get(f"{self.module}.weight"), scales,
                         self.weights.scale_block(self.rows, self.cols), f"{self.module}.weight")


def _unsigned(values: Tensor, bits: int, name: str) -> Tensor:
    """Signed ``bits``-bit integers (int8 storage) as unsigned ones, ``q + 2**(bits - 1)``;
    one out of range is a ValueError naming tensor ``name``."""
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if values.numel() and not (low <= int(values.min()) and int(values.max()) <= high):
        raise ValueError(f"tensor {name} holds values outside [{low}, {high}], the range of "
                         f"{bits}-bit integers")
    return (values.to(torch.int16) - low).to(torch.uint8)
