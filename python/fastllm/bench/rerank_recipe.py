"""The Qwen3-Reranker model card's recipe in plain HF transformers: the peer that
:class:`fastllm.Reranker` is tested against (``tests/entrypoints/test_rerank.py``) and measured
against (``benchmarks/bench_rerank.py``).

The card's ``format_instruction`` + ``process_inputs``: each pair's text tokenized without
special tokens, truncated to ``max_length`` minus the prefix and suffix, wrapped in them, the
batch left-padded (the tokenizer must be loaded with ``padding_side="left"``); then its
``compute_logits``: the causal LM over the padded batch (full logits at every position), the
last position's ``no`` and ``yes`` logits, ``exp(log_softmax(...)[yes])``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastllm.entrypoints.rerank import DEFAULT_INSTRUCTION, RECIPE_PREFIX, RECIPE_SUFFIX

__all__ = ["RECIPE_MAX_LENGTH", "recipe_ids", "recipe_scores"]

RECIPE_MAX_LENGTH = 8192  # the model card's max_length


def recipe_ids(tokenizer, query: str, documents: Sequence[str], *,
               instruction: str = DEFAULT_INSTRUCTION,
               max_length: int = RECIPE_MAX_LENGTH) -> list[list[int]]:
    """The model card's format_instruction + process_inputs, before padding: one id list per
    document."""
    prefix = tokenizer.encode(RECIPE_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(RECIPE_SUFFIX, add_special_tokens=False)
    pairs = [f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
             for doc in documents]
    inputs = tokenizer(pairs, padding=False, truncation="longest_first",
                       return_attention_mask=False,
                       max_length=max_length - len(prefix) - len(suffix))
    return [prefix + ids + suffix for ids in inputs["input_ids"]]


def recipe_scores(model: torch.nn.Module, tokenizer, query: str, documents: Sequence[str], *,
                  instruction: str = DEFAULT_INSTRUCTION,
                  max_length: int = RECIPE_MAX_LENGTH) -> list[float]:
    """The model card's compute_logits on one left-padded batch of ``documents``: each one's
    score in [0, 1], in order."""
    inputs = tokenizer.pad({"input_ids": recipe_ids(tokenizer, query, documents,
                                                    instruction=instruction,
                                                    max_length=max_length)},
                           padding=True, return_tensors="pt")
    inputs = {key: value.to(model.device) for key, value in inputs.items()}
    with torch.no_grad():
        logits = model(**inputs).logits[:, -1, :]  # [batch, vocab]
    no, yes = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    pair = torch.stack([logits[:, no], logits[:, yes]], dim=1)  # [batch, 2]
    return torch.nn.functional.log_softmax(pair, dim=1)[:, 1].exp().tolist()
