"""Every backend (tokenizer.json, sentencepiece, GGUF) rejects the same bad ids and text with the
same errors, naming the id or the position, and takes ids as ints, tensors or arrays alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizer_util import GGUF, QWEN3, STORIES, load

BACKENDS = {"tokenizers": QWEN3, "sentencepiece": STORIES, "gguf": GGUF}


@pytest.fixture(params=list(BACKENDS))
def tok(request):
    tokenizer = load(BACKENDS[request.param])
    assert tokenizer.backend == request.param
    return tokenizer


# id: (ids, exception, pattern its message must match)
BAD_IDS = {
    "negative": ([5, -1], ValueError, r"token ids\[1\] = -1 is outside \[0, 4294967296\)"),
    "2**32": ([2**32], ValueError, r"token ids\[0\] = 4294967296 is outside"),
    "2**40": ([5, 6, 2**40], ValueError, r"token ids\[2\] = 1099511627776 is outside"),
    "float": ([1.5], TypeError, r"token ids must be ints, got float 1.5 at position 0"),
    "whole_float": ([5, 2.0], TypeError, r"got float 2.0 at position 1"),
    "bool": ([True], TypeError, r"got bool True at position 0"),
    "str_id": (["5"], TypeError, r"got str '5' at position 0"),
    "str": ("hello", TypeError, r"token ids must be a sequence of ints, got str"),
    "bytes": (b"\x05", TypeError, r"got bytes"),
    "int": (5, TypeError, r"got int"),
    "float_tensor": (torch.tensor([1.0, 2.0]), TypeError, r"got float 1.0 at position 0"),
    "2d_tensor": (torch.tensor([[1, 2]]), TypeError,
                  r"must be 1-D, got a Tensor of shape \(1, 2\)"),
    "2d_array": (np.array([[1, 2]]), TypeError, r"must be 1-D, got a ndarray of shape \(1, 2\)"),
}


@pytest.mark.parametrize("case", BAD_IDS)
def test_bad_ids_raise_the_same_error_in_every_backend(tok, case):
    ids, error, match = BAD_IDS[case]
    with pytest.raises(error, match=match):
        tok.decode(ids)
    if not isinstance(ids, (str, bytes, int)):
        with pytest.raises(error, match=match):
            tok.convert_ids_to_tokens(ids)
        with pytest.raises(error, match=match):
            tok.detokenizer().add_many(ids)


def test_unknown_ids_decode_to_nothing_as_in_hf(tok):
    # A model's vocabulary is often padded past the tokenizer's: those ids are not errors.
    known = tok.encode("Hello", add_special_tokens=False)
    for unknown in (len(tok), 10**6, 2**32 - 1):
        assert tok.decode(known + [unknown]) == tok.decode(known)
        assert tok.convert_ids_to_tokens(unknown) is None
        assert tok.detokenizer().add(unknown) == ""


def test_ids_as_tensors_arrays_and_numpy_ints(tok):
    ids = tok.encode("Hello world", add_special_tokens=False)
    text = tok.decode(ids)
    for same in (torch.tensor(ids), torch.tensor(ids, dtype=torch.int32), np.array(ids),
                 np.array(ids, dtype=np.uint32), [np.int64(i) for i in ids], tuple(ids),
                 iter(ids)):
        assert tok.decode(same) == text


def test_a_lone_surrogate_is_a_value_error_naming_its_position(tok):
    with pytest.raises(ValueError, match=r"lone surrogate '\\ud800' at position 3"):
        tok.encode("abc\ud800def")
    with pytest.raises(ValueError, match=r"lone surrogate '\\udfff' at position 0"):
        tok.encode("\udfff")
    with pytest.raises(TypeError, match="text must be a str, got bytes"):
        tok.encode(b"abc")
    assert tok.decode(tok.encode("caf\u00e9 \U0001f600", add_special_tokens=False)) == \
        "caf\u00e9 \U0001f600"


def test_chat_messages_must_be_a_list_of_dicts():
    tok = load(QWEN3)
    for messages, match in [("hello", "messages must be a list of .* dicts, got str"),
                            ({"role": "user", "content": "hi"}, "got dict"),
                            (["hello"], r"messages\[0\] must be a .* dict, got str"),
                            (None, "got NoneType")]:
        with pytest.raises(TypeError, match=match):
            tok.apply_chat_template(messages)
