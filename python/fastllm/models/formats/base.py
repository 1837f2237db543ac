"""What every quantized-checkpoint format gives the safetensors loader: per HF weight, the
tensors that hold it (:class:`StoredTensor`, checked against the files' headers before anything
is read) and how they decode (:class:`StoredWeight`); per format, which weights it stores so
(:class:`CheckpointFormat`); and :class:`ConfigSection`, which reads ``quantization_config``
with errors naming the field."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from fastllm.models.checks import brief
from fastllm.models.formats.float8 import FP8Weight
from fastllm.models.formats.integers import IntegerWeight
from fastllm.models.quantized import QuantizedWeight
from fastllm.models.tensor_parallel import TensorSlice

__all__ = ["FP8_DTYPES", "SCALE_DTYPES", "CheckpointFormat", "ConfigSection", "StoredTensor",
           "StoredWeight", "TensorGetter"]

# get(name): the checkpoint's whole tensor ``name`` (one of a StoredWeight's tensors).
TensorGetter = Callable[[str], Tensor]

# The safetensors dtypes of scales, and of FP8 weights.
SCALE_DTYPES = ("F32", "F16", "BF16")
FP8_DTYPES = ("F8_E4M3",)
# A value ConfigSection.get reads with no default: absent is an error.
_REQUIRED = object()


@dataclass(frozen=True)
class StoredTensor:
    """A tensor a quantized weight needs: its checkpoint name, the safetensors dtypes it may be
    stored in (``"I32"``, ``"F8_E4M3"``, ...) and the shapes it may have (a per-tensor scale is
    ``()`` or ``(1,)``)."""

    name: str
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class StoredWeight(ABC):
    """One HF weight (``module + ".weight"``, ``[rows, cols]``) as a quantized checkpoint holds
    it: a format's way to read one layer's weight, as vLLM's quantization methods each say how
    to load one.

    Attributes:
        module: the HF module, e.g. ``model.layers.0.self_attn.q_proj``.
        rows, cols: the float weight's shape, from config.json.
        group_columns: the columns one scale spans where tensor parallelism must keep them
            together (a group); None where a column cut splits no scale (per-channel scales).
        skipped: tensors of this module the checkpoint may hold that fastllm does not use
            (static activation scales: activations run unquantized).
    """

    module: str
    rows: int
    cols: int

    @property
    @abstractmethod
    def method(self) -> str:
        """The format's name for messages (``compressed-tensors pack-quantized``, ``GPTQ``)."""

    @property
    @abstractmethod
    def tensors(self) -> tuple[StoredTensor, ...]:
        """The checkpoint tensors this weight is made of, all required."""

    @property
    def group_columns(self) -> int | None:
        return None

    @property
    def skipped(self) -> tuple[str, ...]:
        return ()

    @abstractmethod
    def decode(self, get: TensorGetter) -> IntegerWeight | FP8Weight | Tensor:
        """The weight from its tensors: integers and scales where the format stores integers,
        FP8 codes and scales where it stores those, else floats ``[rows, cols]`` (float32,
        already dequantized)."""

    def read(self, get: TensorGetter, part: TensorSlice | None) -> Tensor | QuantizedWeight:
        """The weight, or its ``part`` (a tensor-parallel rank's rows or columns, cut where
        :meth:`check_cut` allows): ggml blocks where its integers and scales are exactly some
        block format's (:meth:`IntegerWeight.blocks`), FP8 blocks where every 32 columns of
        its FP8 codes share a scale (:meth:`FP8Weight.blocks`), else float32 values. Its stored
        tensors are read whole: the packed layouts of GPTQ and AWQ store a weight transposed."""
        weight = self.decode(get)
        if isinstance(weight, (IntegerWeight, FP8Weight)):
            weight = weight.part(part)
            blocks = weight.blocks()
            return weight.dequantize() if blocks is None else blocks
        if part is None:
            return weight
        return weight.narrow(part.dim, part.start, part.stop - part.start).contiguous()

    def check_cut(self, part: TensorSlice | None, ranks: int) -> None:
        """Refuses a tensor-parallel column cut of this weight that falls inside a group of
        :attr:`group_columns`: a group's scale belongs to one rank (row cuts split nothing)."""
        group = self.group_columns
        if part is None or part.dim != 1 or group is None:
            return
        for cut in (part.start, part.stop):
            if cut % group and cut != self.cols:
                raise ValueError(f"tensor parallelism over {ranks} ranks cuts the columns of "
                                 f"{self.module}.weight ({self.cols}) at {cut}, inside a "
                                 f"quantization group ({self.method}: groups of {group} "
                                 "columns); run it on fewer ranks")


class CheckpointFormat(ABC):
    """A ``quantization_config`` method: which weights of a checkpoint it stores quantized,
    and how. A weight counts as quantized where the checkpoint holds the format's tensors for
    it (its scales); the others are plain floats, as the config's exclusions (compressed-
    tensors' ``ignore``, ``modules_to_not_convert``) leave them."""

    @abstractmethod
    def stored_weight(self, hf_name: str, shape: tuple[int, ...],
                      names: Container[str]) -> StoredWeight | None:
        """How the checkpoint (``names``: every tensor it holds) stores the HF tensor
        ``hf_name`` of ``shape``: None for plain floats."""


@dataclass(frozen=True)
class ConfigSection:
    """A JSON object of ``quantization_config`` and its path (``quantization_config.
    config_groups.group_0.weights``), read with errors naming the field and the value."""

    values: Mapping[str, Any]
    path: str

    @classmethod
    def of(cls, value: Any, path: str) -> ConfigSection:
        if not isinstance(value, Mapping):
            raise TypeError(f"{path} must be a JSON object, got {brief(value)}")
        return cls(value, path)

    def get(self, key: str, kinds: type | tuple[type, ...], default: Any = _REQUIRED) -> Any:
        """``values[key]`` (a present null counts as absent), ``default`` when absent; a value
        not of ``kinds`` is a TypeError, an absent one without a default a ValueError."""
        value = self.values.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ValueError(f"{self.path}.{key} is missing")
            return default
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(kind.__name__ for kind in kinds)
            raise TypeError(f"{self.path}.{key} must be of type {names}, got {brief(value)}")
        return value

    def choice(self, key: str, allowed: tuple[Any, ...], default: Any = _REQUIRED,
               what: str = "") -> Any:
        """``get(key)``, refused unless it is one of ``allowed`` (a ValueError naming the field,
        the value and ``what`` fastllm loads)."""
        value = self.get(key, tuple({type(a) for a in allowed}), default)
        if value not in allowed:
            raise ValueError(self.refusal(key, value, what or f"fastllm loads "
                                          f"{' or '.join(map(repr, allowed))}"))
        return value

    def refusal(self, key: str, value: Any, why: str) -> str:
        """The message refusing ``key``'s ``value``."""
        return f"{self.path}.{key} is {brief(value)}: {why}"

    def section(self, key: str) -> ConfigSection:
        """The JSON object ``values[key]``."""
        return ConfigSection.of(self.values.get(key), f"{self.path}.{key}")
