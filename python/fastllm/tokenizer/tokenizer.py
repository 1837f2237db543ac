"""The public :class:`Tokenizer`: one interface over three backends, with its chat template.

:meth:`Tokenizer.from_pretrained` picks the backend from what a folder (or file) holds, in this
order:

- ``tokenizer.json``: HF ``tokenizers`` (Rust), as the file defines it
  (:mod:`fastllm.tokenizer.hf_tokenizers`).
- ``tokenizer.model``: ``sentencepiece``, with sentencepiece's own semantics (they match
  llama.cpp's test vectors; see :mod:`fastllm.tokenizer.sentencepiece`).
- a ``.gguf`` file: its embedded vocabulary, rebuilt as an equivalent ``tokenizers.Tokenizer``
  (:mod:`fastllm.tokenizer.gguf`).

``tokenizer_config.json``, ``generation_config.json`` and ``config.json`` next to it supply the
special tokens, the end-of-generation ids and the chat template, as in HF; BOS/EOS come from
tokenizer.json's post-processor, else from ``add_bos_token`` / ``add_eos_token`` (a
sentencepiece model adds BOS unless told not to, as llama.cpp does).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, processors

from fastllm.gguf_file import GGUFFileReader
from fastllm.hub import resolve_tokenizer
from fastllm.tokenizer.base import _Backend
from fastllm.tokenizer.chat_template import _alias_reasoning, _compile_template, _plain
from fastllm.tokenizer.detokenizer import IncrementalDetokenizer
from fastllm.tokenizer.gguf import _gguf_backend, _read_gguf_tokenizer
from fastllm.tokenizer.hf_tokenizers import _TokenizersBackend
from fastllm.tokenizer.sentencepiece import _SentencePieceBackend
from fastllm.tokenizer.token_ids import as_token_ids, check_text

__all__ = ["Tokenizer"]

_SPECIAL_TOKEN_ATTRS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")


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


def _load_tokenizer_json(text: str, path: Path, config: dict) -> tokenizers.Tokenizer:
    """``tokenizers.Tokenizer`` of a tokenizer.json's ``text``, with the tokens HF adds on load:
    the config's added tokens and the special tokens the file lacks."""
    try:
        tk = tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception
        raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from e
    added = {t.content for t in tk.get_added_tokens_decoder().values()}
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
    return tk


class _TokenizerJsonCache:
    """The ``max_entries`` most recently loaded tokenizer.json vocabularies, keyed by the file's
    bytes and the config entries that add tokens: a large vocabulary takes a noticeable part of
    a second to parse, and every ``LLM`` of a model (or of a copy of its files) loads the same
    one. Entries are never changed after loading, so the ``Tokenizer`` objects built on one
    share it; each keeps its own attributes (chat template, BOS/EOS flags)."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], tokenizers.Tokenizer] = OrderedDict()
        self._lock = threading.Lock()

    def load(self, path: Path, config: dict) -> tokenizers.Tokenizer:
        data = path.read_bytes()
        adding = json.dumps([config.get("added_tokens_decoder"),
                             [config.get(a) for a in _SPECIAL_TOKEN_ATTRS],
                             config.get("additional_special_tokens")], sort_keys=True)
        key = (hashlib.sha256(data).hexdigest(), adding)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from e
        tk = _load_tokenizer_json(text, path, config)
        with self._lock:
            self._entries[key] = tk
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return tk


_TOKENIZER_JSON_CACHE = _TokenizerJsonCache(max_entries=4)


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
    def from_pretrained(cls, path: str | os.PathLike,
                        gguf_reader: GGUFFileReader | None = None, *,
                        revision: str | None = None) -> Tokenizer:
        """Loads from a model folder (tokenizer.json, else tokenizer.model, else a single .gguf
        file), from one of those files directly, or from a hub name at ``revision``
        (:func:`fastllm.hub.resolve_tokenizer`: only the tokenizer's files are downloaded).
        Raises FileNotFoundError when there is nothing to load. ``gguf_reader``: the .gguf file
        ``path`` already parsed (an entry point loading its model from the same file parses it
        once)."""
        path = resolve_tokenizer(path, revision)
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
            return cls._from_gguf(path, gguf_reader or GGUFFileReader(path))
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
        tk = _TOKENIZER_JSON_CACHE.load(path, config)
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
    def _from_gguf(cls, path: Path, reader: GGUFFileReader) -> Tokenizer:
        """Everything from the file's metadata: a GGUF is self-contained."""
        meta = _read_gguf_tokenizer(reader)
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

    def token_text(self, token_id: int) -> str:
        """The text a token stands for in the middle of a text (what logprobs show): its bytes
        (a SentencePiece "▁" is a space), or, bytes that are not whole characters (a byte
        fallback piece), as "bytes:" and their escapes, as OpenAI shows them; a token whose
        bytes are unknown, as ``decode`` gives it."""
        data = self.token_bytes(token_id) if 0 <= token_id < len(self) else None
        if data is None:
            return self.decode([token_id], skip_special_tokens=False)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes a token adds to the decoded byte stream (a special or added token: its
        text), or None for an id the tokenizer does not know or a backend that cannot tell."""
        return self._backend.token_bytes(token_id)

    @property
    def vocabulary_key(self) -> object:
        """The same object for two tokenizers whose ids, token bytes and encoding agree (two
        loads of one tokenizer.json); a key for what is built from a vocabulary."""
        return self._backend.vocabulary_key

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
        """A token's string (None for an id the tokenizer does not know), or a list of them.
        Ids are checked as in :meth:`decode`."""
        if isinstance(ids, int) and not isinstance(ids, bool):
            return self._backend.id_to_token(as_token_ids([ids])[0])
        return [self._backend.id_to_token(i) for i in as_token_ids(ids)]

    # ---- encode / decode -----------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS/EOS as configured. Special
        tokens written in the text (``"<|im_end|>"``, ``"</s>"``) become their ids.

        A text that is not a str is a TypeError; a lone surrogate (which UTF-8 cannot encode) a
        ValueError naming its position."""
        return self._backend.encode(check_text(text), add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``. Bytes that do not form UTF-8 decode as U+FFFD; ids the
        tokenizer does not know (a model's padded vocabulary) decode to nothing, as in HF.

        ``ids`` are ints, or a 1-D integer tensor or array; anything else (floats, bools, a str)
        is a TypeError, and an id outside ``[0, 2**32)`` (what no backend can hold) a ValueError
        naming it. Note the default: special tokens are dropped (HF's default keeps them)."""
        return self._backend.decode(as_token_ids(ids), skip_special_tokens)

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
        Raises ValueError when the tokenizer has no chat template, TypeError when ``messages``
        is not a list of message dicts.
        """
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
            raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got "
                            f"{type(messages).__name__}")
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise TypeError(f"messages[{index}] must be a {{'role', 'content'}} dict, got "
                                f"{type(message).__name__}")
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
