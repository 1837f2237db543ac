"""Tokenizers: one interface over three backends, chat templates, incremental detokenization.

:meth:`Tokenizer.from_pretrained` picks the backend from what a folder (or file) holds, in this
order:

- ``tokenizer.json``: HF ``tokenizers`` (Rust), as the file defines it.
- ``tokenizer.model``: ``sentencepiece``, with sentencepiece's own semantics (they match
  llama.cpp's test vectors; see "Sentencepiece and HF" below).
- a ``.gguf`` file: its embedded vocabulary, read with the ``gguf`` package and rebuilt as an
  equivalent ``tokenizers.Tokenizer``: ``tokenizer.ggml.model == "llama"`` (sentencepiece BPE;
  merges recovered from the scores, byte fallback, llama.cpp's space prefix) or ``"gpt2"``
  (byte-level BPE with the file's merges and the split regex its ``tokenizer.ggml.pre`` names).

``tokenizer_config.json``, ``generation_config.json`` and ``config.json`` next to it supply the
special tokens, the end-of-generation ids and the chat template, as in HF; BOS/EOS come from
tokenizer.json's post-processor, else from ``add_bos_token`` / ``add_eos_token`` (a
sentencepiece model adds BOS unless told not to, as llama.cpp does).

Sentencepiece and HF: transformers 5 no longer runs sentencepiece; it converts a
``tokenizer.model`` into a ``tokenizers`` BPE on the fly, and that conversion differs from
sentencepiece (and from llama.cpp) on text that starts with whitespace, on runs of spaces, and on
models trained with ``remove_extra_whitespaces``. This module follows sentencepiece there; it
follows HF in parsing special tokens written in the text (``"<s>"``, ``"</s>"``) and in
``skip_special_tokens``.

Incremental detokenization (:class:`IncrementalDetokenizer`) emits text deltas whose
concatenation, after :meth:`IncrementalDetokenizer.flush`, equals :meth:`Tokenizer.decode` of
the same ids; a character split over tokens is emitted once it is complete.
"""

from __future__ import annotations

import codecs
import functools
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

__all__ = ["Tokenizer", "IncrementalDetokenizer"]

_SPACE = "\u2581"  # sentencepiece's "▁"
_REPLACEMENT = "\ufffd"
# Prompt tokens an incremental detokenizer keeps as context: enough for the leading-space rule
# and for a character split over tokens.
_CONTEXT_TOKENS = 6
# Tokens a DecodeStream may hold back before the exact Python window takes over.
_MAX_HELD = 8

# Sentencepiece piece types (sentencepiece_model.proto), also GGUF's tokenizer.ggml.token_type.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Split regexes of the byte-level BPE vocabularies llama.cpp names in tokenizer.ggml.pre.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GGUF_PRE_SPLITS = {
    "default": (_GPT2_SPLIT, False), "gpt2": (_GPT2_SPLIT, False),
    "llama3": (_LLAMA3_SPLIT, True), "llama-v3": (_LLAMA3_SPLIT, True),
    "llama-bpe": (_LLAMA3_SPLIT, True), "falcon3": (_LLAMA3_SPLIT, True),
    "smaug-bpe": (_LLAMA3_SPLIT, True), "dbrx": (_LLAMA3_SPLIT, True),
    "qwen2": (_QWEN2_SPLIT, False), "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
}  # pre -> (split regex, ignore_merges as llama.cpp sets it)

_SPECIAL_TOKEN_ATTRS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")


# --------------------------------------------------------------------------------------------
# Bytes and UTF-8


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte (the inverse of ``bytes_to_unicode``)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def _incomplete_utf8_tail(data: bytes) -> bool:
    """Whether ``data`` ends with the start of a UTF-8 character that more bytes could complete
    (a valid prefix, so a later token may still turn the trailing U+FFFD into a character)."""
    for k in (1, 2, 3):
        tail = data[-k:]
        if len(tail) < k or tail[0] < 0xC2:
            continue
        try:
            if codecs.getincrementaldecoder("utf-8")().decode(tail, final=False) == "":
                return True
        except UnicodeDecodeError:
            pass
    return False


def _decode_bytes_per_byte(run: bytes | bytearray) -> str:
    """Sentencepiece's ``ProcessBytePieces``: valid characters as they are, and one U+FFFD per
    byte that does not start a valid character (Python's ``errors="replace"`` would merge a
    truncated sequence into a single U+FFFD)."""
    try:
        return bytes(run).decode("utf-8")
    except UnicodeDecodeError:
        pass
    out, i, n = [], 0, len(run)
    while i < n:
        b = run[i]
        width = (1 if b < 0x80 else 2 if 0xC2 <= b <= 0xDF else 3 if 0xE0 <= b <= 0xEF
                 else 4 if 0xF0 <= b <= 0xF4 else 0)
        if width and i + width <= n:
            try:
                out.append(bytes(run[i:i + width]).decode("utf-8"))
                i += width
                continue
            except UnicodeDecodeError:
                pass
        out.append(_REPLACEMENT)
        i += 1
    return "".join(out)


# --------------------------------------------------------------------------------------------
# Backends: encode, decode, the vocabulary, and a stream for incremental detokenization.


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


class _TokenizersBackend(_Backend):
    """A ``tokenizers.Tokenizer``: from tokenizer.json, or built from a GGUF byte-level vocab."""

    kind = "tokenizers"

    def __init__(self, tk: tokenizers.Tokenizer):
        self.tk = tk
        self.special_ids = frozenset(i for i, t in tk.get_added_tokens_decoder().items()
                                     if t.special)
        # How a token's string becomes bytes, where the decoder makes that simple.
        names = repr(tk.decoder)
        self._bytes_mode = ("byte_level" if "ByteLevel(" in names
                            else "byte_fallback" if "ByteFallback(" in names else None)
        self._added = {i: t.content for i, t in tk.get_added_tokens_decoder().items()}

    def encode(self, text, add_special_tokens):
        return self.tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens, at_start=True):
        ids = list(ids)
        if ids and min(ids) < 0:  # tokenizers drops the unknown ids, but takes no negative one
            ids = [i for i in ids if i >= 0]
        return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token):
        return self.tk.token_to_id(token)

    def id_to_token(self, token_id):
        return self.tk.id_to_token(token_id)

    def size(self, with_added_tokens=True):
        return self.tk.get_vocab_size(with_added_tokens=with_added_tokens)

    def token_bytes(self, token_id):
        token = self.tk.id_to_token(token_id)
        if token is None or self._bytes_mode is None:
            return None
        if token_id in self._added:
            return token.encode()
        if self._bytes_mode == "byte_level":
            alphabet = _byte_level_alphabet()
            if all(c in alphabet for c in token):
                return bytes(alphabet[c] for c in token)
            return token.encode()  # the ByteLevel decoder passes such tokens through as UTF-8
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes([int(token[3:5], 16)])
        return token.replace(_SPACE, " ").encode()

    def new_stream(self, skip_special_tokens, context, at_start):
        return _TokenizersStream(self, skip_special_tokens, context)


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


class _GGUFSentencePieceBackend(_SentencePieceLike):
    """A GGUF "llama" vocabulary: encoded by an equivalent ``tokenizers`` BPE, decoded with
    sentencepiece's rules (so it decodes exactly as the ``tokenizer.model`` it came from)."""

    kind = "gguf"

    def __init__(self, tk: tokenizers.Tokenizer, pieces: list[str], types: list[int],
                 add_dummy_prefix: bool):
        self.tk = tk
        self.add_dummy_prefix = add_dummy_prefix
        self.remove_extra_whitespaces = False  # llama.cpp keeps every space
        self._init_pieces(pieces, types, {}, set())

    def encode(self, text, add_special_tokens):
        return self.tk.encode(text, add_special_tokens=add_special_tokens).ids


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


# --------------------------------------------------------------------------------------------
# GGUF


def _read_gguf_tokenizer(path: Path) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of a GGUF file, keys without the ``tokenizer.`` prefix."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            meta[key[len("tokenizer."):]] = field.contents()
    if "ggml.model" not in meta:
        raise ValueError(f"{path} has no embedded tokenizer (no tokenizer.ggml.model)")
    return meta


def _merges_from_scores(pieces: list[str], scores: list[float], types: list[int]):
    """BPE merges recovered from a sentencepiece vocabulary: every split of a normal piece into
    two pieces, best score first (HF's ``generate_merges`` with scores, and sentencepiece's
    order, which merges the pair whose result scores highest)."""
    vocab = {p: i for i, p in enumerate(pieces)}
    usable = {p for p, t in zip(pieces, types) if t in (_NORMAL, _USER_DEFINED, _UNUSED)}
    merges = []
    for piece, score, kind in zip(pieces, scores, types):
        if kind != _NORMAL:
            continue
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in usable and piece[k:] in usable]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _gguf_backend(meta: dict[str, Any]) -> _Backend:
    model = meta["ggml.model"]
    if model not in ("llama", "gpt2"):
        raise ValueError(f"GGUF tokenizer.ggml.model={model!r} is not supported (llama, gpt2)")
    if "ggml.tokens" not in meta:
        raise ValueError("the GGUF file has no tokenizer.ggml.tokens")
    pieces = list(meta["ggml.tokens"])
    types = list(meta.get("ggml.token_type") or [_NORMAL] * len(pieces))
    if model == "llama":
        scores = list(meta.get("ggml.scores") or [-float(i) for i in range(len(pieces))])
        unk_id = meta.get("ggml.unknown_token_id", 0)
        bpe = models.BPE(vocab={p: i for i, p in enumerate(pieces)},
                         merges=_merges_from_scores(pieces, scores, types),
                         unk_token=pieces[unk_id], fuse_unk=True, byte_fallback=True)
        tk = tokenizers.Tokenizer(bpe)
        add_prefix = bool(meta.get("ggml.add_space_prefix", True))
        # llama.cpp: spaces become "▁", and each text fragment (the text, and every piece of it
        # after a special token) gets a "▁" in front. sentencepiece does the same.
        tk.normalizer = normalizers.Sequence(
            ([normalizers.Prepend(_SPACE)] if add_prefix else [])
            + [normalizers.Replace(" ", _SPACE)])
        tk.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(),
                                        decoders.Fuse()]
                                       + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
        _add_gguf_added_tokens(tk, pieces, types)
        return _GGUFSentencePieceBackend(tk, pieces, types, add_prefix)
    if model == "gpt2":
        pre = meta.get("ggml.pre", "default")
        if pre not in _GGUF_PRE_SPLITS:
            raise ValueError(f"GGUF byte-level vocabulary with tokenizer.ggml.pre={pre!r} is not "
                             f"supported; supported: {sorted(_GGUF_PRE_SPLITS)}")
        split, ignore_merges = _GGUF_PRE_SPLITS[pre]
        merges = [tuple(m.split(" ", 1)) for m in meta.get("ggml.merges", [])]
        bpe = models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=merges,
                         ignore_merges=ignore_merges)
        tk = tokenizers.Tokenizer(bpe)
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tk.decoder = decoders.ByteLevel()
        _add_gguf_added_tokens(tk, pieces, types)
        backend = _TokenizersBackend(tk)
        backend.kind = "gguf"
        return backend


def _add_gguf_added_tokens(tk: tokenizers.Tokenizer, pieces: list[str], types: list[int]):
    """Control and unknown tokens become special added tokens (matched whole in text, dropped
    by skip_special_tokens); user-defined ones become plain added tokens, as llama.cpp has it."""
    special = [AddedToken(p, special=True, normalized=False)
               for p, t in zip(pieces, types) if t in (_CONTROL, _UNKNOWN)]
    user = [AddedToken(p, special=False, normalized=False)
            for p, t in zip(pieces, types) if t == _USER_DEFINED]
    if special:
        tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)


# --------------------------------------------------------------------------------------------
# Incremental detokenization


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
        prompt = [int(t) for t in prompt_ids or []]
        context = prompt[-_CONTEXT_TOKENS:]
        # Once per request, O(prompt): where the context stands (sentencepiece's start rule).
        at_start = backend.still_at_start(prompt[:-_CONTEXT_TOKENS], skip_special_tokens, True)
        self._stream = backend.new_stream(skip_special_tokens, context, at_start)

    def add(self, token_id: int) -> str:
        """Adds one generated token; returns the text it completes ("" while held back). An id
        the tokenizer does not know (past ``len(tokenizer)``) adds nothing, as in ``decode``."""
        token_id = int(token_id)
        if token_id < 0 or self._backend.id_to_token(token_id) is None:
            return ""
        return self._stream.step(token_id)

    def add_many(self, token_ids: Iterable[int]) -> str:
        """Adds several tokens; returns the concatenation of their deltas."""
        if hasattr(token_ids, "tolist"):  # a tensor or an array
            token_ids = token_ids.tolist()
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """At the end of the request: the held-back text (an incomplete character decodes as
        U+FFFD, exactly as ``decode`` shows it)."""
        return self._stream.flush()


# --------------------------------------------------------------------------------------------
# Chat templates


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # HF's: jinja's own tojson escapes HTML characters, which chat templates do not want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str):
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask markers) render
        their body unchanged here."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
                lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """Template inputs rebuilt from plain JSON types (HF does the same), so the sandbox only ever
    sees str/int/float/bool/None/dict/list/tuple."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict) -> dict:
    """HF 5 passes a message's reasoning under both ``reasoning_content`` and ``thinking``."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


# --------------------------------------------------------------------------------------------
# The tokenizer


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_str(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class Tokenizer:
    """Encode, decode, special tokens and chat template of one model, whatever the backend.

    Build it with :meth:`from_pretrained`. The attribute names and defaults are HF's:
    ``encode`` adds BOS/EOS as the tokenizer is configured to, and parses special tokens
    written in the text; ``decode`` drops special tokens unless ``skip_special_tokens=False``.
    ``vocab_size`` is the base vocabulary and ``len(tokenizer)`` includes added tokens.
    """

    def __init__(self, backend: _Backend, *, special_tokens: dict[str, str | None],
                 eos_token_ids: list[int], add_bos_token: bool, add_eos_token: bool,
                 chat_template: str | dict[str, str] | None, name_or_path: str):
        self._backend = backend
        self._special_tokens = special_tokens
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.chat_template = chat_template
        self.name_or_path = name_or_path
        eos = self.eos_token_id
        self._eos_token_ids = list(dict.fromkeys(([eos] if eos is not None else [])
                                                 + eos_token_ids))

    # ---- loading -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """Loads from a model folder (tokenizer.json, else tokenizer.model, else a single .gguf
        file) or from one of those files directly. Raises FileNotFoundError when there is
        nothing to load."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"no such file or folder: {path}")
        folder = path if path.is_dir() else path.parent
        if path.is_dir():
            candidates = [path / "tokenizer.json", path / "tokenizer.model"]
            found = next((p for p in candidates if p.is_file()), None)
            if found is None:
                ggufs = sorted(path.glob("*.gguf"))
                if len(ggufs) > 1:
                    raise ValueError(f"{path} holds several .gguf files; pass one of them: "
                                     f"{[g.name for g in ggufs]}")
                found = ggufs[0] if ggufs else None
            if found is None:
                raise FileNotFoundError(f"{path} holds no tokenizer.json, tokenizer.model or "
                                        ".gguf file")
            path = found
        if path.suffix == ".gguf":
            return cls._from_gguf(path)
        config = _read_json(folder / "tokenizer_config.json")
        gen_config = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")
        if path.suffix == ".json":
            return cls._from_tokenizer_json(path, config, gen_config, model_config)
        if path.suffix == ".model":
            return cls._from_sentencepiece(path, config, gen_config, model_config)
        raise ValueError(f"cannot tell which tokenizer {path} is (want tokenizer.json, "
                         "tokenizer.model or .gguf)")

    @staticmethod
    def _chat_template(folder: Path, config: dict) -> str | dict[str, str] | None:
        jinja = folder / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        template = config.get("chat_template")
        if template is None:
            template = _read_json(folder / "chat_template.json").get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}
        return template

    @staticmethod
    def _config_eos_ids(gen_config: dict, model_config: dict) -> list[int]:
        return _ids(gen_config.get("eos_token_id")) + _ids(model_config.get("eos_token_id"))

    @classmethod
    def _from_tokenizer_json(cls, path, config, gen_config, model_config):
        try:
            tk = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception
            raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from e
        added = {t.content for t in tk.get_added_tokens_decoder().values()}
        # What HF adds on load: the config's added tokens and special tokens it lacks.
        new = []
        for entry in (config.get("added_tokens_decoder") or {}).values():
            if entry["content"] not in added:
                new.append(AddedToken(entry["content"], single_word=entry.get("single_word", False),
                                      lstrip=entry.get("lstrip", False),
                                      rstrip=entry.get("rstrip", False),
                                      normalized=entry.get("normalized", False),
                                      special=entry.get("special", True)))
                added.add(entry["content"])
        names = [_token_str(config.get(a)) for a in _SPECIAL_TOKEN_ATTRS]
        names += [_token_str(t) for t in config.get("additional_special_tokens") or []]
        for name in names:
            if name is not None and name not in added:
                new.append(AddedToken(name, special=True, normalized=False))
                added.add(name)
        if new:
            tk.add_special_tokens(new)
        special = {a: _token_str(config.get(a)) for a in _SPECIAL_TOKEN_ATTRS}
        # BOS/EOS come from tokenizer.json's post-processor alone: transformers 5 drops the
        # config's add_bos_token / add_eos_token when there is a tokenizer.json.
        backend = _TokenizersBackend(tk)
        bos_id = tk.token_to_id(special["bos_token"]) if special["bos_token"] else None
        eos_id = tk.token_to_id(special["eos_token"]) if special["eos_token"] else None
        probe = tk.encode("", add_special_tokens=True).ids
        return cls(backend, special_tokens=special,
                   eos_token_ids=cls._config_eos_ids(gen_config, model_config),
                   add_bos_token=bos_id is not None and probe[:1] == [bos_id],
                   add_eos_token=eos_id is not None and probe[-1:] == [eos_id],
                   chat_template=cls._chat_template(path.parent, config),
                   name_or_path=str(path.parent))

    @classmethod
    def _from_sentencepiece(cls, path, config, gen_config, model_config):
        added = [{"id": int(i), **entry}
                 for i, entry in (config.get("added_tokens_decoder") or {}).items()]
        backend = _SentencePieceBackend(path, added, legacy=config.get("legacy", True),
                                        add_prefix_space=config.get("add_prefix_space", True))
        sp = backend.sp
        special = {a: _token_str(config.get(a)) for a in _SPECIAL_TOKEN_ATTRS}
        # Without a config, the model's own <s>, </s>, <unk> (and <pad> if it has one).
        for attr, token_id in (("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()),
                               ("unk_token", sp.unk_id()), ("pad_token", sp.pad_id())):
            if attr not in config and token_id >= 0:
                special[attr] = sp.id_to_piece(token_id)
        extra_special = config.get("additional_special_tokens") or []
        backend.mark_special([t for t in special.values() if t is not None]
                             + [_token_str(t) for t in extra_special])
        backend.bos_id = backend.token_to_id(special["bos_token"]) if special["bos_token"] else None
        backend.eos_id = backend.token_to_id(special["eos_token"]) if special["eos_token"] else None
        # sentencepiece models add BOS unless told otherwise (llama.cpp and HF's LlamaTokenizer).
        backend.add_bos = bool(config.get("add_bos_token", True)) and backend.bos_id is not None
        backend.add_eos = bool(config.get("add_eos_token", False)) and backend.eos_id is not None
        return cls(backend, special_tokens=special,
                   eos_token_ids=cls._config_eos_ids(gen_config, model_config),
                   add_bos_token=backend.add_bos, add_eos_token=backend.add_eos,
                   chat_template=cls._chat_template(path.parent, config),
                   name_or_path=str(path.parent))

    @classmethod
    def _from_gguf(cls, path):
        """Everything from the file's metadata: a GGUF is self-contained."""
        meta = _read_gguf_tokenizer(path)
        backend = _gguf_backend(meta)
        pieces = meta["ggml.tokens"]

        def token(key):
            token_id = meta.get(f"ggml.{key}")
            return pieces[token_id] if token_id is not None and token_id < len(pieces) else None

        special = {a: None for a in _SPECIAL_TOKEN_ATTRS}
        special.update(bos_token=token("bos_token_id"), eos_token=token("eos_token_id"),
                       unk_token=token("unknown_token_id"), pad_token=token("padding_token_id"),
                       sep_token=token("seperator_token_id"), cls_token=token("cls_token_id"),
                       mask_token=token("mask_token_id"))
        # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise.
        add_bos = bool(meta.get("ggml.add_bos_token", meta["ggml.model"] == "llama"))
        add_eos = bool(meta.get("ggml.add_eos_token", False))
        add_bos = add_bos and special["bos_token"] is not None
        add_eos = add_eos and special["eos_token"] is not None
        tk = backend.tk
        single = " ".join(([f"{special['bos_token']}:0"] if add_bos else []) + ["$A:0"]
                          + ([f"{special['eos_token']}:0"] if add_eos else []))
        pairs = [(special[n], meta[f"ggml.{n}_id"])
                 for n, on in (("bos_token", add_bos), ("eos_token", add_eos)) if on]
        tk.post_processor = processors.TemplateProcessing(single=single, special_tokens=pairs)
        # End of generation: EOS, and the end-of-turn / end-of-message tokens llama.cpp stops on.
        eos_ids = _ids(meta.get("ggml.eot_token_id")) + _ids(meta.get("ggml.eom_token_id"))
        template = meta.get("chat_template")
        named = {k[len("chat_template."):]: v for k, v in meta.items()
                 if k.startswith("chat_template.")}
        if named:
            template = {**named, **({"default": template} if template else {})}
        return cls(backend, special_tokens=special, eos_token_ids=eos_ids,
                   add_bos_token=add_bos, add_eos_token=add_eos,
                   chat_template=template, name_or_path=str(path))

    # ---- special tokens and vocabulary ----------------------------------------------------

    @property
    def backend(self) -> str:
        """"tokenizers", "sentencepiece" or "gguf"."""
        return self._backend.kind

    def _special_id(self, attr: str) -> int | None:
        token = self._special_tokens.get(attr)
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's EOS (HF's ``eos_token_id``)."""
        return self._special_id("eos_token")

    @property
    def eos_token_ids(self) -> list[int]:
        """Every token that ends generation: the tokenizer's EOS first, then those of
        generation_config.json and config.json (or of the GGUF: end of turn, end of message)."""
        return list(self._eos_token_ids)

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id("unk_token")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set, as HF passes them to chat templates."""
        return {k: v for k, v in self._special_tokens.items() if v is not None}

    @property
    def all_special_ids(self) -> list[int]:
        """The ids ``decode(..., skip_special_tokens=True)`` drops."""
        return sorted(self._backend.special_ids)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (HF's ``vocab_size``)."""
        return self._backend.size(with_added_tokens=False)

    def __len__(self) -> int:
        """Every id the tokenizer knows, added tokens included (HF's ``len(tokenizer)``)."""
        return self._backend.size(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """A token's id (the unknown token's id when it is not in the vocabulary, as in HF)."""
        if isinstance(tokens, str):
            token_id = self._backend.token_to_id(tokens)
            return self.unk_token_id if token_id is None else token_id
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(int(i)) for i in ids]

    # ---- encode / decode -----------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS/EOS as configured. Special
        tokens written in the text (``"<|im_end|>"``, ``"</s>"``) become their ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``. Bytes that do not form UTF-8 decode as U+FFFD; ids the
        tokenizer does not know (a model's padded vocabulary) decode to nothing, as in HF.

        Note the default: special tokens are dropped (HF's default keeps them)."""
        if hasattr(ids, "tolist"):  # a tensor or an array
            ids = ids.tolist()
        return self._backend.decode([int(i) for i in ids], skip_special_tokens)

    def detokenizer(self, *, skip_special_tokens: bool = True,
                    prompt_ids: Sequence[int] | None = None) -> IncrementalDetokenizer:
        """A fresh :class:`IncrementalDetokenizer` for one request."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens,
                                      prompt_ids=prompt_ids)

    # ---- chat template -------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, tokenize: bool = False, *,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            chat_template: str | None = None, **kwargs) -> str | list[int]:
        """Renders ``messages`` with the chat template as HF's ``apply_chat_template`` does
        (sandboxed jinja2 with trim_blocks/lstrip_blocks, ``raise_exception``, HF's ``tojson``,
        the special tokens and ``kwargs`` such as ``enable_thinking=False`` as variables).

        Returns the prompt text, or its token ids (without BOS/EOS added) when ``tokenize``.
        ``chat_template`` is a template, or the name of one of the model's named templates.
        Raises ValueError when the tokenizer has no chat template.
        """
        template = self.chat_template
        if isinstance(template, dict):
            if chat_template in template:
                template = template[chat_template]
            elif chat_template is None:
                name = "tool_use" if tools is not None and "tool_use" in template else "default"
                if name not in template:
                    raise ValueError(f"this tokenizer has several chat templates and no default; "
                                     f"pass chat_template= one of {sorted(template)}")
                template = template[name]
            else:
                template = chat_template
        elif chat_template is not None:
            template = chat_template
        if template is None:
            raise ValueError(f"the tokenizer at {self.name_or_path} has no chat template "
                             "(no chat_template in tokenizer_config.json, chat_template.jinja or "
                             "the GGUF metadata); pass chat_template=")
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        # As HF: drop keys whose value is None, then alias the reasoning fields.
        chat = [_alias_reasoning({k: v for k, v in _plain(dict(m)).items() if v is not None})
                for m in messages]
        variables = {**self.special_tokens_map, **_plain(kwargs)}
        text = _compile_template(template).render(
            messages=chat, tools=_plain(tools), documents=_plain(documents),
            add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return (f"Tokenizer(backend={self.backend!r}, path={self.name_or_path!r}, "
                f"len={len(self)}, bos={self.bos_token_id}, eos={self.eos_token_ids})")
