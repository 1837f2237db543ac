"""Encode/decode parity: with transformers' AutoTokenizer on the real files, with llama.cpp's
test vectors, and between a GGUF's embedded vocabulary and the sentencepiece model it came from.

Where fastllm and transformers differ on a sentencepiece model, the test checks the difference
is the known one (transformers 5 converts tokenizer.model to a ``tokenizers`` BPE that treats
leading and repeated whitespace differently) and that fastllm gives what sentencepiece itself
and llama.cpp give.
"""

import json
import re
import unicodedata

import pytest
import sentencepiece
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_util import (GGUF, LLAMA2, QWEN3, STORIES, TEXTS, hf_tokenizer, llama_cpp_vectors,
                            load, model_file)

from fastllm.tokenizer import Tokenizer

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None)


# ---- tokenizer.json: Qwen3 ----------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_qwen3_matches_hf(text):
    ours, hf = load(QWEN3), hf_tokenizer(QWEN3)
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids) == unicodedata.normalize("NFC", text)  # Qwen's normalizer
    framed = hf.encode("<|im_start|>user\n" + text + "<|im_end|>")
    assert ours.encode("<|im_start|>user\n" + text + "<|im_end|>") == framed
    assert ours.decode(framed, skip_special_tokens=False) == hf.decode(framed)


def test_qwen3_special_tokens_match_hf():
    ours, hf = load(QWEN3), hf_tokenizer(QWEN3)
    assert ours.backend == "tokenizers"
    assert ours.bos_token_id is None and hf.bos_token_id is None
    assert ours.eos_token_id == hf.eos_token_id == 151645  # <|im_end|>
    assert ours.eos_token_ids == [151645]
    assert ours.pad_token_id == hf.pad_token_id == 151643  # <|endoftext|>
    assert ours.unk_token_id == hf.unk_token_id
    assert (ours.vocab_size, len(ours)) == (hf.vocab_size, len(hf)) == (151643, 151669)
    assert ours.add_bos_token is False
    assert ours.special_tokens_map == hf.special_tokens_map
    assert ours.all_special_ids == sorted(hf.all_special_ids)
    assert ours.convert_tokens_to_ids("<think>") == hf.convert_tokens_to_ids("<think>") == 151667
    assert ours.convert_tokens_to_ids(["Hello", "<|im_end|>"]) == [9707, 151645]
    assert ours.convert_tokens_to_ids("not-a-token-xyz") == hf.convert_tokens_to_ids(
        "not-a-token-xyz")
    assert ours.convert_ids_to_tokens([9707, 151645]) == hf.convert_ids_to_tokens([9707, 151645])


def test_qwen3_llama_cpp_vectors():
    """llama.cpp's qwen2 vectors, with the Qwen3 tokenizer.json: same base BPE, all 46 match."""
    ours = load(QWEN3)
    vectors = llama_cpp_vectors("qwen2")
    assert len(vectors) == 46
    for text, expected in vectors:
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.decode(expected) == text


# ---- tokenizer.model: sentencepiece -------------------------------------------------------


def _leading_or_repeated_space(text: str) -> bool:
    return text[:1].isspace() or "  " in text


def _collapsible_space(text: str) -> bool:
    """Text that sentencepiece's remove_extra_whitespaces changes (runs of spaces, or a space at
    either end)."""
    return re.sub(" +", " ", text).strip(" ") != text


@pytest.mark.parametrize("text", TEXTS)
def test_stories_matches_hf(text):
    """stories260K_hf: LlamaTokenizer with add_bos_token and legacy=True. The model was trained
    with sentencepiece's remove_extra_whitespaces, which transformers' conversion drops."""
    ours, hf = load(STORIES), hf_tokenizer(STORIES)
    sp = sentencepiece.SentencePieceProcessor(
        model_file=str(model_file(STORIES) / "tokenizer.model"))
    ids = ours.encode(text)
    assert ids == [1] + sp.encode(text)
    if not _collapsible_space(text):
        assert ids == hf.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True) == sp.decode(ids)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)


def test_stories_differs_from_hf_only_on_spaces():
    ours, hf = load(STORIES), hf_tokenizer(STORIES)
    differ = [t for t in TEXTS if ours.encode(t) != hf.encode(t)]
    assert differ and all(_collapsible_space(t) for t in differ)
    assert len(differ) <= 6


@pytest.mark.parametrize("text", TEXTS)
def test_llama2_matches_hf(text):
    """llama2_tokenizer holds only tokenizer.model; the reference is transformers'
    LlamaTokenizer (legacy=False). It agrees except on text starting with whitespace or holding
    runs of spaces, where it differs from sentencepiece and llama.cpp (see the vectors test)."""
    ours, hf = load(LLAMA2), hf_tokenizer(LLAMA2, "LlamaTokenizer")
    sp = sentencepiece.SentencePieceProcessor(
        model_file=str(model_file(LLAMA2) / "tokenizer.model"))
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text)
    if not _leading_or_repeated_space(text):
        assert ids == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True) == sp.decode(ids) == text


def test_llama2_special_tokens():
    ours, hf = load(LLAMA2), hf_tokenizer(LLAMA2, "LlamaTokenizer")
    assert ours.backend == "sentencepiece"
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id) == (
        hf.bos_token_id, hf.eos_token_id, hf.unk_token_id) == (1, 2, 0)
    assert ours.pad_token_id is None and hf.pad_token_id is None
    assert ours.vocab_size == len(ours) == hf.vocab_size == 32000
    assert ours.all_special_ids == sorted(hf.all_special_ids) == [0, 1, 2]
    # Without a tokenizer_config.json, BOS is added as sentencepiece models (and llama.cpp) do.
    assert ours.add_bos_token and ours.encode("Hi")[0] == 1
    assert ours.convert_tokens_to_ids("▁Hello") == hf.convert_tokens_to_ids("▁Hello") == 15043


def test_stories_special_tokens_match_hf():
    ours, hf = load(STORIES), hf_tokenizer(STORIES)
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id, ours.pad_token_id) == (
        hf.bos_token_id, hf.eos_token_id, hf.unk_token_id, hf.pad_token_id) == (1, 2, 0, None)
    assert ours.eos_token_ids == [2]  # generation_config.json and config.json agree
    assert ours.add_bos_token and not ours.add_eos_token
    assert (ours.vocab_size, len(ours)) == (hf.vocab_size, len(hf)) == (512, 512)
    assert ours.special_tokens_map == hf.special_tokens_map


@pytest.mark.parametrize("text", ["x</s>y", "a <s> b", "<unk>", "</s>"])
def test_special_tokens_in_text_are_parsed_as_hf(text):
    """Special tokens written in the text become their ids (as in HF and llama.cpp with
    parse_special); sentencepiece alone would spell them out."""
    ours, hf = load(STORIES), hf_tokenizer(STORIES)
    expected = hf.encode(text)
    if not _collapsible_space(text.replace("<s>", "").replace("</s>", "")):
        assert ours.encode(text) == expected
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == hf.decode(ours.encode(text))


def test_llama2_llama_cpp_vectors():
    """llama.cpp's Llama-SPM vectors, with the Llama 2 tokenizer.model: same vocabulary. All 46
    match, including the leading-space cases transformers' conversion gets wrong."""
    ours, hf = load(LLAMA2), hf_tokenizer(LLAMA2, "LlamaTokenizer")
    vectors = llama_cpp_vectors("llama-spm")
    assert len(vectors) == 46
    hf_failures = 0
    for text, expected in vectors:
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.decode(expected) == text
        hf_failures += hf.encode(text, add_special_tokens=False) != expected
    assert hf_failures > 0  # the known difference; if transformers fixes it, tighten the tests


# ---- GGUF ------------------------------------------------------------------------------------


def test_gguf_vocab_is_llama2_sentencepiece():
    """The tiny GGUF carries Llama 2's vocabulary: same pieces, scores and types."""
    import gguf

    reader = gguf.GGUFReader(str(model_file(GGUF)))
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    sp = sentencepiece.SentencePieceProcessor(
        model_file=str(model_file(LLAMA2) / "tokenizer.model"))
    assert field("tokenizer.ggml.model") == "llama"
    assert field("tokenizer.ggml.tokens") == [sp.id_to_piece(i) for i in range(32000)]
    assert field("tokenizer.ggml.scores") == [sp.get_score(i) for i in range(32000)]
    types = field("tokenizer.ggml.token_type")
    assert [i for i, t in enumerate(types) if t == 3] == [1, 2] and types[0] == 2
    assert [i for i, t in enumerate(types) if t == 6] == list(range(3, 259))


def test_gguf_matches_sentencepiece():
    gg, sp = load(GGUF), load(LLAMA2)
    assert gg.backend == "gguf"
    assert (gg.bos_token_id, gg.eos_token_ids, gg.unk_token_id, gg.pad_token_id) == (
        1, [2], 0, None)
    assert len(gg) == gg.vocab_size == 32000 and gg.add_bos_token
    assert gg.all_special_ids == sp.all_special_ids
    for text in TEXTS + ["x</s>y <s>z", "<unk>a"]:
        assert gg.encode(text) == sp.encode(text), text
    for text, expected in llama_cpp_vectors("llama-spm"):
        assert gg.encode(text, add_special_tokens=False) == expected, text


@SETTINGS
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_gguf_encodes_random_text_as_sentencepiece(text):
    assert load(GGUF).encode(text) == load(LLAMA2).encode(text)


@SETTINGS
@given(st.lists(st.one_of(st.integers(0, 31999), st.integers(0, 300), st.integers(3, 258)),
                max_size=30), st.booleans())
def test_gguf_decodes_as_sentencepiece(ids, skip):
    """Random ids, many of them byte tokens (so invalid UTF-8): the GGUF backend's decoder
    (sentencepiece's rules in Python) equals sentencepiece's own."""
    gg, sp = load(GGUF), load(LLAMA2)
    assert gg.decode(ids, skip_special_tokens=skip) == sp.decode(ids, skip_special_tokens=skip)
    if skip:
        raw = sentencepiece.SentencePieceProcessor(
            model_file=str(model_file(LLAMA2) / "tokenizer.model"))
        assert gg.decode(ids) == raw.decode([i for i in ids if i > 2])


def _truncated_qwen(tmp_path, n_merges=3000):
    """A byte-level vocabulary of Qwen3's first ``n_merges`` merges (ids 0..255+n_merges, which
    is how Qwen numbers them) and its added tokens: as tokenizer.json and as a GGUF."""
    import gguf

    data = json.loads(model_file(QWEN3 + "/tokenizer.json").read_text(encoding="utf-8"))
    size = 256 + n_merges
    data["model"]["vocab"] = {t: i for t, i in data["model"]["vocab"].items() if i < size}
    data["model"]["merges"] = data["model"]["merges"][:n_merges]
    for k, token in enumerate(data["added_tokens"]):
        token["id"] = size + k
    reference = tokenizers.Tokenizer.from_str(json.dumps(data))
    tokens = sorted(data["model"]["vocab"], key=data["model"]["vocab"].get)
    tokens += [t["content"] for t in data["added_tokens"]]
    types = [1] * size + [3 if t["special"] else 4 for t in data["added_tokens"]]
    path = tmp_path / "qwen-truncated.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(m) for m in data["model"]["merges"]])
    writer.add_eos_token_id(reference.token_to_id("<|im_end|>"))
    writer.add_pad_token_id(reference.token_to_id("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return reference, path


def test_gguf_byte_level_bpe_matches_tokenizer_json(tmp_path):
    """A "gpt2" GGUF rebuilt as a tokenizers BPE encodes as the tokenizer.json it came from.
    (The GGUF path, like llama.cpp, does not NFC-normalize, so NFC-sensitive text is left out.)"""
    reference, path = _truncated_qwen(tmp_path)
    ours = Tokenizer.from_pretrained(path)
    assert ours.backend == "gguf" and len(ours) == reference.get_vocab_size()
    assert ours.eos_token_id == reference.token_to_id("<|im_end|>")
    assert ours.pad_token_id == reference.token_to_id("<|endoftext|>")
    assert ours.bos_token_id is None and not ours.add_bos_token
    texts = TEXTS + [t for t, _ in llama_cpp_vectors("qwen2")]
    texts += ["<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>"]
    for text in texts:
        if unicodedata.normalize("NFC", text) != text:
            continue
        ids = reference.encode(text).ids
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == reference.decode(ids)
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(
            ids, skip_special_tokens=False)
