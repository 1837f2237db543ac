"""llguidance's view of a vocabulary is built once per vocabulary: every engine of a model (each
loading the same tokenizer.json) shares it, and a tokenizer that encodes differently, or another
vocabulary size, gets its own; the constraint still holds through the shared one."""

from __future__ import annotations

import shutil

from fastllm.engine.structured_output import GrammarCompiler
from fastllm.sampling import StructuredOutputsParams
from fastllm.tokenizer import Tokenizer


def spells(compiler: GrammarCompiler, tokenizer: Tokenizer, text: str) -> bool:
    matcher = compiler.matcher(StructuredOutputsParams(choice=["yes", "no"]))
    try:
        done = [matcher.advance(token) for token in tokenizer.encode(text,
                                                                     add_special_tokens=False)]
    except ValueError:
        return False
    return done[-1]


def test_engines_of_one_vocabulary_share_llguidances_tokenizer(model_path, tmp_path):
    folder = model_path("qwen3_tokenizer")
    copy = shutil.copytree(folder, tmp_path / "copy")  # another folder, the same bytes
    first, second = Tokenizer.from_pretrained(folder), Tokenizer.from_pretrained(copy)
    assert first is not second and first.vocabulary_key is second.vocabulary_key
    compilers = [GrammarCompiler(tokenizer, 151936) for tokenizer in (first, second)]
    assert compilers[0].tokenizer is compilers[1].tokenizer
    assert GrammarCompiler(first, 151936 + 64).tokenizer is not compilers[0].tokenizer
    sentencepiece = Tokenizer.from_pretrained(model_path("llama2_tokenizer"))
    assert sentencepiece.vocabulary_key is not first.vocabulary_key
    assert GrammarCompiler(sentencepiece, 32000).tokenizer is not compilers[0].tokenizer
    for compiler, tokenizer in zip(compilers, (first, second)):
        assert spells(compiler, tokenizer, "yes") and spells(compiler, tokenizer, "no")
        assert not spells(compiler, tokenizer, "maybe")
