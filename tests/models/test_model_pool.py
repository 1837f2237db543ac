"""fastllm.load: one load per (path, dtype, device, quantization), a bounded LRU, reloads of
changed files."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

import fastllm
from fastllm.models import pool
from fastllm.models.pool import ModelPool, resolve_dtype
from fastllm.models.quantized import QuantizedLinear


@pytest.fixture
def loads(monkeypatch) -> list:
    """Records every real load the pools below make."""
    calls = []
    real = pool.load_model

    def counting(path, **kwargs):
        calls.append((path, kwargs["dtype"]))
        return real(path, **kwargs)

    monkeypatch.setattr(pool, "load_model", counting)
    return calls


def test_a_model_is_loaded_once_per_path_dtype_and_device(model_path, loads):
    pool = ModelPool(max_models=4)
    folder = model_path("stories260K_hf")
    first = pool.load(folder)
    assert pool.load(str(folder), "float32", "cpu") is first
    assert pool.load(folder / "." , torch.float32, torch.device("cpu")) is first
    bf16 = pool.load(folder, "bfloat16")
    assert bf16 is not first and bf16.embed_tokens.weight.dtype == torch.bfloat16
    assert len(loads) == 2 and len(pool) == 2
    assert (folder, "bf16", "cpu") in pool and (folder, "float16", "cpu") not in pool
    assert not first.training and not any(p.requires_grad for p in first.parameters())


def test_a_quantized_copy_is_pooled_apart_from_the_float_one(model_path, loads):
    pool = ModelPool(max_models=4)
    folder = model_path("stories260K_hf")
    fp32 = pool.load(folder)
    int8 = pool.load(folder, quantization="int8")
    assert int8 is not fp32 and pool.load(folder, "float32", "cpu", "int8") is int8
    assert pool.load(folder, quantization="int4") not in (fp32, int8) and len(loads) == 3
    assert not isinstance(fp32.layers[0].self_attn.o_proj, QuantizedLinear)
    assert isinstance(int8.layers[0].self_attn.o_proj, QuantizedLinear)
    assert (folder, "float32", "cpu", "int8") in pool and (folder, "float32", "cpu") in pool
    assert (folder, "bfloat16", "cpu", "int8") not in pool
    with pytest.raises(ValueError, match="quantization must be None, 'int8' or 'int4', got 'q4'"):
        pool.load(folder, quantization="q4")
    assert len(pool) == 3


def test_the_least_recently_used_model_leaves_a_full_pool(model_path, loads):
    pool = ModelPool(max_models=2)
    folder = model_path("stories260K_hf")
    fp32 = pool.load(folder, "float32")
    pool.load(folder, "bfloat16")
    assert pool.load(folder, "float32") is fp32  # now the most recently used
    pool.load(folder, "float16")  # evicts bfloat16
    assert len(pool) == 2 and (folder, "float32", "cpu") in pool
    assert (folder, "bfloat16", "cpu") not in pool
    pool.load(folder, "bfloat16")
    assert len(loads) == 4
    pool.clear()
    assert len(pool) == 0


def test_a_changed_checkpoint_is_loaded_anew(model_path, tmp_path, loads):
    folder = shutil.copytree(model_path("stories260K_hf"), tmp_path / "model")
    pool = ModelPool(max_models=2)
    first = pool.load(folder)
    weights = folder / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    second = pool.load(folder)
    assert second is not first and len(pool) == 1 and len(loads) == 2


def test_concurrent_loads_of_one_model_load_it_once(model_path, loads):
    pool = ModelPool(max_models=2)
    folder = model_path("stories260K_hf")
    results = []
    threads = [threading.Thread(target=lambda: results.append(pool.load(folder)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(loads) == 1 and all(model is results[0] for model in results)


def test_the_process_pool_is_bounded_and_public(model_path):
    assert fastllm.load == pool.model_pool.load
    assert pool.model_pool.max_models >= 1
    folder = model_path("stories260K_hf")
    assert fastllm.load(folder) is fastllm.load(folder)


def test_bad_arguments_raise(model_path, tmp_path):
    with pytest.raises(ValueError, match="max_models must be >= 1, got 0"):
        ModelPool(0)
    with pytest.raises(FileNotFoundError, match="no model at"):
        ModelPool(1).load(tmp_path / "nothing")
    with pytest.raises(ValueError, match="got torch.int32"):
        resolve_dtype(torch.int32)
    with pytest.raises(ValueError, match="got 'fp8'"):
        ModelPool(1).load(model_path("stories260K_hf"), "fp8")
    assert resolve_dtype("torch.bfloat16") is torch.bfloat16


def test_a_failed_load_leaves_nothing_in_the_pool(model_path, tmp_path, loads):
    """A bad file is a ValueError and pools nothing; the entry of a checkpoint whose files
    changed goes, whether its new files load or not."""
    folder = shutil.copytree(model_path("stories260K_hf"), tmp_path / "model")
    other = shutil.copytree(folder, tmp_path / "other")
    pool = ModelPool(max_models=4)
    kept = pool.load(other)
    pool.load(folder)
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:len(good) // 2])  # truncated
    with pytest.raises(ValueError, match=r"model\.safetensors is not a valid safetensors file"):
        pool.load(folder)
    assert len(pool) == 1 and (other, "float32", "cpu") in pool and pool.load(other) is kept
    assert (folder, "float32", "cpu") not in pool
    weights.write_bytes(good)
    assert pool.load(folder).config.vocab_size == kept.config.vocab_size
    assert len(pool) == 2 and len(loads) == 4


def test_a_truncated_gguf_is_not_pooled(model_path, tmp_path, loads):
    path = tmp_path / "model.gguf"
    good = (model_path("gguf") / "llama-2-tiny-random.gguf").read_bytes()
    path.write_bytes(good[:-1000])  # cuts the last tensor's data
    pool = ModelPool(max_models=2)
    with pytest.raises(ValueError, match=r"model\.gguf: tensor [\w.]+ .* past the end of the file"):
        pool.load(path)
    assert len(pool) == 0 and len(loads) == 1
