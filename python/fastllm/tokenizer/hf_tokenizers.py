"""The HF ``tokenizers`` backend: a ``tokenizers.Tokenizer`` from tokenizer.json (or built from a
GGUF byte-level vocabulary), streamed through ``tokenizers.decoders.DecodeStream``."""

from __future__ import annotations

import tokenizers

from fastllm.tokenizer.base import _MAX_HELD, _SPACE, _Backend, _WindowStream
from fastllm.tokenizer.utf8 import _REPLACEMENT, _byte_level_alphabet


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
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

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

    @property
    def vocabulary_key(self):
        # One tokenizer.json's tokenizers.Tokenizer is shared by every backend loaded from it
        # (fastllm.tokenizer.tokenizer._TokenizerJsonCache) and never changed.
        return self.tk

    def new_stream(self, skip_special_tokens, context, at_start):
        return _TokenizersStream(self, skip_special_tokens, context)


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
