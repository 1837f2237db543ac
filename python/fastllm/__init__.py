"""fastllm: fast LLM inference kernels and orchestration for PyTorch users.

The package is laid out by layer; each imports only those below it:

- ``fastllm.ops``: the ops (``torch.ops.fastllm.*``, dispatched per device), their fakes and
  plain-PyTorch twins (``fastllm.ops.reference``); ``fastllm.MaskCache``, the causal-mask cache.
- ``fastllm.kv_cache``: KV pools and the block manager; ``fastllm.sampling``: ``SamplingParams``
  and the sampling step; ``fastllm.tokenizer``: tokenizers, chat templates, detokenization.
- ``fastllm.models``: the decoder family, its loaders (safetensors, GGUF) and the model pool;
  ``fastllm.lora``: peft LoRA adapters (``LoRARequest``) and the slots a worker holds them in.
- ``fastllm.engine``: requests, the scheduler, the model runner, continuous batching.
- ``fastllm.entrypoints``: ``LLM``, ``AsyncLLM``, ``Reranker`` and the ``fastllm`` command.

Names are imported on first use, so ``import fastllm.ops`` loads no engine, tokenizer or
entrypoint module.
"""

import importlib

from fastllm.gc_pause import collector_paused

with collector_paused(freeze=True):
    import torch

    from fastllm import _C

if _C.torch_version != torch.__version__:
    raise ImportError(
        f"fastllm was built against torch {_C.torch_version} but torch {torch.__version__} is "
        "installed; rebuild it with `pip install --no-build-isolation .`"
    )

MaskCache = _C.MaskCache

# Public name -> the module that defines it (a module itself when the name is a subpackage).
_EXPORTS = {
    "ops": "fastllm.ops", "kv_cache": "fastllm.kv_cache", "sampling": "fastllm.sampling",
    "tokenizer": "fastllm.tokenizer", "models": "fastllm.models", "lora": "fastllm.lora",
    "engine": "fastllm.engine",
    "entrypoints": "fastllm.entrypoints",
    "BlockManager": "fastllm.kv_cache", "KVCacheFullError": "fastllm.kv_cache",
    "SampleOutput": "fastllm.sampling", "SamplingParams": "fastllm.sampling",
    "SamplingTensors": "fastllm.sampling", "sample_next_tokens": "fastllm.sampling",
    "StructuredOutputsParams": "fastllm.sampling",
    "IncrementalDetokenizer": "fastllm.tokenizer", "Tokenizer": "fastllm.tokenizer",
    "load": "fastllm.models.pool", "LoRARequest": "fastllm.lora",
    "CompletionOutput": "fastllm.engine.outputs", "Logprob": "fastllm.engine.outputs",
    "RequestMetrics": "fastllm.engine.outputs", "RequestOutput": "fastllm.engine.outputs",
    "ChunkedPrompt": "fastllm.engine.chunked_prompt",
    "EngineConfig": "fastllm.engine", "EngineStats": "fastllm.engine",
    "LLM": "fastllm.entrypoints", "AsyncLLM": "fastllm.entrypoints",
    "Reranker": "fastllm.entrypoints", "RerankResult": "fastllm.entrypoints",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastllm' has no attribute {name!r}")
    with collector_paused(freeze=True):
        imported = importlib.import_module(module)
    value = imported if module == f"fastllm.{name}" else getattr(imported, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = ["MaskCache", *_EXPORTS]
__version__ = "0.1.0"
