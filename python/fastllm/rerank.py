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
  once and reused by all its documents through the paged KV cache's prefix sharing. The shared
  part is the pairs' longest common *token* prefix, found after tokenizing each pair whole, so
  a tokenization that merges across the query/document boundary only shortens what is shared:
  the ids are always the recipe's.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastllm.kv_cache import PagedKVCache
from fastllm.model_pool import load
from fastllm.model_runner import run_step
from fastllm.tokenizer import Tokenizer

__all__ = ["DEFAULT_INSTRUCTION", "RECIPE_PREFIX", "RECIPE_SUFFIX", "RerankResult", "Reranker"]

RECIPE_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based "
                 "on the Query and the Instruct provided. Note that the answer can only be "
                 "\"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RECIPE_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
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
        model: a Hugging Face folder (config.json, *.safetensors, tokenizer files) or ``.gguf``.
        dtype, device: as in :class:`fastllm.LLM` (the model comes from :func:`fastllm.load`).
        instruction: the task instruction; default the model card's web-search one.
        max_length: the most tokens of a wrapped pair; longer documents are cut at the end.
        max_num_batched_tokens: tokens computed per forward step (a longer pair runs alone).
        block_size: tokens per KV-cache block; the shared part is reused in whole blocks.
    """

    def __init__(self, model: str | os.PathLike, *, dtype: str | torch.dtype = "float32",
                 device: str | torch.device = "cpu", instruction: str | None = None,
                 max_length: int = 8192, max_num_batched_tokens: int = 4096,
                 block_size: int = 16) -> None:
        self.model = load(model, dtype, device)
        self.device = torch.device(device)
        self.tokenizer = Tokenizer.from_pretrained(model)
        self.instruction = DEFAULT_INSTRUCTION if instruction is None else instruction
        if not isinstance(self.instruction, str):
            raise TypeError(f"instruction must be a str, got {type(instruction).__name__}")
        self.prefix_ids = self.tokenizer.encode(RECIPE_PREFIX, add_special_tokens=False)
        self.suffix_ids = self.tokenizer.encode(RECIPE_SUFFIX, add_special_tokens=False)
        wrap = len(self.prefix_ids) + len(self.suffix_ids)
        if not isinstance(max_length, int) or max_length <= wrap:
            raise ValueError(f"max_length must be an int above the {wrap} tokens of the recipe's "
                             f"prefix and suffix, got {max_length!r}")
        if max_length > self.model.config.max_position_embeddings:
            raise ValueError(f"max_length={max_length} exceeds the model's context "
                             f"({self.model.config.max_position_embeddings})")
        if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be an int >= 1, got "
                             f"{max_num_batched_tokens!r}")
        self.max_length = max_length
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        answer_ids = []
        for answer in ("no", "yes"):
            token_id = self.tokenizer.convert_tokens_to_ids(answer)
            if token_id is None or token_id == self.tokenizer.unk_token_id:
                raise ValueError(f"the tokenizer has no token {answer!r}: not a Qwen3-Reranker "
                                 "tokenizer")
            answer_ids.append(token_id)
        self.answer_ids = torch.tensor(answer_ids, device=self.device)  # [no, yes]
        self._kv_cache: PagedKVCache | None = None

    # ---- public API --------------------------------------------------------------------------

    def pair_token_ids(self, query: str, document: str) -> list[int]:
        """The recipe's token ids for one pair: prefix, the truncated pair text, suffix."""
        text = f"<Instruct>: {self.instruction}\n<Query>: {query}\n<Document>: {document}"
        room = self.max_length - len(self.prefix_ids) - len(self.suffix_ids)
        ids = self.tokenizer.encode(text, add_special_tokens=False)[:room]
        return self.prefix_ids + ids + self.suffix_ids

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

    def _batches(self, ids: list[list[int]], shared: int) -> list[list[int]]:
        """Pair indices grouped longest first, each group's new tokens within the budget."""
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        batches: list[list[int]] = []
        tokens = 0
        for i in order:
            new = len(ids[i]) - shared
            if batches and tokens + new <= self.max_num_batched_tokens:
                batches[-1].append(i)
                tokens += new
            else:
                batches.append([i])
                tokens = new
        return batches

    def _cache(self, num_blocks: int) -> PagedKVCache:
        """The KV pool, grown when a query needs more blocks than it has."""
        if self._kv_cache is None or self._kv_cache.num_blocks < num_blocks:
            self._kv_cache = None  # let the old pool go before the new one is allocated
            self._kv_cache = PagedKVCache(self.model.kv_cache_spec(self.block_size), num_blocks,
                                          device=self.device)
        return self._kv_cache

    def _score_shared(self, ids: list[list[int]]) -> list[float]:
        """Scores of one query's pairs: their common token prefix computed once (held by a
        sequence of its own, so its blocks stay put), then the rest in packed batches."""
        bs = self.block_size
        # At least one token of every pair is left to compute: it gives the pair's logits.
        shared = min(len(_common_prefix(ids)), min(len(x) for x in ids) - 1)
        reused = shared // bs * bs  # prefix sharing works in whole blocks
        batches = self._batches(ids, reused)
        per_batch = max(sum(math.ceil(len(ids[i]) / bs) - reused // bs for i in batch)
                        for batch in batches)
        cache = self._cache(math.ceil(shared / bs) + per_batch)
        manager = cache.block_manager
        prefix_seq = -1
        scores = [0.0] * len(ids)
        try:
            if reused:
                computed = manager.allocate(prefix_seq, ids[0][:reused])
                if computed < reused:
                    run_step(self.model, cache, [prefix_seq], [ids[0][computed:reused]],
                             logits=False)
            for batch in batches:
                starts: list[int] = []  # per allocated pair: its tokens found in the cache
                try:
                    for i in batch:
                        starts.append(manager.allocate(i, ids[i]))
                    logits = run_step(self.model, cache, batch,
                                      [ids[i][start:] for i, start in zip(batch, starts)],
                                      logit_token_ids=self.answer_ids)  # [B, 2]: no, yes
                    yes = torch.log_softmax(logits.float(), dim=-1)[:, 1].exp().tolist()
                finally:
                    for i in batch[:len(starts)]:
                        manager.free(i)
                for i, score in zip(batch, yes):
                    scores[i] = score
        finally:
            if reused:
                manager.free(prefix_seq)
        return scores


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
