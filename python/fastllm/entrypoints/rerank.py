"""``fastllm.Reranker``: Qwen3-Reranker scores, exactly the model card's recipe, computed fast.

The recipe: each (query, document) pair is written as
``<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {doc}``, tokenized without special
tokens, truncated at the end to ``max_length - len(prefix) - len(suffix)`` tokens, wrapped in a
fixed chat prefix and suffix, and run through the causal LM; the score is
``exp(log_softmax([logit("no"), logit("yes")])[1])`` at the last position.

What makes it fast, without changing a score:

- no padding: a query's documents run as one packed variable-length batch (longest first,
  under a token budget), with the causal mask kept (the model is a causal LM: its scores change
  without it);
- the LM head runs at each pair's last position only, and only for the two rows "no" and "yes";
- the tokens every pair of a query shares (the prefix, the instruction, the query) are computed
  once and reused by all its documents through the engine's ordinary prefix caching. The shared
  part is the pairs' longest common *token* prefix, found after tokenizing each pair whole, so
  a tokenization that merges across the query/document boundary only shortens what is shared:
  the ids are always the recipe's.

Pairs are prompt-only requests of the same engine that generates text (continuous batching under
its token budget): each finishes once its prompt is computed, with its two logits.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastllm.entrypoints.client import EngineClient
from fastllm.hub import resolve_model
from fastllm.models.pool import load
from fastllm.tokenizer import Tokenizer

__all__ = ["DEFAULT_INSTRUCTION", "RECIPE_PREFIX", "RECIPE_SUFFIX", "RerankRecipe", "RerankResult",
           "Reranker", "relevance", "shared_prefix_length"]

RECIPE_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based "
                 "on the Query and the Instruct provided. Note that the answer can only be "
                 "\"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RECIPE_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
# Pairs run while the token budget and the KV pool last; this only bounds the bookkeeping.
_MAX_PAIRS_PER_STEP = 256

DEFAULT_INSTRUCTION = ("Given a web search query, retrieve relevant passages that answer the "
                       "query")


@dataclass
class RerankResult:
    """One document's place in a ranking: its index in the input, its score, its text."""

    index: int
    score: float
    document: str


class Reranker:
    """Scores documents against queries with a Qwen3-Reranker checkpoint.

    Args:
        model: a Hugging Face folder (config.json, *.safetensors, tokenizer files), a ``.gguf``
            file or a hub name (as :class:`fastllm.LLM` takes it).
        revision: the hub model's branch, tag or commit.
        dtype, device: as in :class:`fastllm.LLM` (the model comes from :func:`fastllm.load`).
        instruction: the task instruction; default the model card's web-search one.
        max_length: the most tokens of a wrapped pair; longer documents are cut at the end.
        max_num_batched_tokens: tokens computed per forward step (a longer pair is prefilled
            over several).
        block_size: tokens per KV-cache block; the shared part is reused in whole blocks.
        kv_cache_memory, kv_cache_dtype: the KV pool's bytes and storage dtype, as in
            :class:`fastllm.LLM`.
    """

    def __init__(self, model: str | os.PathLike, *, revision: str | None = None,
                 dtype: str | torch.dtype = "float32",
                 device: str | torch.device = "cpu", instruction: str | None = None,
                 max_length: int = 8192, max_num_batched_tokens: int = 4096,
                 block_size: int = 16, kv_cache_memory: int | None = None,
                 kv_cache_dtype: str | torch.dtype = "auto") -> None:
        model = resolve_model(model, revision)
        context = load(model, dtype, device).config.max_position_embeddings
        valid_length = isinstance(max_length, int) and max_length >= 2  # checked fully below
        if valid_length and max_length > context:
            raise ValueError(f"max_length={max_length} exceeds the model's context ({context})")
        self.client = EngineClient(model, dtype=dtype, device=device,
                                   max_model_len=max_length if valid_length else None,
                                   kv_cache_memory=kv_cache_memory, block_size=block_size,
                                   max_num_seqs=_MAX_PAIRS_PER_STEP,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   kv_cache_dtype=kv_cache_dtype)
        self.model, self.tokenizer = self.client.model, self.client.tokenizer
        self.recipe = RerankRecipe(self.tokenizer, instruction, max_length)
        self.instruction, self.max_length = self.recipe.instruction, max_length
        self.prefix_ids, self.suffix_ids = self.recipe.prefix_ids, self.recipe.suffix_ids
        self.answer_ids = self.recipe.answer_ids  # (no, yes)
        self.block_size = block_size

    # ---- public API --------------------------------------------------------------------------

    def pair_token_ids(self, query: str, document: str) -> list[int]:
        """The recipe's token ids for one pair: prefix, the truncated pair text, suffix."""
        return self.recipe.pair_token_ids(query, document)

    def score(self, query: str, documents: Sequence[str]) -> list[float]:
        """Each document's relevance to ``query`` in [0, 1], in input order."""
        return self.score_pairs([(query, document) for document in _documents(documents)])

    def rerank(self, query: str, documents: Sequence[str],
               top_n: int | None = None) -> list[RerankResult]:
        """The documents best first (ties keep input order), the ``top_n`` best if given."""
        documents = _documents(documents)
        if top_n is not None and (not isinstance(top_n, int) or top_n < 0):
            raise ValueError(f"top_n must be None or an int >= 0, got {top_n!r}")
        scores = self.score(query, documents)
        order = sorted(range(len(documents)), key=lambda i: -scores[i])
        return [RerankResult(i, scores[i], documents[i]) for i in order[:top_n]]

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """Scores of (query, document) pairs, in input order; pairs of one query share their
        common part."""
        by_query: dict[str, list[int]] = {}
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise TypeError(f"pairs[{i}] must be a (query, document) pair, got {pair!r}")
            query, document = pair
            for name, value in (("query", query), ("document", document)):
                if not isinstance(value, str):
                    raise TypeError(f"pairs[{i}]: the {name} must be a str, got "
                                    f"{type(value).__name__}")
            by_query.setdefault(query, []).append(i)
        scores: list[float] = [0.0] * len(pairs)
        with torch.inference_mode():
            for query, indices in by_query.items():
                ids = [self.pair_token_ids(query, pairs[i][1]) for i in indices]
                for i, score in zip(indices, self._score_shared(ids)):
                    scores[i] = score
        return scores

    # ---- the computation ---------------------------------------------------------------------

    def _score_shared(self, ids: list[list[int]]) -> list[float]:
        """Scores of one query's pairs: their common token prefix computed once (a prompt-only
        request whose full blocks enter the prefix cache), then every pair, longest first, as a
        prompt-only request giving its "no" and "yes" logits."""
        client = self.client
        reused = shared_prefix_length(ids, self.block_size)
        if reused:
            client.run([client.make_scoring_request(ids[0][:reused], ())])
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        requests = [client.make_scoring_request(ids[i], self.answer_ids) for i in order]
        client.run(requests)
        yes = relevance([request.scores for request in requests])
        scores = [0.0] * len(ids)
        for i, score in zip(order, yes):
            scores[i] = score
        return scores


class RerankRecipe:
    """The model card's recipe for one tokenizer: the fixed prefix and suffix, the ids of
    "no" and "yes", and each pair's token ids.

    Args:
        tokenizer: a Qwen3-Reranker tokenizer (one without "yes"/"no" tokens is a ValueError).
        instruction: the task instruction; None = the model card's web-search one.
        max_length: the most tokens of a wrapped pair; longer documents are cut at the end.
    """

    def __init__(self, tokenizer: Tokenizer, instruction: str | None = None,
                 max_length: int = 8192) -> None:
        self.tokenizer = tokenizer
        self.instruction = DEFAULT_INSTRUCTION if instruction is None else instruction
        if not isinstance(self.instruction, str):
            raise TypeError(f"instruction must be a str, got {type(instruction).__name__}")
        self.prefix_ids = tokenizer.encode(RECIPE_PREFIX, add_special_tokens=False)
        self.suffix_ids = tokenizer.encode(RECIPE_SUFFIX, add_special_tokens=False)
        wrap = len(self.prefix_ids) + len(self.suffix_ids)
        if not isinstance(max_length, int) or max_length <= wrap:
            raise ValueError(f"max_length must be an int above the {wrap} tokens of the recipe's "
                             f"prefix and suffix, got {max_length!r}")
        self.max_length = max_length
        answer_ids = []
        for answer in ("no", "yes"):
            token_id = tokenizer.convert_tokens_to_ids(answer)
            if token_id is None or token_id == tokenizer.unk_token_id:
                raise ValueError(f"the tokenizer has no token {answer!r}: not a Qwen3-Reranker "
                                 "tokenizer")
            answer_ids.append(token_id)
        self.answer_ids = tuple(answer_ids)  # (no, yes)

    def pair_token_ids(self, query: str, document: str) -> list[int]:
        """The recipe's token ids for one pair: prefix, the truncated pair text, suffix."""
        text = f"<Instruct>: {self.instruction}\n<Query>: {query}\n<Document>: {document}"
        room = self.max_length - len(self.prefix_ids) - len(self.suffix_ids)
        ids = self.tokenizer.encode(text, add_special_tokens=False)[:room]
        return self.prefix_ids + ids + self.suffix_ids


def shared_prefix_length(ids: list[list[int]], block_size: int) -> int:
    """How many leading tokens, in whole KV blocks, every pair shares and can reuse from the
    prefix cache; at least one token of every pair is left to compute (it gives the pair's
    logits)."""
    shared = min(len(_common_prefix(ids)), min(len(x) for x in ids) - 1)
    return shared // block_size * block_size


def relevance(answer_logits: Sequence[torch.Tensor]) -> list[float]:
    """Each pair's score from its ("no", "yes") logits: P("yes") over the two."""
    logits = torch.stack(list(answer_logits)).float()  # [n, 2]
    return torch.log_softmax(logits, dim=-1)[:, 1].exp().tolist()


def _common_prefix(ids: list[list[int]]) -> list[int]:
    first = ids[0]
    n = len(first)
    for other in ids[1:]:
        n = min(n, len(other))
        for j in range(n):
            if other[j] != first[j]:
                n = j
                break
    return first[:n]


def _documents(documents: Sequence[str]) -> list[str]:
    if isinstance(documents, str):
        raise TypeError("documents must be a list of str, got one str")
    documents = list(documents)
    for i, document in enumerate(documents):
        if not isinstance(document, str):
            raise TypeError(f"documents[{i}] must be a str, got {type(document).__name__}")
    return documents
