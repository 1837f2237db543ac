"""Structured output: a request's constraint (JSON schema, any JSON object, regex, choice, Lark
grammar) compiled by llguidance into a matcher that says, each step, which tokens may come
next.

The engine keeps one :class:`GrammarCompiler` per tokenizer (llguidance's view of the
vocabulary is built once, on the first constrained request) and one :class:`GrammarMatcher` per
constrained request. A step's constrained rows get their bitmasks filled on the host and applied
to the logits before penalties and the draw (:func:`fastllm.sampling.mask_tokens`); the other
rows of the batch are not touched.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import llguidance
import torch

from fastllm.sampling import StructuredOutputsParams
from fastllm.tokenizer import Tokenizer

__all__ = ["GrammarCompiler", "GrammarMatcher", "grammar_bitmask"]

# JSON as json.dumps writes it (", " and ": "), no other whitespace: a small model given free
# whitespace may spend its tokens on newlines.
_JSON_OPTIONS = {"whitespace_flexible": False}


class _TokenTable:
    """What ``llguidance.TokenizerWrapper`` reads: each id's bytes, the special ids and EOS,
    and a way to tokenize text."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        known = len(tokenizer)
        # Ids past the tokenizer (a model's padded vocabulary) are empty: never allowed.
        self.tokens = [(tokenizer.token_bytes(i) or b"") if i < known else b""
                       for i in range(vocab_size)]
        self.special_token_ids = [i for i in tokenizer.all_special_ids if i < vocab_size]
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        special = set(self.special_token_ids)
        self._ids_of = {data: i for i, data in enumerate(self.tokens)
                        if data and i not in special}
        self._longest = max(map(len, self._ids_of), default=1)
        # llguidance takes this tokenization as the text's own. A SentencePiece tokenizer
        # that adds a dummy prefix space does not give one: longest match instead.
        probe = '{"a": [1, true]}'
        self._encode_exact = b"".join(
            self.tokens[i] for i in tokenizer.encode(probe, add_special_tokens=False)
        ) == probe.encode()

    def __call__(self, text: str) -> list[int]:
        if self._encode_exact:
            return self._tokenizer.encode(text, add_special_tokens=False)
        data, ids, start = text.encode(), [], 0
        while start < len(data):
            for end in range(min(len(data), start + self._longest), start, -1):
                token_id = self._ids_of.get(data[start:end])
                if token_id is not None:
                    ids.append(token_id)
                    start = end
                    break
            else:
                raise ValueError(f"no token spells the byte {data[start]:#x}")
        return ids


@dataclass(frozen=True)
class _Vocabulary:
    """What llguidance's view of a tokenizer is built from; two are equal exactly when the
    views would be (the tokenizer itself is not compared: its vocabulary key is)."""

    tokenizer: Tokenizer = field(compare=False)
    key: object  # Tokenizer.vocabulary_key
    vocab_size: int
    eos: tuple[int, ...]
    eos_token_id: int | None
    bos_token_id: int | None


# Building one reads every token's bytes (slow for a vocabulary of 10^5 tokens), and every ``LLM``
# of a model loads the same vocabulary: an engine after the first finds it here. An LLTokenizer
# is immutable, so engines share it. The 4 used last are kept.
@functools.lru_cache(maxsize=4)
def _ll_tokenizer(vocabulary: _Vocabulary) -> llguidance.LLTokenizer:
    table = _TokenTable(vocabulary.tokenizer, vocabulary.vocab_size)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(table),
                                  n_vocab=vocabulary.vocab_size, eos_token=list(vocabulary.eos))


class GrammarCompiler:
    """Turns :class:`~fastllm.sampling.StructuredOutputsParams` into matchers for one tokenizer
    and a model's vocabulary size."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        eos = tokenizer.eos_token_ids or [tokenizer.eos_token_id]
        if eos == [None]:
            raise ValueError("structured output needs a tokenizer with an end-of-sequence token")
        self.vocab_size = vocab_size
        self.tokenizer = _ll_tokenizer(_Vocabulary(
            tokenizer, tokenizer.vocabulary_key, vocab_size, tuple(eos),
            tokenizer.eos_token_id, tokenizer.bos_token_id))

    def grammar(self, params: StructuredOutputsParams) -> str:
        """llguidance's grammar text for ``params``; a ValueError for a schema that is not
        JSON."""
        if params.json is not None:
            schema = params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as error:
                    raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema must be an object, got {schema!r}")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if params.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                 defaults=_JSON_OPTIONS)
        if params.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if params.choice is not None:
            return llguidance.LLMatcher.grammar_from_regex(
                "|".join(f"(?:{re.escape(choice)})" for choice in params.choice))
        return llguidance.LLMatcher.grammar_from_lark(params.grammar)

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for one request; an invalid schema, regex or grammar is a
        ValueError saying what llguidance found."""
        grammar = self.grammar(params)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer)
        if is_error:
            raise ValueError(f"invalid structured output constraint: {messages[0]}")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid structured output constraint: {matcher.get_error()}")
        return GrammarMatcher(matcher, self.vocab_size)


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.words = (vocab_size + 31) // 32  # int32 words of one bitmask row

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Writes the allowed next tokens into ``row`` (int32 ``[words]``, contiguous, on the
        host)."""
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def advance(self, token_id: int) -> bool:
        """Takes a sampled token; returns whether the constraint is complete (nothing may
        follow). A token the grammar does not allow is a ValueError."""
        if not self._matcher.consume_token(token_id):
            raise ValueError(f"token {token_id} breaks the structured output constraint: "
                             f"{self._matcher.get_error()}")
        return self._matcher.is_stopped()


def grammar_bitmask(matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
    """The int32 ``[len(matchers), words]`` bitmask of the matchers' next allowed tokens."""
    bitmask = torch.empty(len(matchers), matchers[0].words, dtype=torch.int32)
    for row, matcher in enumerate(matchers):
        matcher.fill_bitmask(bitmask[row])
    return bitmask
