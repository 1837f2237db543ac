"""Every entry of the GGUF pre-tokenizer table (tokenizer.ggml.pre -> split regexes) against a
maintained source: transformers' own table of llama.cpp's splits where it has the entry, and
for the others the pieces llama.cpp's regexes give on text that tells them apart."""

from __future__ import annotations

import pytest
from tokenizers import Regex, pre_tokenizers
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

from fastllm.tokenizer.gguf import _GGUF_PRE_SPLITS

TEXT = "In 2024, I'll pay $12345.67 for 3 cats\n\n  ok"
# Entries transformers' table lacks, with the pieces llama.cpp's regexes make of TEXT: GPT-2's
# split ("default"/"gpt2": runs of digits together), and SMOLLM's (each digit alone first).
EXPECTED_PIECES = {
    "default": ["In", " 2024", ",", " I", "'ll", " pay", " $", "12345", ".", "67", " for", " 3",
                " cats", "\n\n ", " ok"],
    "smollm": ["In", " ", "2", "0", "2", "4", ",", " I", "'ll", " pay", " $", "1", "2", "3",
               "4", "5", ".", "6", "7", " for", " ", "3", " cats", "\n\n ", " ok"],
}
EXPECTED_PIECES["gpt2"] = EXPECTED_PIECES["default"]


def pieces(splits: tuple[str, ...], text: str) -> list[str]:
    splitter = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits])
    return [piece for piece, _ in splitter.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre", sorted(_GGUF_PRE_SPLITS))
def test_each_entry(pre):
    splits, _ = _GGUF_PRE_SPLITS[pre]
    if pre in GGUF_PRE_TOKENIZER_SPLITS:
        assert splits == (GGUF_PRE_TOKENIZER_SPLITS[pre],)
    else:
        assert pieces(splits, TEXT) == EXPECTED_PIECES[pre]
