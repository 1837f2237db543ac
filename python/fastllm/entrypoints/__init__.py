"""What users call: ``LLM``, ``AsyncLLM`` (over one shared engine client), ``Reranker`` and the
``fastllm`` command."""

from fastllm.entrypoints.async_llm import AsyncLLM
from fastllm.entrypoints.llm import LLM
from fastllm.entrypoints.rerank import Reranker, RerankResult

__all__ = ["AsyncLLM", "LLM", "RerankResult", "Reranker"]
