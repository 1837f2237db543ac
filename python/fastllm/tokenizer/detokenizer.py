"""Incremental detokenization: :class:`IncrementalDetokenizer` emits text deltas whose
concatenation, after :meth:`IncrementalDetokenizer.flush`, equals
:meth:`~fastllm.tokenizer.Tokenizer.decode` of the same ids; a character split over tokens is
emitted once it is complete."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import tokenizers

from fastllm.tokenizer.token_ids import as_token_ids
from fastllm.tokenizer.utf8 import _REPLACEMENT

if TYPE_CHECKING:
    from fastllm.tokenizer.base import _Backend
    from fastllm.tokenizer.hf_tokenizers import _TokenizersBackend
    from fastllm.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

# Prompt tokens an incremental detokenizer keeps as context: enough for the leading-space rule
# and for a character split over tokens.
_CONTEXT_TOKENS = 6
# Tokens a DecodeStream may hold back before the exact Python window takes over.
_MAX_HELD = 8


class _WindowStream:
    """The windowed incremental decode (vLLM's and ``DecodeStream``'s algorithm): decode the
    tokens since the last emission together with the group emitted before them, and emit what
    that adds to the group's text. Text ending in U+FFFD is held back while the bytes say a
    later token can still complete the character, so held text is at most 3 bytes long and the
    work per token is bounded. Where a backend cannot tell from bytes, up to ``_MAX_HELD``
    tokens are held."""

    def __init__(self, backend: _Backend, skip_special_tokens: bool, context: list[int],
                 pending: list[int] | None = None, at_start: bool = True):
        self.backend = backend
        self.skip = skip_special_tokens
        self.ids = list(context) + list(pending or [])
        self.read = len(context)
        self.at_start = at_start  # whether self.ids starts the text (see _Backend.decode)
        self.prefix = backend.decode(context, skip_special_tokens, at_start)

    def step(self, token_id: int | None = None) -> str:
        if token_id is not None:
            if self.skip and token_id in self.backend.special_ids:
                return ""  # dropped before decoding anyway; keeps the window small
            self.ids.append(token_id)
        text = self.backend.decode(self.ids, self.skip, self.at_start)
        if len(text) <= len(self.prefix):
            return ""
        if text.endswith(_REPLACEMENT):
            incomplete = self.backend.incomplete_tail(self.ids, self.skip)
            if incomplete or (incomplete is None and len(self.ids) - self.read < _MAX_HELD):
                return ""
        return self._emit(text)

    def flush(self) -> str:
        if self.read == len(self.ids):
            return ""
        return self._emit(self.backend.decode(self.ids, self.skip, self.at_start))

    def _emit(self, text: str) -> str:
        # text extends prefix except after a prompt that ended inside a character.
        common = len(self.prefix) if text.startswith(self.prefix) else len(
            os.path.commonprefix([text, self.prefix]))
        delta = text[common:]
        self.at_start = self.backend.still_at_start(self.ids[:self.read], self.skip, self.at_start)
        self.ids = self.ids[self.read:]
        self.read = len(self.ids)
        self.prefix = self.backend.decode(self.ids, self.skip, self.at_start)
        return delta


class _TokenizersStream:
    """``tokenizers.decoders.DecodeStream``, plus what it lacks: ``flush`` (text still held at
    the end of a request) and a bound on what it holds. It mirrors which ids DecodeStream keeps
    (the group it emitted last, then the held ones) and hands them to the Python window when
    DecodeStream has held ``_MAX_HELD`` tokens (a stream of invalid bytes, which DecodeStream
    would hold forever) or raises (a decoder whose output is not prefix-stable)."""

    def __init__(self, backend: _TokenizersBackend, skip_special_tokens: bool, context: list[int]):
        self.backend = backend
        self.skip = skip_special_tokens
        self.context, self.held = list(context), []
        self.window: _WindowStream | None = None
        self.ds = None
        # DecodeStream takes a prefill only when its text does not end inside a character.
        if not context or not backend.decode(context, skip_special_tokens).endswith(_REPLACEMENT):
            self.ds = tokenizers.decoders.DecodeStream(ids=context or None,
                                                       skip_special_tokens=skip_special_tokens)
        else:
            self.window = _WindowStream(backend, skip_special_tokens, context)

    def step(self, token_id: int) -> str:
        if self.window is not None:
            return self.window.step(token_id)
        try:
            out = self.ds.step(self.backend.tk, token_id)
        except Exception:  # DecodeStream's InvalidPrefix: fall back, from the same state
            self.window = _WindowStream(self.backend, self.skip, self.context,
                                        self.held + [token_id])
            return self.window.step()
        if out is None:
            self.held.append(token_id)
            if len(self.held) >= _MAX_HELD:
                self.window = _WindowStream(self.backend, self.skip, self.context, self.held)
                return self.window.step()
            return ""
        self.context, self.held = self.held + [token_id], []
        return out

    def flush(self) -> str:
        if self.window is None:
            self.window = _WindowStream(self.backend, self.skip, self.context, self.held)
        return self.window.flush()


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

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
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
