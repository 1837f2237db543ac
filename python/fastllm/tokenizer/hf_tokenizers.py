"""The HF ``tokenizers`` backend: a ``tokenizers.Tokenizer`` from tokenizer.json (or built from a
GGUF byte-level vocabulary), streamed through ``tokenizers.decoders.DecodeStream``."""

from __future__ import annotations

import tokenizers

from fastllm.tokenizer.base import _SPACE, _Backend
from fastllm.tokenizer.detokenizer import _TokenizersStream
from fastllm.tokenizer.utf8 import _byte_level_alphabet


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

    def new_stream(self, skip_special_tokens, context, at_start):
        return _TokenizersStream(self, skip_special_tokens, context)
