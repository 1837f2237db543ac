"""A GGUF file's embedded vocabulary, read with the ``gguf`` package and rebuilt as an equivalent
``tokenizers.Tokenizer``: ``tokenizer.ggml.model == "llama"`` (sentencepiece BPE; merges
recovered from the scores, byte fallback, llama.cpp's space prefix) or ``"gpt2"`` (byte-level
BPE with the file's merges and the split regex its ``tokenizer.ggml.pre`` names)."""

from __future__ import annotations

from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from fastllm.gguf_file import GGUFFileReader
from fastllm.tokenizer.base import _SPACE, _Backend
from fastllm.tokenizer.hf_tokenizers import _TokenizersBackend
from fastllm.tokenizer.sentencepiece import (_CONTROL, _NORMAL, _UNKNOWN, _UNUSED, _USER_DEFINED,
                                             _SentencePieceLike)

# Split regexes of the byte-level BPE vocabularies llama.cpp names in tokenizer.ggml.pre.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGIT_SPLIT = r"\p{N}"  # every digit alone, before the GPT-2 split (llama.cpp's SMOLLM family)
_GGUF_PRE_SPLITS = {
    "default": ((_GPT2_SPLIT,), False), "gpt2": ((_GPT2_SPLIT,), False),
    "smollm": ((_DIGIT_SPLIT, _GPT2_SPLIT), False),
    "llama3": ((_LLAMA3_SPLIT,), True), "llama-v3": ((_LLAMA3_SPLIT,), True),
    "llama-bpe": ((_LLAMA3_SPLIT,), True), "falcon3": ((_LLAMA3_SPLIT,), True),
    "smaug-bpe": ((_LLAMA3_SPLIT,), True), "dbrx": ((_LLAMA3_SPLIT,), True),
    "qwen2": ((_QWEN2_SPLIT,), False), "deepseek-r1-qwen": ((_QWEN2_SPLIT,), False),
}  # pre -> (split regexes, applied in turn; ignore_merges as llama.cpp sets it)


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


def _read_gguf_tokenizer(reader: GGUFFileReader) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of a parsed GGUF file, keys without the ``tokenizer.``
    prefix."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            meta[key[len("tokenizer."):]] = field.contents()
    if "ggml.model" not in meta:
        raise ValueError(f"{reader.path} has no embedded tokenizer (no tokenizer.ggml.model)")
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
        splits, ignore_merges = _GGUF_PRE_SPLITS[pre]
        merges = [tuple(m.split(" ", 1)) for m in meta.get("ggml.merges", [])]
        bpe = models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=merges,
                         ignore_merges=ignore_merges)
        tk = tokenizers.Tokenizer(bpe)
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
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
