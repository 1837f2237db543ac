"""Loads a Hugging Face safetensors checkpoint into a :class:`~fastllm.models.llama.DecoderLM`.

The files are memory-mapped (``safetensors.safe_open``) and read tensor by tensor through an
explicit HF name -> fastllm name map that also fuses q/k/v and gate/up. The model is built on
the meta device and materialized once, by assigning the loaded tensors
(:mod:`fastllm.models.build`); a ``.gguf`` path is handed to :mod:`fastllm.models.gguf`.
Pickle checkpoints (``.bin``, ``.pt``, ``.pth``) are refused: loading them can run arbitrary code.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from fastllm.models.build import HFTensor, build_model, hf_weight_map
from fastllm.models.config import ModelConfig
from fastllm.models.gguf import load_gguf
from fastllm.models.llama import DecoderLM
from fastllm.models.quantized import check_quantization

__all__ = ["load_model"]

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
# Buffers some older HF checkpoints saved; HF skips them on load too.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", quantization: str | None = None) -> DecoderLM:
    """Loads the HF model folder ``path`` (``config.json`` plus ``*.safetensors``), or the
    llama.cpp GGUF file ``path`` (``*.gguf``, see :func:`fastllm.models.gguf.load_gguf`).

    Sharded checkpoints are read through ``model.safetensors.index.json`` when present. Weights
    are cast to ``dtype`` and placed on ``device``; with ``quantization`` ("int8" or "int4") the
    projections, embedding and LM head are quantized to ggml blocks instead (see
    :func:`fastllm.models.build.build_model`). A missing, unexpected or wrongly shaped
    tensor is a ``ValueError`` naming the first one; with tied embeddings an ``lm_head.weight``
    in the checkpoint is ignored, as HF does.
    """
    check_quantization(quantization)
    folder = Path(path)
    if folder.suffix == ".gguf":
        return load_gguf(folder, dtype=dtype, device=device, quantization=quantization)
    if folder.suffix in _PICKLE_SUFFIXES:
        raise ValueError(_pickle_refusal(folder))
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a model folder (expected a Hugging Face folder "
                                "with config.json and *.safetensors)")
    config = ModelConfig.from_pretrained(folder)
    files_by_name = _checkpoint_index(folder)
    weight_map = hf_weight_map(config)
    _check_keys(weight_map, files_by_name, config)

    with ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(file, framework="pt", device="cpu"))
                   for file in sorted(set(files_by_name.values()))}

        def read(hf_name: str, shape: tuple[int, ...]) -> Tensor:
            tensor = handles[files_by_name[hf_name]].get_tensor(hf_name)
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{hf_name} has shape {tuple(tensor.shape)}, expected "
                                 f"{shape} from config.json")
            return tensor

        return build_model(config, read, dtype=dtype, device=device,
                           quantization=quantization)


def _checkpoint_index(folder: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map'")
        files = {name: folder / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise FileNotFoundError(f"{index} names {file.name}, which is not in {folder}")
        return files
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        pickles = [p for p in sorted(folder.iterdir()) if p.suffix in _PICKLE_SUFFIXES]
        if pickles:
            raise ValueError(_pickle_refusal(pickles[0]))
        raise FileNotFoundError(f"no *.safetensors file in {folder}")
    files: dict[str, Path] = {}
    for shard in shards:
        with safe_open(shard, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in files:
                    raise ValueError(f"{name} is in both {files[name].name} and {shard.name}")
                files[name] = shard
    return files


def _check_keys(weight_map: dict[str, list[HFTensor]], files_by_name: dict[str, Path],
                config: ModelConfig) -> None:
    expected = [hf_name for parts in weight_map.values() for hf_name, _ in parts]
    missing = [name for name in expected if name not in files_by_name]
    if missing:
        raise ValueError(f"the checkpoint lacks {missing[0]} ({len(missing)} missing tensor(s) "
                         f"for a {config.architecture})")
    known = set(expected) | ({"lm_head.weight"} if config.tie_word_embeddings else set())
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
