"""Helpers shared by the tokenizer tests: where the model files are, the tokenizers under test
and their HF references (each loaded once per session), llama.cpp's test vectors, and the
strings the parity tests run on.

A ``conftest.py`` in this folder would be imported under the module name ``conftest`` and
shadow ``tests/conftest.py`` for the test modules collected after it (``from conftest import
num_threads``), so these helpers live in a plain module, as in the other test folders.
"""

from __future__ import annotations

import functools
import importlib
import os
import struct
from pathlib import Path
from types import SimpleNamespace

import transformers

from conftest import MODELS_DIR
from conftest import find_model as model_file
from fastllm.tokenizer import Tokenizer
from fastllm.tokenizer.sentencepiece import protobuf_fields

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the references load local folders only


QWEN3 = "qwen3_tokenizer"
STORIES = "stories260K_hf"
LLAMA2 = "llama2_tokenizer"
GGUF = "gguf/llama-2-tiny-random.gguf"

# ASCII, leading/trailing/multiple spaces, newlines and tabs, CJK, emoji (incl. ZWJ sequences),
# accented (composed and decomposed), code, digits, special-token-looking text.
TEXTS = [
    "Hello world",
    "Hello, world! How are you?",
    " Hello world",
    "Hello world ",
    "  two leading spaces",
    "multiple   inner    spaces",
    "line one\nline two\n\nline four\n",
    "tabs\tand\r\nwindows newlines",
    "日本語のテキストと中文文本",
    "한국어 텍스트",
    "emoji 😀🚀 and 👨‍👩‍👧 family 🏳️‍🌈",
    "Café naïve résumé Äpfel Ωmega",
    "decomposed: e\u0301 a\u0308",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "3.14159 and 1234567890 and 1,000,000",
    "<html><body class=\"x\">&amp;</body></html>",
    "",
    " ",
    "\n",
]


@functools.cache
def _load(relative: str) -> Tokenizer:
    return Tokenizer.from_pretrained(MODELS_DIR / relative)


def load(relative: str) -> Tokenizer:
    """The fastllm tokenizer of a models-folder entry, loaded once per session."""
    model_file(relative)
    return _load(relative)


def llama_cpp_vectors(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's tokenizer test cases: ``ggml-vocab-<name>.gguf.inp`` holds the texts, separated
    by ``\\n__ggml_vocab_test__\\n``; ``.out`` one line of ids (no BOS) per text."""
    inp = model_file(f"tokenizer_tests/ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    out = model_file(f"tokenizer_tests/ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8")
    texts = inp.split("\n__ggml_vocab_test__\n")
    lines = out.split("\n")
    assert texts[-1] == "" and lines[-1] == ""  # both files end with a separator / newline
    texts, lines = texts[:-1], lines[:-1]
    assert len(texts) == len(lines)
    return [(text, [int(x) for x in line.split()]) for text, line in zip(texts, lines)]


# ---- HF references ---------------------------------------------------------------------------


def _sentencepiece_proto(path: str) -> SimpleNamespace:
    """The parts of a sentencepiece ModelProto that transformers reads, from the protobuf wire
    format: .venv has no ``protobuf``, which transformers needs to read a tokenizer.model."""

    pieces, trainer, normalizer = [], {}, {}
    for number, value in protobuf_fields(Path(path).read_bytes()):
        if number == 1:
            piece = SimpleNamespace(piece="", score=0.0, type=1)
            for n, v in protobuf_fields(value):
                if n == 1:
                    piece.piece = v.decode()
                elif n == 2:
                    piece.score = struct.unpack("<f", v)[0]
                elif n == 3:
                    piece.type = v
            pieces.append(piece)
        elif number == 2:
            trainer.update(protobuf_fields(value))
        elif number == 3:
            normalizer.update(protobuf_fields(value))
    text = lambda v, default: v.decode() if isinstance(v, bytes) else default  # noqa: E731
    return SimpleNamespace(
        pieces=pieces,
        trainer_spec=SimpleNamespace(
            model_type=trainer.get(3, 1), unk_id=trainer.get(40, 0), bos_id=trainer.get(41, 1),
            eos_id=trainer.get(42, 2), byte_fallback=bool(trainer.get(35, 0)),
            unk_piece=text(trainer.get(45), "<unk>"), bos_piece=text(trainer.get(46), "<s>"),
            eos_piece=text(trainer.get(47), "</s>")),
        normalizer_spec=SimpleNamespace(
            precompiled_charsmap=normalizer.get(2, b""),
            add_dummy_prefix=bool(normalizer.get(3, 1)),
            remove_extra_whitespaces=bool(normalizer.get(4, 1))))


@functools.cache
def hf_tokenizer(relative: str, cls_name: str = "AutoTokenizer"):
    """transformers' tokenizer for a models-folder entry, loaded once per session.

    ``cls_name`` picks the class (``LlamaTokenizer`` for the tokenizer.model folder that has no
    tokenizer_config.json). For a tokenizer.model, transformers' protobuf reader is replaced by
    :func:`_sentencepiece_proto` when protobuf is not installed; the rest of its loading path
    (vocab, merges, normalizer, decoder, special tokens) is its own."""
    model_file(relative)
    # The submodule itself: the package attribute of that name is a function.
    convert = importlib.import_module("transformers.convert_slow_tokenizer")

    cls = getattr(transformers, cls_name)
    path = MODELS_DIR / relative
    kwargs = {}
    if path.suffix == ".gguf":
        path, kwargs = path.parent, {"gguf_file": path.name}
    try:
        import google.protobuf  # noqa: F401

        return cls.from_pretrained(str(path), **kwargs)
    except ImportError:
        pass
    original = convert.SentencePieceExtractor.__init__

    def init(self, model):
        self.proto = _sentencepiece_proto(model)

    convert.SentencePieceExtractor.__init__ = init
    try:
        return cls.from_pretrained(str(path), **kwargs)
    finally:
        convert.SentencePieceExtractor.__init__ = original
