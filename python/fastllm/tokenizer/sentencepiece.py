"""``tokenizer.model`` through the ``sentencepiece`` library, and sentencepiece's decoding rules
(which GGUF "llama" vocabularies share).

Sentencepiece and HF: transformers 5 no longer runs sentencepiece; it converts a
``tokenizer.model`` into a ``tokenizers`` BPE on the fly, and that conversion differs from
sentencepiece (and from llama.cpp) on text that starts with whitespace, on runs of spaces, and on
models trained with ``remove_extra_whitespaces``. This module follows sentencepiece there; it
follows HF in parsing special tokens written in the text (``"<s>"``, ``"</s>"``) and in
``skip_special_tokens``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from fastllm.tokenizer.base import _SPACE, _Backend
from fastllm.tokenizer.utf8 import _decode_bytes_per_byte

# Sentencepiece piece types (sentencepiece_model.proto), also GGUF's tokenizer.ggml.token_type.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


class _SentencePieceLike(_Backend):
    """Shared by the sentencepiece backend and the GGUF "llama" backend: the piece table, the
    special tokens, and decoding with sentencepiece's exact rules (``DecodeSentencePiece`` and
    ``ProcessBytePieces`` in sentencepiece_processor.cc)."""

    add_dummy_prefix: bool
    remove_extra_whitespaces: bool

    def _init_pieces(self, pieces: list[str], types: list[int], extra: dict[int, str],
                     extra_special: set[int]):
        self.pieces = pieces
        self.byte_of = [int(p[3:5], 16) if t == _BYTE else -1 for p, t in zip(pieces, types)]
        self.extra = extra  # added tokens past the model's pieces: id -> content
        self.piece_to_id = {p: i for i, p in enumerate(pieces)}
        specials = {i for i, t in enumerate(types) if t in (_CONTROL, _UNKNOWN)}
        self.special_ids = frozenset(specials | extra_special)

    def token_to_id(self, token):
        token_id = self.piece_to_id.get(token)
        if token_id is None:
            token_id = next((i for i, c in self.extra.items() if c == token), None)
        return token_id

    def id_to_token(self, token_id):
        if 0 <= token_id < len(self.pieces):
            return self.pieces[token_id]
        return self.extra.get(token_id)

    def size(self, with_added_tokens=True):
        return len(self.pieces) + (len(self.extra) if with_added_tokens else 0)

    def token_bytes(self, token_id):
        if token_id in self.extra:
            return self.extra[token_id].encode()
        if self.byte_of[token_id] >= 0:
            return bytes([self.byte_of[token_id]])
        if token_id in self.special_ids:
            return self.pieces[token_id].encode()  # a literal when not skipped
        return self.pieces[token_id].replace(_SPACE, " ").encode()

    def decode(self, ids, skip_special_tokens, at_start=True):
        ids = self._known(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self._decode_pieces(ids, at_start)[0]

    def still_at_start(self, ids, skip_special_tokens, at_start):
        # _decode_pieces(ids, at_start)[1], stopping at the first text (usually the first id).
        strip = self.add_dummy_prefix or self.remove_extra_whitespaces
        bos_ws_seen = False
        for i in ids:
            if not at_start or bos_ws_seen:
                return False
            if skip_special_tokens and i in self.special_ids:
                continue
            if i in self.special_ids or i in self.extra or self.byte_of[i] >= 0:
                return False  # a literal, or a byte: text
            piece = self.pieces[i]
            if strip and piece.startswith(_SPACE):
                piece = piece[1:]
                bos_ws_seen = not self.remove_extra_whitespaces
            if piece:
                return False
        return at_start and not bos_ws_seen

    def _known(self, ids) -> list[int]:
        """The ids the vocabulary has; others decode to nothing, as in HF."""
        ids, n = list(ids), len(self.pieces)
        if ids and (min(ids) < 0 or max(ids) >= n):
            ids = [i for i in ids if 0 <= i < n or i in self.extra]
        return ids

    def _decode_pieces(self, ids: list[int], at_start: bool = True) -> tuple[str, bool]:
        """Sentencepiece's decode, and whether the text is still at its start afterwards.
        Special tokens still in ``ids`` come out as their literal text (as in HF), not as
        sentencepiece's empty string or unk surface."""
        text: list[str] = []
        run = bytearray()
        # sentencepiece's flags: strip the "▁" of a piece while the text is still empty, and
        # only one of them unless remove_extra_whitespaces.
        is_bos_ws, bos_ws_seen = at_start, False
        strip = self.add_dummy_prefix or self.remove_extra_whitespaces
        for i in ids:
            if i < len(self.byte_of) and self.byte_of[i] >= 0:
                run.append(self.byte_of[i])
                continue
            if run:
                text.append(_decode_bytes_per_byte(run))
                run.clear()
            if bos_ws_seen or text:  # only non-empty pieces are kept
                is_bos_ws = False
            if i in self.special_ids or i in self.extra:
                piece, bos_ws_seen = self.id_to_token(i), False
            else:
                piece, bos_ws_seen = self.pieces[i], False
                if is_bos_ws and strip and piece.startswith(_SPACE):
                    piece = piece[1:]
                    bos_ws_seen = not self.remove_extra_whitespaces
                piece = piece.replace(_SPACE, " ")
            if piece:
                text.append(piece)
        if run:
            text.append(_decode_bytes_per_byte(run))
        return "".join(text), is_bos_ws and not (bos_ws_seen or text)


class _SentencePieceBackend(_SentencePieceLike):
    """``tokenizer.model`` through the ``sentencepiece`` library."""

    kind = "sentencepiece"

    def __init__(self, model_file: Path, added_tokens: list[dict], legacy: bool,
                 add_prefix_space: bool):
        import sentencepiece

        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{model_file} is not a valid sentencepiece model: {e}") from e
        n = self.sp.get_piece_size()
        pieces = [self.sp.id_to_piece(i) for i in range(n)]
        types = [_CONTROL if self.sp.is_control(i) else _UNKNOWN if self.sp.is_unknown(i)
                 else _BYTE if self.sp.is_byte(i) else _UNUSED if self.sp.is_unused(i)
                 else _NORMAL for i in range(n)]
        normalizer = _sentencepiece_normalizer_spec(model_file.read_bytes())
        self.add_dummy_prefix = normalizer.get(3, 1) != 0
        self.remove_extra_whitespaces = normalizer.get(4, 1) != 0
        # Added tokens of tokenizer_config.json that the model lacks get ids past its pieces.
        extra, special, self.split_tokens = {}, set(), {}
        for entry in added_tokens:
            token_id, content = entry["id"], entry["content"]
            if token_id >= n:
                extra[token_id] = content
            if entry.get("special", True):
                special.add(token_id)
            self.split_tokens[content] = (token_id, entry)
        self._init_pieces(pieces, types, extra, special)
        self.mark_special([])
        self.legacy = legacy
        self.add_prefix_space = add_prefix_space
        self._unk_prefix_len = len(self.sp.encode(self.sp.id_to_piece(self.sp.unk_id())))
        self.add_bos = self.add_eos = False
        self.bos_id = self.eos_id = None

    def mark_special(self, tokens: Iterable[str]):
        """Makes ``tokens`` (the config's named special tokens) special: matched whole in text
        and dropped by skip_special_tokens. Control and unknown pieces always are."""
        ids = {self.token_to_id(t) for t in tokens} - {None}
        self.special_ids = frozenset(self.special_ids | ids)
        for i in sorted(self.special_ids):
            self.split_tokens.setdefault(self.id_to_token(i), (i, {}))
        self._split_re = _added_tokens_regex(self.split_tokens)

    def _encode_segment(self, text: str, prefix: bool) -> list[int]:
        if prefix or not self.add_dummy_prefix:
            return self.sp.encode(text)
        # No dummy prefix for this segment: HF's trick, encode after "<unk>" and drop it.
        return self.sp.encode(self.sp.id_to_piece(self.sp.unk_id()) + text)[self._unk_prefix_len:]

    def encode(self, text, add_special_tokens):
        ids: list[int] = []
        for k, (segment, token_id) in enumerate(_split_added(text, self._split_re,
                                                            self.split_tokens)):
            if token_id is not None:
                ids.append(token_id)
            elif segment:
                # Each segment gets sentencepiece's dummy prefix as llama.cpp gives it, unless
                # the config says legacy=False (no prefix after a special token) or
                # add_prefix_space=False.
                prefix = self.add_prefix_space and (self.legacy or k == 0)
                ids.extend(self._encode_segment(segment, prefix))
        if add_special_tokens:
            ids = ([self.bos_id] if self.add_bos and self.bos_id is not None else []) + ids
            ids += [self.eos_id] if self.add_eos and self.eos_id is not None else []
        return ids

    def decode(self, ids, skip_special_tokens, at_start=True):
        ids = self._known(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
            if at_start and not any(i in self.extra for i in ids):
                return self.sp.decode(ids)
        return self._decode_pieces(ids, at_start)[0]


def protobuf_fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) pairs of one protobuf message, read from the wire format: varints
    as ints, other wire types as their bytes. sentencepiece models are protobuf, and neither the
    sentencepiece API nor an installed ``protobuf`` can be relied on to expose every field."""

    def varint(i: int) -> tuple[int, int]:
        result = shift = 0
        while True:
            byte = buf[i]
            i += 1
            result |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return result, i

    i = 0
    while i < len(buf):
        key, i = varint(i)
        wire = key & 7
        if wire == 0:
            value, i = varint(i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 2:
            length, i = varint(i)
            value, i = buf[i:i + length], i + length
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield key >> 3, value


def _sentencepiece_normalizer_spec(data: bytes) -> dict[int, int]:
    """The varint fields of a sentencepiece ModelProto's ``normalizer_spec`` (field 3): 3 is
    add_dummy_prefix, 4 remove_extra_whitespaces."""
    spec: dict[int, int] = {}
    for number, value in protobuf_fields(data):
        if number == 3:
            spec.update((k, v) for k, v in protobuf_fields(value) if isinstance(v, int))
    return spec


def _added_tokens_regex(tokens: Mapping[str, Any]) -> re.Pattern | None:
    """Leftmost-longest match over the added tokens, as tokenizers' AddedVocabulary does."""
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def _split_added(text: str, pattern: re.Pattern | None, tokens: Mapping[str, tuple[int, dict]]):
    """``(segment, None)`` for text and ``("", token_id)`` for each added token in ``text``,
    honouring the tokens' lstrip/rstrip (which swallow the whitespace beside them)."""
    if pattern is None:
        yield text, None
        return
    pos, pending_strip = 0, False
    for m in pattern.finditer(text):
        token_id, entry = tokens[m.group()]
        segment = text[pos:m.start()]
        if pending_strip:
            segment = segment.lstrip()
        if entry.get("lstrip"):
            segment = segment.rstrip()
        yield segment, None
        yield "", token_id
        pos, pending_strip = m.end(), bool(entry.get("rstrip"))
    segment = text[pos:]
    yield (segment.lstrip() if pending_strip else segment), None
