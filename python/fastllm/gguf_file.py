"""GGUF files as ``gguf.GGUFReader`` parses them, checked and parsed fast: the one reader of the
GGUF model loader (:mod:`fastllm.models.gguf`) and the GGUF tokenizer
(:mod:`fastllm.tokenizer.gguf`)."""

from __future__ import annotations

import math
import mmap
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField

from fastllm import _C

__all__ = ["GGUFFileReader"]

# llama.cpp's names for the parts of a split model: NAME-00001-of-00003.gguf.
_SPLIT_NAME = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")


class _GGUFFileError(ValueError):
    """A bad GGUF file, already named in the message (raised by :class:`GGUFFileReader`)."""


class _ArrayField(ReaderField):
    """A metadata array of scalars or strings, read whole: ``contents()`` gives what gguf's
    ``ReaderField.contents()`` gives, but ``parts`` end with one array of all the values (typed;
    for strings, an object array of the decoded ``str``) instead of gguf's part per value, and
    ``data`` indexes that last part."""

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        values = self.parts[-1][index_or_slice]
        return values.tolist() if isinstance(values, (np.ndarray, np.generic)) else values


class GGUFFileReader(GGUFReader):
    """``gguf.GGUFReader`` that refuses a file it cannot read faithfully, naming where, and
    parses it faster; metadata arrays (a vocabulary's tokens, scores and merges: tens of
    thousands of values) are read whole, as :class:`_ArrayField`, instead of value by value (an
    array of strings in one pass of ``_C.read_gguf_strings``).

    The reader parses everything in its constructor and makes an array view of every tensor's
    data there, so the checks hook its steps: :meth:`_get` (each read must lie within the file:
    a bad count then fails at once instead of reading short or looping over an array of 2**60
    nothing), :meth:`_push_field` and :meth:`_get_tensor_info_field` (where it is, for the
    message) and :meth:`_build_tensors` (each tensor's entry, before its view is made). Any
    other error of the reader (a bad value type, a duplicate key, a bad alignment) becomes a
    ValueError naming the file and where it was; a missing file is a FileNotFoundError.

    The file is mapped copy-on-write: the views are writable (as ``torch.from_numpy`` wants
    them; a model keeps its blocks as views of the file), and a write never reaches the file.

    A model split by llama.cpp's ``gguf-split`` (or gguf's writer) into ``NAME-00001-of-0000N.gguf``
    files is read from its first part, as llama.cpp reads it: the metadata is the first part's,
    ``tensors`` those of every part, which are read from beside it.
    """

    def __init__(self, path: str | os.PathLike, *, split_part: bool = False) -> None:
        """``split_part``: the file is a later part of a split model, read by its first part."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is not a file")
        with path.open("rb") as file:
            magic = file.read(4)
        if magic != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        self.path, self.position = path, "the header"
        self._plain: np.ndarray | None = None
        try:
            super().__init__(path, "c")
        except _GGUFFileError:
            raise
        except (ValueError, IndexError, KeyError, TypeError, OverflowError) as error:
            raise ValueError(f"{path}: cannot read {self.position}: {error}") from error
        if hasattr(mmap, "MADV_HUGEPAGE"):
            # Tensor data read from disk through the mapping then comes into the page cache in
            # 2 MiB folios, mapped by huge pages (the kernel aligns the mapping): weights used
            # in place (16-bit, mapped blocks) stream with a 512th of the TLB misses. Advice
            # only: a file already cached in small folios stays as it is.
            self.data._mmap.madvise(mmap.MADV_HUGEPAGE)
        if not split_part:
            self._join_split_parts()

    def _join_split_parts(self) -> None:
        """Appends the tensors of a split model's other parts (see the class docstring)."""
        count_field = self.fields.get("split.count")
        count = int(count_field.contents()) if count_field is not None else 1
        if count <= 1:
            return
        number = int(self.fields["split.no"].contents()) if "split.no" in self.fields else 0
        name = _SPLIT_NAME.fullmatch(self.path.name)
        if name is None or int(name.group(3)) != count:
            raise ValueError(f"{self.path} is part {number + 1} of a model split in {count}, but "
                             f"is not named NAME-{number + 1:05d}-of-{count:05d}.gguf")
        if number != 0:
            first = f"{name.group(1)}-00001-of-{count:05d}.gguf"
            raise ValueError(f"{self.path} is part {number + 1} of a model split in {count}: "
                             f"load its first part, {first}")
        for number in range(2, count + 1):
            part_path = self.path.with_name(f"{name.group(1)}-{number:05d}-of-{count:05d}.gguf")
            if not part_path.is_file():
                raise FileNotFoundError(f"{self.path} is part 1 of a model split in {count}; "
                                        f"part {number}, {part_path.name}, is not beside it")
            part = GGUFFileReader(part_path, split_part=True)
            if "split.no" in part.fields and int(part.fields["split.no"].contents()) != number - 1:
                raise ValueError(f"{part_path} says it is part "
                                 f"{int(part.fields['split.no'].contents()) + 1}, not {number}")
            self.tensors.extend(part.tensors)
        names = [tensor.name for tensor in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.path}: a tensor is in two parts of the split model")
        expected = self.fields.get("split.tensors.count")
        if expected is not None and int(expected.contents()) != len(names):
            raise ValueError(f"{self.path}: the split model's parts hold {len(names)} tensors, "
                             f"its split.tensors.count says {int(expected.contents())}")

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None
             ) -> np.ndarray:
        end = offset + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise _GGUFFileError(f"{self.path} is truncated: {self.position} reads bytes up to "
                                 f"{end}, past the end of the file ({len(self.data)} bytes)")
        # The reader's own _get slices its np.memmap once per value (twice per string): each
        # slice is a memmap whose bookkeeping dominates parsing a large vocabulary. A plain
        # ndarray view of the same mapping slices without it.
        if self._plain is None:
            self._plain = self.data.view(np.ndarray)
        values = self._plain[offset:end].view(dtype)
        order = self.byte_order if override_order is None else override_order
        return values.view(values.dtype.newbyteorder(order))

    def _build_fields(self, offs: int, count: int) -> int:
        # gguf's loop, but arrays of scalars or strings become _ArrayFields: gguf reads an array
        # value by value, three numpy views per string.
        for _ in range(int(count)):
            start = offs
            key_length, key = self._get_str(offs)
            offs += int(key_length.nbytes + key.nbytes)
            raw_type = self._get(offs, np.uint32)
            offs += int(raw_type.nbytes)
            parts = [key_length, key, raw_type]
            name = str(bytes(key), encoding="utf-8")
            array = (self._read_array(offs) if raw_type[0] == GGUFValueType.ARRAY else None)
            if array is not None:
                size, array_parts, types = array
                parts += array_parts
                field = _ArrayField(start, name, parts, [len(parts) - 1], types)
            else:  # scalars, strings and arrays of arrays: gguf's way
                size, value_parts, indices, types = self._get_field_parts(offs, raw_type[0])
                field = ReaderField(start, name, parts + value_parts,
                                    [i + len(parts) for i in indices], types)
            self._push_field(field, skip_sum=True)
            offs += size
        return offs

    def _read_array(self, offs: int) -> tuple[int, list[np.ndarray], list[GGUFValueType]] | None:
        """The array value at ``offs`` as (its size in bytes, its parts, its types) for an
        :class:`_ArrayField`; None for an array of arrays."""
        element_type = self._get(offs, np.uint32)
        count = self._get(offs + 4, np.uint64)
        start, n = offs + 12, int(count[0])
        kind = GGUFValueType(int(element_type[0]))
        if kind == GGUFValueType.STRING:
            big_endian = np.dtype(np.uint64).newbyteorder(self.byte_order).str[0] == ">"
            try:
                strings, end = _C.read_gguf_strings(self.data.view(np.ndarray), start, n,
                                                    big_endian)
            except UnicodeDecodeError:
                raise
            except ValueError as error:  # a length past the end of the file
                raise _GGUFFileError(f"{self.path} is truncated: {self.position}: {error}"
                                     ) from None
            values = np.empty(n, dtype=object)
            values[:] = strings
            parts = [element_type, count, values]
        elif (scalar := self.gguf_scalar_to_np.get(kind)) is not None:
            values = self._get(start, scalar, n)
            parts, end = [element_type, count, values], start + int(values.nbytes)
        else:
            return None
        return end - offs, parts, [GGUFValueType.ARRAY, kind]

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
