"""``POST /v1/rerank``: the Jina/Cohere rerank shape (query, documents, top_n) that vLLM and
llama.cpp serve, scored with the Qwen3-Reranker recipe (:class:`fastllm.entrypoints.rerank.
RerankRecipe`) as prompt-only requests of the server's running batch: the pairs' shared prefix
is computed once and reused through the prefix cache, as :class:`fastllm.Reranker` does."""

from __future__ import annotations

import asyncio

from fastllm.entrypoints.async_llm import AsyncLLM
from fastllm.entrypoints.openai import protocol as api
from fastllm.entrypoints.openai.serving import APIError, OpenAIServing
from fastllm.entrypoints.rerank import RerankRecipe, relevance, shared_prefix_length

__all__ = ["RerankServing"]


class RerankServing:
    """Reranks documents with the served model, when it is a Qwen3-Reranker."""

    def __init__(self, llm: AsyncLLM, model_name: str, serving: OpenAIServing) -> None:
        self.llm, self.model_name, self.serving = llm, model_name, serving
        try:
            self.recipe: RerankRecipe | None = RerankRecipe(
                llm.client.tokenizer, max_length=llm.client.max_model_len)
        except ValueError as error:
            self.recipe, self.why_not = None, str(error)

    async def rerank(self, req: api.RerankRequest) -> api.RerankResponse:
        self.serving.check_model(req.model)
        if self.recipe is None:
            raise APIError(400, f"the served model `{self.model_name}` cannot rerank: "
                                f"{self.why_not}", param="model")
        documents = [d if isinstance(d, str) else d.text for d in req.documents]
        if not documents:
            raise APIError(400, "documents must not be empty", param="documents")
        self.serving.check_capacity(len(documents))
        ids = [self.recipe.pair_token_ids(req.query, document) for document in documents]
        reused = shared_prefix_length(ids, self.llm.client.kv_cache.spec.block_size)
        if reused:
            await self.llm.score(ids[0][:reused], ())
        tasks = [asyncio.ensure_future(self.llm.score(pair, self.recipe.answer_ids))
                 for pair in ids]
        try:
            scores = relevance(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[:req.top_n]
        return api.RerankResponse(
            id=api.random_id("rerank"), model=self.model_name,
            usage=api.RerankUsage(total_tokens=sum(len(pair) for pair in ids)),
            results=[api.RerankResult(
                index=i, relevance_score=scores[i],
                document=api.RerankDocument(text=documents[i]) if req.return_documents else None)
                for i in order])
