"""fastllm: fast LLM inference kernels and orchestration for PyTorch users.

``fastllm.ops`` holds the ops (registered as ``torch.ops.fastllm.*`` and dispatched per device),
``fastllm.reference`` their plain-PyTorch twins, ``fastllm.MaskCache`` the causal-mask cache,
``fastllm.SamplingParams`` / ``fastllm.sample_next_tokens`` the sampling step and
``fastllm.kv_cache`` the KV caches, with ``fastllm.BlockManager`` handing out paged-KV blocks,
``fastllm.models`` the decoder models and their loaders (safetensors, GGUF),
``fastllm.Tokenizer`` the tokenizers, chat templates and incremental detokenization, and
``fastllm.LLM`` / ``fastllm.AsyncLLM`` text generation (vLLM's interface) with continuous
batching (``fastllm.engine``) on models from ``fastllm.load``, the bounded model pool, and
``fastllm.Reranker`` Qwen3-Reranker scoring.
"""

import torch

from fastllm import _C

if _C.torch_version != torch.__version__:
    raise ImportError(
        f"fastllm was built against torch {_C.torch_version} but torch {torch.__version__} is "
        "installed; rebuild it with `pip install --no-build-isolation .`"
    )

from fastllm import kv_cache, ops, reference  # noqa: E402  (needs the op registry loaded above)
from fastllm.kv_cache import BlockManager, KVCacheFullError  # noqa: E402
from fastllm.tokenizer import IncrementalDetokenizer, Tokenizer  # noqa: E402
from fastllm.sampling import (  # noqa: E402
    SampleOutput,
    SamplingParams,
    SamplingTensors,
    sample_next_tokens,
)

from fastllm.model_pool import load  # noqa: E402
from fastllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput  # noqa: E402
from fastllm.llm import LLM  # noqa: E402
from fastllm.async_llm import AsyncLLM  # noqa: E402
from fastllm.engine import EngineConfig, EngineStats  # noqa: E402
from fastllm.rerank import Reranker, RerankResult  # noqa: E402

MaskCache = _C.MaskCache

__all__ = ["LLM", "AsyncLLM", "BlockManager", "CompletionOutput", "EngineConfig", "EngineStats",
           "IncrementalDetokenizer", "KVCacheFullError", "Logprob", "MaskCache",
           "RequestMetrics", "RequestOutput", "Reranker", "RerankResult", "SampleOutput",
           "SamplingParams", "SamplingTensors", "Tokenizer", "kv_cache", "load", "ops",
           "reference", "sample_next_tokens"]
__version__ = "0.1.0"
