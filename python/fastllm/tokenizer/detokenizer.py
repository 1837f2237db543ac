"""Incremental detokenization: :class:`IncrementalDetokenizer` emits text deltas whose
concatenation, after :meth:`IncrementalDetokenizer.flush`, equals
:meth:`~fastllm.tokenizer.Tokenizer.decode` of the same ids; a character split over tokens is
emitted once it is complete."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from fastllm.tokenizer.base import _Backend
from fastllm.tokenizer.token_ids import as_token_ids

__all__ = ["IncrementalDetokenizer"]

# Prompt tokens an incremental detokenizer keeps as context: enough for the leading-space rule
# and for a character split over tokens.
_CONTEXT_TOKENS = 6


class _HasBackend(Protocol):
    """A :class:`~fastllm.tokenizer.Tokenizer` as the detokenizer reads it."""

    _backend: _Backend


class IncrementalDetokenizer:
    """Turns one request's generated tokens into text deltas, one token at a time.

    ``"".join(add(t) for t in ids) + flush() == tokenizer.decode(ids)`` for any ids: a
    character split over byte tokens is emitted once complete (never as U+FFFD that a later
    token completes), sentencepiece's leading space is stripped at the start as ``decode``
    does, and special tokens are dropped when ``skip_special_tokens``.

    With ``prompt_ids``, the last few prompt tokens are decoding context: the deltas then
    continue the prompt's text, so ``decode(prompt + ids)[len(decode(prompt)):]`` (e.g. the
    space a sentencepiece token carries at the start of the answer is kept), as vLLM streams.

    tokenizer.json backends use ``tokenizers.decoders.DecodeStream``; the sentencepiece and
    GGUF backends a window of the last tokens; either way the work per token is bounded.
    """

    def __init__(self, tokenizer: _HasBackend, *, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] | None = None):
        backend = self._backend = tokenizer._backend
        prompt = as_token_ids(prompt_ids or [], what="prompt_ids")
        context = prompt[-_CONTEXT_TOKENS:]
        # Once per request, O(prompt): where the context stands (sentencepiece's start rule).
        at_start = backend.still_at_start(prompt[:-_CONTEXT_TOKENS], skip_special_tokens, True)
        self._stream = backend.new_stream(skip_special_tokens, context, at_start)

    def add(self, token_id: int) -> str:
        """Adds one generated token; returns the text it completes ("" while held back). An id
        the tokenizer does not know (past ``len(tokenizer)``) adds nothing, as in ``decode``;
        a bad id is an error, as in ``decode``."""
        token_id, = as_token_ids([token_id])
        if self._backend.id_to_token(token_id) is None:
            return ""
        return self._stream.step(token_id)

    def add_many(self, token_ids: Iterable[int]) -> str:
        """Adds several tokens; returns the concatenation of their deltas."""
        return "".join(self.add(t) for t in as_token_ids(token_ids))

    def flush(self) -> str:
        """At the end of the request: the held-back text (an incomplete character decodes as
        U+FFFD, exactly as ``decode`` shows it)."""
        return self._stream.flush()
