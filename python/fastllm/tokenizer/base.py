"""The interface every tokenizer backend implements: encode, decode, the vocabulary, and a stream
for incremental detokenization."""

from __future__ import annotations

import os
from collections.abc import Sequence

from fastllm.tokenizer.utf8 import _REPLACEMENT, _incomplete_utf8_tail

_SPACE = "\u2581"  # sentencepiece's "▁"
# Tokens a stream may hold back (where bytes cannot tell) before it emits what it has.
_MAX_HELD = 8


class _Backend:
    kind: str
    special_ids: frozenset[int]  # ids that skip_special_tokens drops

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool, at_start: bool = True) -> str:
        """``at_start=False`` decodes ids from the middle of a sequence (only sentencepiece's
        decoding depends on it: it drops the "▁" of the first pieces of a text)."""
        raise NotImplementedError

    def still_at_start(self, ids: Sequence[int], skip_special_tokens: bool,
                       at_start: bool) -> bool:
        """Whether, after ``ids``, decoding is still at the start of the text (in the sense of
        ``decode``'s ``at_start``)."""
        return False

    def token_to_id(self, token: str) -> int | None:
        raise NotImplementedError

    def id_to_token(self, token_id: int) -> str | None:
        raise NotImplementedError

    def size(self, with_added_tokens: bool = True) -> int:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes a token adds to the decoded byte stream, or None where that is unknown."""
        return None

    @property
    def vocabulary_key(self) -> object:
        """The same object for two backends exactly when they encode text and spell tokens
        alike: by default the backend itself."""
        return self

    def new_stream(self, skip_special_tokens: bool, context: list[int], at_start: bool):
        return _WindowStream(self, skip_special_tokens, context, at_start=at_start)

    def incomplete_tail(self, ids: Sequence[int], skip_special_tokens: bool) -> bool | None:
        """Whether the decoded text of ``ids`` ends with an incomplete character that a later
        token may complete; None where the backend cannot tell from bytes."""
        tail = bytearray()
        for token_id in reversed(ids):
            if skip_special_tokens and token_id in self.special_ids:
                continue  # dropped before decoding: transparent
            data = self.token_bytes(token_id)
            if data is None:
                return None
            tail[:0] = data
            if len(tail) >= 3:
                break
        return _incomplete_utf8_tail(bytes(tail))


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
