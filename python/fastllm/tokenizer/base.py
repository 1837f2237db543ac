"""The interface every tokenizer backend implements: encode, decode, the vocabulary, and a stream
for incremental detokenization."""

from __future__ import annotations

from collections.abc import Sequence

from fastllm.tokenizer.detokenizer import _WindowStream
from fastllm.tokenizer.utf8 import _incomplete_utf8_tail

_SPACE = "\u2581"  # sentencepiece's "▁"


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
