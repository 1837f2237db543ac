"""The model pool: each model is loaded once per (path, dtype, device, quantization, tensor
parallel rank) and shared.

Loading a checkpoint costs seconds and gigabytes, so ``fastllm.load`` (and every
:class:`fastllm.LLM`) goes through one process-wide pool. It is bounded: it keeps the
``max_models`` most recently used models (default 2, ``FASTLLM_MODEL_POOL_SIZE`` overrides) and
drops the least recently used beyond that. Dropping only releases the pool's reference; a model
an ``LLM`` still holds stays alive until that ``LLM`` goes. A checkpoint whose files changed
(size or modification time) is loaded anew.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from fastllm.gguf_file import GGUFFileReader
from fastllm.hub import resolve_model
from fastllm.models import DecoderLM, TensorParallel, load_model
from fastllm.models.quantized import check_quantization

__all__ = ["ModelPool", "load", "model_pool", "resolve_dtype"]

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from its name ("float32", "bfloat16", "float16") or itself."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        resolved = _DTYPES[dtype.removeprefix("torch.")]
    else:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return resolved


def _canonical(path: Path) -> Path:
    """One name per checkpoint: a folder resolved, a file's folder resolved but not the file,
    which in a hub cache is a link to a blob named by its hash (no ``.gguf``)."""
    return path.resolve() if path.is_dir() else path.parent.resolve() / path.name


def _fingerprint(path: Path) -> tuple:
    """What identifies the checkpoint's current contents, cheaply: its files' sizes and times."""
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".json", ".safetensors", ".gguf"))
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)


class ModelPool:
    """A bounded LRU cache of loaded models keyed by (path, dtype, device, quantization,
    tensor_parallel). Thread-safe: two threads asking for the same model wait for one load."""

    def __init__(self, max_models: int) -> None:
        if max_models < 1:
            raise ValueError(f"max_models must be >= 1, got {max_models}")
        self.max_models = max_models
        self._models: OrderedDict[tuple, DecoderLM] = OrderedDict()
        self._lock = threading.Lock()

    def load(self, model_path: str | os.PathLike, dtype: str | torch.dtype = "float32",
             device: str | torch.device = "cpu", quantization: str | None = None, *,
             revision: str | None = None, tensor_parallel: TensorParallel | None = None,
             gguf_reader: GGUFFileReader | None = None) -> DecoderLM:
        """The model at ``model_path`` (HF folder, ``.gguf`` file, or a hub name with its
        ``revision``: see :func:`fastllm.hub.resolve_model`) in ``dtype`` on ``device``,
        its weights quantized at load when ``quantization`` is "int8" or "int4" (see
        :func:`fastllm.models.load_model`), loaded on first use and shared afterwards. Treat it
        as read-only. With ``tensor_parallel``, it is that rank's shard, over that group
        (:mod:`fastllm.models.tensor_parallel`). ``gguf_reader``: the GGUF file already parsed,
        read if the model is not pooled (see :func:`fastllm.models.load_model`).

        A model enters the pool only once fully loaded: a load that fails (a bad file is a
        ValueError naming it) leaves nothing behind, and the stale entry of a checkpoint whose
        files changed is dropped before its new files are read, whether they load or not."""
        check_quantization(quantization)
        path = _canonical(resolve_model(model_path, revision))
        torch_dtype, torch_device = resolve_dtype(dtype), torch.device(device)
        if tensor_parallel is not None and not isinstance(tensor_parallel, TensorParallel):
            raise TypeError(f"tensor_parallel must be a TensorParallel or None, got "
                            f"{tensor_parallel!r}")
        key = (str(path), torch_dtype, str(torch_device), quantization, tensor_parallel,
               _fingerprint(path))
        with self._lock:
            model = self._models.get(key)
            if model is None:
                # A changed checkpoint's old entries are stale, and their memory is better free
                # while the new files load.
                for stale in [k for k in self._models if k[:-1] == key[:-1]]:
                    del self._models[stale]
                model = load_model(path, dtype=torch_dtype, device=torch_device,
                                   quantization=quantization, tensor_parallel=tensor_parallel,
                                   gguf_reader=gguf_reader)
                model.eval()
                self._models[key] = model
            self._models.move_to_end(key)
            while len(self._models) > self.max_models:
                self._models.popitem(last=False)
            return model

    def clear(self) -> None:
        """Drops every pooled model."""
        with self._lock:
            self._models.clear()

    def __len__(self) -> int:
        return len(self._models)

    def __contains__(self, key: tuple) -> bool:
        """Whether ``(path, dtype, device)`` (unquantized, whole), ``(path, dtype, device,
        quantization)`` or ``(path, dtype, device, quantization, tensor_parallel)`` is pooled
        (at its files' current state)."""
        model_path, dtype, device, *rest = key
        quantization, tensor_parallel = (*rest, None, None)[:2]
        path = _canonical(Path(model_path).expanduser())
        return path.exists() and (str(path), resolve_dtype(dtype), str(torch.device(device)),
                                  quantization, tensor_parallel,
                                  _fingerprint(path)) in self._models


model_pool = ModelPool(int(os.environ.get("FASTLLM_MODEL_POOL_SIZE", "2")))
load = model_pool.load
