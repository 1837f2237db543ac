"""GGUF files as ``gguf.GGUFReader`` parses them, checked and parsed fast: the one reader of the
GGUF model loader (:mod:`fastllm.models.gguf`) and the GGUF tokenizer
(:mod:`fastllm.tokenizer.gguf`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderField

__all__ = ["GGUFFileReader"]


class _GGUFFileError(ValueError):
    """A bad GGUF file, already named in the message (raised by :class:`GGUFFileReader`)."""


class GGUFFileReader(GGUFReader):
    """``gguf.GGUFReader`` that refuses a file it cannot read faithfully, naming where, and
    parses it about 3x faster.

    The reader parses everything in its constructor and makes an array view of every tensor's
    data there, so the checks hook its steps: :meth:`_get` (each read must lie within the file:
    a bad count then fails at once instead of reading short or looping over an array of 2**60
    nothing), :meth:`_push_field` and :meth:`_get_tensor_info_field` (where it is, for the
    message) and :meth:`_build_tensors` (each tensor's entry, before its view is made). Any
    other error of the reader (a bad value type, a duplicate key, a bad alignment) becomes a
    ValueError naming the file and where it was.
    """

    def __init__(self, path: Path) -> None:
        self.path, self.position = path, "the header"
        self._plain: np.ndarray | None = None
        try:
            super().__init__(path)
        except _GGUFFileError:
            raise
        except (ValueError, IndexError, KeyError, TypeError, OverflowError) as error:
            raise ValueError(f"{path}: cannot read {self.position}: {error}") from error

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None
             ) -> np.ndarray:
        end = offset + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise _GGUFFileError(f"{self.path} is truncated: {self.position} reads bytes up to "
                                 f"{end}, past the end of the file ({len(self.data)} bytes)")
        # The reader's own _get slices its np.memmap once per value (twice per string): each
        # slice is a memmap whose bookkeeping took 2/3 of parsing a 151,936-token vocabulary
        # (6.7 s). A plain ndarray view of the same mapping slices without it.
        if self._plain is None:
            self._plain = self.data.view(np.ndarray)
        values = self._plain[offset:end].view(dtype)
        order = self.byte_order if override_order is None else override_order
        return values.view(values.dtype.newbyteorder(order))

    def _push_field(self, field: ReaderField, skip_sum: bool = False) -> int:
        self.position = f"the metadata after {field.name!r}"
        return super()._push_field(field, skip_sum)

    def _get_tensor_info_field(self, orig_offs: int) -> ReaderField:
        field = super()._get_tensor_info_field(orig_offs)
        self.position = f"the tensor infos after {field.name!r}"
        return field

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        for field in fields:
            self.position = f"tensor {field.name}"
            _, _, _, dims, raw_type, offset = field.parts
            self._check_tensor_info(field.name, [int(n) for n in dims], int(raw_type[0]),
                                    start_offs, int(offset[0]))
        self.position = "the tensors"
        super()._build_tensors(start_offs, fields)

    def _check_tensor_info(self, name: str, dims: list[int], raw_type: int, start: int,
                           offset: int) -> None:
        """Refuses a tensor entry whose data the reader would view wrongly: an unknown type,
        rows that are not whole blocks, an offset off the file's alignment (once read as NaN
        weights), or data past the end of the file (a truncated file)."""
        where = f"{self.path}: tensor {name}"
        if raw_type not in GGML_QUANT_SIZES:
            raise _GGUFFileError(f"{where} has unknown ggml type {raw_type}")
        kind = GGMLQuantizationType(raw_type)
        if not 1 <= len(dims) <= 4:  # GGML_MAX_DIMS
            raise _GGUFFileError(f"{where} has {len(dims)} dimensions; ggml takes 1 to 4")
        block, block_bytes = GGML_QUANT_SIZES[kind]
        if dims[0] % block:  # ggml lists the row (innermost) dimension first
            raise _GGUFFileError(f"{where} has rows of {dims[0]} values, not whole {kind.name} "
                                 f"blocks of {block}")
        if offset % self.alignment:
            raise _GGUFFileError(f"{where} starts at offset {offset} of the data section, not a "
                                 f"multiple of the file's alignment {self.alignment}")
        n_bytes = math.prod(dims) // block * block_bytes
        if start + offset + n_bytes > len(self.data):
            raise _GGUFFileError(
                f"{where} ({kind.name}, ggml shape {dims}) needs bytes {start + offset} to "
                f"{start + offset + n_bytes}, past the end of the file ({len(self.data)} bytes): "
                "the file is truncated or the entry is wrong")
