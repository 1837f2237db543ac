"""``POST /v1/embeddings``: OpenAI's embeddings shape over a decoder model, each input a
prompt-only request of the server's running batch whose final hidden states are pooled (the
server's ``--pooling``: the last token's, as Qwen3-Embedding and other decoder embedders are
read, or the mean) and L2-normalized, as vLLM's pooling runner serves them."""

from __future__ import annotations

import asyncio
import base64

import torch

from fastllm.entrypoints.async_llm import AsyncLLM
from fastllm.entrypoints.openai import protocol as api
from fastllm.entrypoints.openai.serving import APIError, OpenAIServing

__all__ = ["EmbeddingServing"]


class EmbeddingServing:
    """Embeds inputs with the served model."""

    def __init__(self, llm: AsyncLLM, serving: OpenAIServing, pooling: str) -> None:
        self.llm, self.serving, self.pooling = llm, serving, pooling
        self.hidden_size = llm.client.model.config.hidden_size

    async def embed(self, req: api.EmbeddingRequest) -> api.EmbeddingResponse:
        lora = self.serving.check_model(req.model)
        if req.dimensions is not None and req.dimensions != self.hidden_size:
            raise APIError(400, f"dimensions: this model's embeddings have {self.hidden_size} "
                                f"dimensions and cannot be shortened, got {req.dimensions}",
                           param="dimensions")
        prompts = [ids for _, ids in self.serving.completion_prompts(req.input, "input")]
        for ids in prompts:
            if len(ids) > self.serving.max_model_len:
                raise APIError(400, f"an input has {len(ids)} tokens, more than the model's "
                                    f"context ({self.serving.max_model_len})", param="input")
        self.serving.check_capacity(len(prompts))
        tasks = [asyncio.ensure_future(self.llm.embed(ids, self.pooling, lora_request=lora))
                 for ids in prompts]
        try:
            embeddings = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        tokens = sum(len(ids) for ids in prompts)
        return api.EmbeddingResponse(
            model=self.serving.response_model(req.model),
            usage=api.EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
            data=[api.EmbeddingData(index=i, embedding=_encoded(e, req.encoding_format))
                  for i, e in enumerate(embeddings)])


def _encoded(embedding: torch.Tensor, encoding_format: str) -> list[float] | str:
    values = embedding.to(device="cpu", dtype=torch.float32)
    if encoding_format == "float":
        return values.tolist()
    return base64.b64encode(values.numpy().astype("<f4").tobytes()).decode("ascii")
