"""Loads a Hugging Face safetensors checkpoint into a :class:`~fastllm.models.decoder.DecoderLM`.

The files are memory-mapped (``safetensors.safe_open``) and read tensor by tensor through an
explicit HF name -> fastllm name map that also fuses q/k/v and gate/up. The model is built on
the meta device and materialized once, by assigning the loaded tensors
(:mod:`fastllm.models.build`); a ``.gguf`` path is handed to :mod:`fastllm.models.gguf`.
Pickle checkpoints (``.bin``, ``.pt``, ``.pth``) are refused: loading them can run arbitrary code.

A quantized checkpoint (``quantization_config`` in config.json: compressed-tensors, fp8, GPTQ,
AWQ) is read through its format (:mod:`fastllm.models.formats`): each quantized weight's
tensors replace its ``weight``, and become ggml blocks or floats.

Every tensor's dtype and shape are checked against the config from the files' headers before
any tensor is read; a file the safetensors reader refuses is a ValueError naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from fastllm.gguf_file import GGUFFileReader
from fastllm.models.build import HFTensor, build_model, hf_weight_map
from fastllm.models.config import ModelConfig
from fastllm.models.formats import CheckpointFormat, StoredWeight, checkpoint_format
from fastllm.models.gguf import load_gguf
from fastllm.models.decoder import DecoderLM
from fastllm.models.quantized import QuantizedWeight, check_quantization
from fastllm.models.tensor_parallel import ShardLayout, TensorParallel, TensorSlice

__all__ = ["FLOAT_DTYPES", "PICKLE_SUFFIXES", "load_model", "open_safetensors"]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
# Buffers some older HF checkpoints saved; HF skips them on load too.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# The safetensors dtypes a float weight may be stored in: a weight relabelled as an integer
# type (same bytes, another meaning) would load as garbage.
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", quantization: str | None = None,
               tensor_parallel: TensorParallel | None = None,
               gguf_reader: GGUFFileReader | None = None) -> DecoderLM:
    """Loads the HF model folder ``path`` (``config.json`` plus ``*.safetensors``), or the
    llama.cpp GGUF file ``path`` (``*.gguf``, see :func:`fastllm.models.gguf.load_gguf`).

    Sharded checkpoints are read through ``model.safetensors.index.json`` when present. Weights
    are cast to ``dtype`` and placed on ``device``; with ``quantization`` ("int8" or "int4") the
    projections, embedding and LM head are quantized to ggml blocks instead (see
    :func:`fastllm.models.build.build_model`). A missing, unexpected or wrongly shaped
    tensor, or one not stored as floats, is a ``ValueError`` naming the first one (and its
    file), raised before any tensor is read; with tied embeddings an ``lm_head.weight`` in the
    checkpoint is ignored, as HF does. A bad ``config.json`` value is a ``ValueError`` or
    ``TypeError`` naming the key.

    A quantized checkpoint (its ``quantization_config``: compressed-tensors, fp8, gptq, awq) is
    loaded as it is stored (:mod:`fastllm.models.formats`): integer weights as the ggml blocks
    that hold them exactly, where one does, else (and FP8 weights) dequantized to ``dtype``;
    its quantization method, or a setting of it fastllm does not load, is a ``ValueError``
    naming the field, and ``quantization`` is refused (its weights are quantized already).

    With ``tensor_parallel``, the model is that rank's shard (see
    :mod:`fastllm.models.tensor_parallel`), and only its parts of the tensors are read (of a
    quantized weight, its stored tensors whole, then cut). A column cut inside a quantization
    group is a ``ValueError`` naming the group size and the cut.

    ``gguf_reader``: the GGUF file ``path`` already parsed (see ``load_gguf``'s ``reader``).
    """
    check_quantization(quantization)
    folder = Path(path)
    if folder.suffix == ".gguf":
        return load_gguf(folder, dtype=dtype, device=device, quantization=quantization,
                         tensor_parallel=tensor_parallel, reader=gguf_reader)
    if folder.suffix in PICKLE_SUFFIXES:
        raise ValueError(_pickle_refusal(folder))
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a model folder (expected a Hugging Face folder "
                                "with config.json and *.safetensors)")
    config = ModelConfig.from_pretrained(folder)
    checkpoint = checkpoint_format(folder)
    files_by_name = _checkpoint_index(folder)
    weight_map = hf_weight_map(config)
    stored = _stored_weights(checkpoint, weight_map, files_by_name)
    if stored and check_quantization(quantization) is not None:
        weight = next(iter(stored.values()))
        raise ValueError(f"{folder} is already quantized ({weight.module} is {weight.method}); "
                         f"load it without quantization={quantization!r}, or quantize a float "
                         "checkpoint")
    _check_keys(weight_map, files_by_name, config, stored)
    if tensor_parallel is not None:
        shard = ShardLayout.of(config, tensor_parallel)
        for name, parts in weight_map.items():
            for (hf_name, _), part in zip(parts, shard.slices(name, parts) or []):
                if hf_name in stored:
                    stored[hf_name].check_cut(part, tensor_parallel.size)

    with ExitStack() as stack:
        handles = {file: stack.enter_context(open_safetensors(file))
                   for file in sorted(set(files_by_name.values()))}
        for parts in weight_map.values():
            for hf_name, shape in parts:
                if hf_name not in stored:
                    _check_tensor(handles, files_by_name[hf_name], hf_name, FLOAT_DTYPES,
                                  (shape,))
                    continue
                for tensor in stored[hf_name].tensors:
                    _check_tensor(handles, files_by_name[tensor.name], tensor.name,
                                  tensor.dtypes, tensor.shapes, stored[hf_name])

        def get(name: str) -> Tensor:
            try:
                return handles[files_by_name[name]].get_tensor(name)
            except SafetensorError as error:
                raise ValueError(f"{files_by_name[name]}: cannot read tensor {name}: "
                                 f"{error}") from error

        def read(hf_name: str, shape: tuple[int, ...],
                 part: TensorSlice | None) -> Tensor | QuantizedWeight:
            if hf_name in stored:
                return stored[hf_name].read(get, part)
            if part is None:
                return get(hf_name)
            file = files_by_name[hf_name]
            try:
                # Only the slice's bytes are read from the memory-mapped file.
                index = (slice(None),) * part.dim + (slice(part.start, part.stop),)
                return handles[file].get_slice(hf_name)[index]
            except SafetensorError as error:
                raise ValueError(f"{file}: cannot read tensor {hf_name}: {error}") from error

        return build_model(config, read, dtype=dtype, device=device,
                           quantization=quantization, tensor_parallel=tensor_parallel)


@contextmanager
def open_safetensors(file: Path) -> Iterator[Any]:
    """``safe_open(file)``; a file the reader refuses (a corrupt header, offsets past the end)
    is a ValueError naming it."""
    try:
        handle = safe_open(file, framework="pt", device="cpu")
    except SafetensorError as error:
        raise ValueError(f"{file} is not a valid safetensors file: {error}") from error
    with handle:
        yield handle


def _check_tensor(handles: dict[Path, Any], file: Path, name: str, dtypes: tuple[str, ...],
                  shapes: tuple[tuple[int, ...], ...], weight: StoredWeight | None = None) -> None:
    """Refuses tensor ``name`` unless its header entry says one of ``dtypes`` (for a plain
    weight, floats) and one of ``shapes``; ``weight``: the quantized weight it is part of."""
    try:
        entry = handles[file].get_slice(name)
        dtype, stored_shape = entry.get_dtype(), tuple(entry.get_shape())
    except SafetensorError as error:
        raise ValueError(f"{file}: cannot read tensor {name}: {error}") from error
    if dtype not in dtypes:
        kind = ("a weight must be floats" if weight is None
                else f"{weight.method} stores it as")
        raise ValueError(f"{file}: tensor {name} is stored as {dtype}; {kind} "
                         f"({', '.join(dtypes)})")
    if stored_shape not in shapes:
        expected = " or ".join(map(str, shapes))
        source = ("from config.json" if weight is None else f"as {weight.method} stores a "
                  f"weight of shape {(weight.rows, weight.cols)} (config.json)")
        raise ValueError(f"{file}: tensor {name} has shape {stored_shape}, expected {expected} "
                         f"{source}")


def _stored_weights(checkpoint: CheckpointFormat | None, weight_map: dict[str, list[HFTensor]],
                    files_by_name: dict[str, Path]) -> dict[str, StoredWeight]:
    """HF tensor name -> how ``checkpoint`` stores it, for those it stores quantized."""
    if checkpoint is None:
        return {}
    stored = {}
    for parts in weight_map.values():
        for hf_name, shape in parts:
            weight = checkpoint.stored_weight(hf_name, shape, files_by_name)
            if weight is not None:
                stored[hf_name] = weight
    return stored


def _checkpoint_index(folder: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            contents = json.loads(index.read_text(encoding="utf-8"))
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError alike
            raise ValueError(f"{index} is not valid JSON: {error}") from error
        weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map'")
        for name, file in weight_map.items():
            # A shard is a file of this folder: no other path is read.
            if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
                raise ValueError(f"{index} maps {name} to {file!r:.80}, not a file name in "
                                 f"{folder}")
        files = {name: folder / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise FileNotFoundError(f"{index} names {file.name}, which is not in {folder}")
        return files
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        pickles = [p for p in sorted(folder.iterdir()) if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            raise ValueError(_pickle_refusal(pickles[0]))
        raise FileNotFoundError(f"no *.safetensors file in {folder}")
    files: dict[str, Path] = {}
    for shard in shards:
        with open_safetensors(shard) as f:
            for name in f.keys():
                if name in files:
                    raise ValueError(f"{name} is in both {files[name].name} and {shard.name}")
                files[name] = shard
    return files


def _check_keys(weight_map: dict[str, list[HFTensor]], files_by_name: dict[str, Path],
                config: ModelConfig, stored: dict[str, StoredWeight]) -> None:
    # checkpoint tensor -> the quantized weight needing it (None: a plain tensor)
    expected: dict[str, StoredWeight | None] = {}
    for parts in weight_map.values():
        for hf_name, _ in parts:
            if hf_name in stored:
                expected.update((t.name, stored[hf_name]) for t in stored[hf_name].tensors)
            else:
                expected[hf_name] = None
    missing = [name for name in expected if name not in files_by_name]
    if missing:
        weight = expected[missing[0]]
        part = "" if weight is None else f"part of a {weight.method} weight; "
        raise ValueError(f"the checkpoint lacks {missing[0]} ({part}{len(missing)} missing "
                         f"tensor(s) for a {config.architecture})")
    skipped = {name for weight in stored.values() for name in weight.skipped}
    known = (set(expected) | skipped
             | ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    unexpected = sorted(name for name in files_by_name
                        if name not in known and not name.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(f"unexpected tensor {unexpected[0]} in the checkpoint "
                         f"({len(unexpected)} unexpected for a {config.architecture})")


def _pickle_refusal(path: Path) -> str:
    return (f"{path} is a pickle checkpoint; fastllm loads only safetensors, since unpickling can "
            "run arbitrary code. Convert it first, e.g. with transformers: "
            "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(out, "
            "safe_serialization=True)")
