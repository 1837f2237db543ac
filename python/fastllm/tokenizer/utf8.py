"""Bytes and UTF-8: GPT-2's byte-level alphabet, whether bytes end inside a character that a
later token may complete, and sentencepiece's per-byte decoding."""

from __future__ import annotations

import codecs
import functools

_REPLACEMENT = "\ufffd"


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
