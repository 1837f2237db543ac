"""Tokenizers (HF tokenizers, sentencepiece, GGUF vocabularies), chat templates and incremental
detokenization.

- ``tokenizer``: the public :class:`Tokenizer`, which picks a backend and renders chat templates.
- ``base``: the backend interface; ``hf_tokenizers``, ``sentencepiece`` and ``gguf``: the
  backends (``tokenizer.json``, ``tokenizer.model``, a GGUF file's vocabulary).
- ``detokenizer``: :class:`IncrementalDetokenizer` (over each backend's stream).
- ``token_ids``: the checks of token ids and text that every backend's input goes through.
- ``chat_template``: the jinja2 sandbox that renders chat templates as HF does.
- ``utf8``: bytes and UTF-8 helpers shared by the backends and the detokenizer.
"""

from fastllm.tokenizer.detokenizer import IncrementalDetokenizer
from fastllm.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
