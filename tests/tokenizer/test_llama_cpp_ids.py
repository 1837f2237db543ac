"""SmolLM2's GGUF tokenizer gives llama.cpp's ids: on llama.cpp's tokenizer test strings, 300
DL19 passages and chat-formatted text, against the ids llama.cpp gave (stored in
``tests/data/smollm2_llama_cpp_ids.json`` by ``make_llama_cpp_ids.py``; checked against
llama.cpp itself by ``make bench``, which builds llama-cpp-python)."""

from __future__ import annotations

import functools
import json

import pytest
from make_llama_cpp_ids import GOLDEN, tokenizer_sha256

from fastllm.tokenizer import Tokenizer


@functools.cache
def golden() -> dict[str, object]:
    return json.loads(GOLDEN.read_text(encoding="utf-8"))


@pytest.fixture
def smollm2_tokenizer(smollm2_llm) -> Tokenizer:
    """``Tokenizer.from_pretrained`` of the GGUF file, as the session's SmolLM2 LLM made it."""
    return smollm2_llm.tokenizer


def test_golden_ids_come_from_this_vocabulary(smollm2_path):
    document = golden()
    assert document["gguf"] == smollm2_path.name
    assert document["tokenizer_sha256"] == tokenizer_sha256(smollm2_path)
    groups = [case["group"] for case in document["cases"]]
    assert (groups.count("llama_cpp_tests"), groups.count("dl19_passages"),
            groups.count("chat")) == (46, 300, 3)


def test_ids_equal_llama_cpps(smollm2_tokenizer):
    special_texts = smollm2_tokenizer.convert_ids_to_tokens(smollm2_tokenizer.all_special_ids)
    differ = []
    for case in golden()["cases"]:
        text = case["text"]
        if not case["special"]:
            # fastllm always parses special tokens in text, llama.cpp here did not: the same
            # only where there are none.
            assert not any(token in text for token in special_texts), text
        ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
        if ids != case["ids"]:
            differ.append((text[:60], ids[:12], case["ids"][:12]))
    assert not differ, f"{len(differ)} texts differ, e.g. (text, fastllm, llama.cpp): {differ[:3]}"


def test_llama_cpps_ids_decode_to_the_text(smollm2_tokenizer):
    for case in golden()["cases"]:
        if not case["special"]:
            assert smollm2_tokenizer.decode(case["ids"]) == case["text"]


@pytest.mark.llama_cpp
def test_golden_ids_are_llama_cpps_own(smollm2_path, llama_cpp):
    """llama-cpp-python still tokenizes every text as stored."""
    vocab = llama_cpp.Llama(str(smollm2_path), vocab_only=True, verbose=False)
    for case in golden()["cases"]:
        assert vocab.tokenize(case["text"].encode("utf-8"), add_bos=False,
                              special=case["special"]) == case["ids"], case["text"]
