"""The checks every backend's input goes through, so that all of them reject the same things with
the same errors: token ids (ints, in range) and text (encodable as UTF-8)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["MAX_TOKEN_ID", "as_token_ids", "check_text"]

MAX_TOKEN_ID = 2**32 - 1  # every backend stores ids as uint32


def as_token_ids(ids: Any, *, limit: int = MAX_TOKEN_ID + 1, what: str = "token ids") -> list[int]:
    """``ids`` as a list of Python ints, each in ``[0, limit)``.

    ``ids`` is an iterable of ints (NumPy integers too), or a 1-D integer tensor or array.
    Anything else is a ``TypeError`` naming its type: a str, bytes, a dict, floats, bools, a
    2-D tensor. An id out of range is a ``ValueError`` naming it and its position.
    """
    if isinstance(ids, (str, bytes, bytearray, memoryview, Mapping)):
        raise TypeError(f"{what} must be a sequence of ints, got {type(ids).__name__}")
    if hasattr(ids, "tolist") and hasattr(ids, "ndim"):  # a tensor or an array
        if ids.ndim != 1:
            raise TypeError(f"{what} must be 1-D, got a {type(ids).__name__} of shape "
                            f"{tuple(ids.shape)}")
        ids = ids.tolist()
    elif not isinstance(ids, Iterable):
        raise TypeError(f"{what} must be a sequence of ints, got {type(ids).__name__}")
    checked = []
    for position, token_id in enumerate(ids):
        if type(token_id) is not int:
            if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
                raise TypeError(f"{what} must be ints, got {type(token_id).__name__} "
                                f"{token_id!r} at position {position}")
            token_id = int(token_id)
        if not 0 <= token_id < limit:
            raise ValueError(f"{what}[{position}] = {token_id} is outside [0, {limit})")
        checked.append(token_id)
    return checked


def check_text(text: Any) -> str:
    """``text`` if it is a str that UTF-8 can encode; a ``TypeError`` for another type, a
    ``ValueError`` naming the position of a lone surrogate (which no tokenizer can encode)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(f"text has a lone surrogate {text[error.start]!r} at position "
                             f"{error.start}, which UTF-8 cannot encode") from None
    return text
