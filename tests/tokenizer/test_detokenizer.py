"""Incremental detokenization: the deltas of :class:`IncrementalDetokenizer`, joined and
flushed, equal ``decode`` of the same ids, for every backend, for random ids (byte tokens,
broken UTF-8, special tokens) and for text cut into byte tokens; a character is never emitted as
U+FFFD when a later token completes it, and the work per token stays bounded."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_util import GGUF, LLAMA2, QWEN3, STORIES, load

from fastllm.tokenizer.base import _MAX_HELD
from fastllm.tokenizer.detokenizer import IncrementalDetokenizer
from fastllm.tokenizer.utf8 import _byte_level_alphabet

SETTINGS = settings(max_examples=80, deadline=None, derandomize=True, database=None)
BACKENDS = [QWEN3, LLAMA2, STORIES, GGUF]
SAMPLE = "Hello, 世界! 日本語とemoji 😀🚀👨‍👩‍👧 café Ωmega\n\tcode: x **= 2"


def byte_token_ids(tok) -> list[int]:
    """The 256 tokens that stand for one byte each: sentencepiece's <0xNN> or the byte-level
    alphabet's characters."""
    ids = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)]
    if None in ids or ids == [tok.unk_token_id] * 256:
        alphabet = {b: c for c, b in _byte_level_alphabet().items()}
        ids = [tok.convert_tokens_to_ids(alphabet[b]) for b in range(256)]
    assert None not in ids and len(set(ids)) == 256
    return ids


def as_byte_tokens(tok, text: str) -> list[int]:
    table = byte_token_ids(tok)
    return [table[b] for b in text.encode()]


def stream(tok, ids, *, skip=True, prompt=None, check_prefix_of=None):
    """Deltas of ``ids`` (and the final flush), checking on the way that what has been emitted
    never has to be taken back."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, prompt_ids=prompt)
    out = ""
    for i in ids:
        out += detok.add(i)
        if check_prefix_of is not None:
            assert check_prefix_of.startswith(out)
    return out + detok.flush()


def ids_strategy(name):
    tok = load(name)
    pool = sorted(set(tok.encode(SAMPLE, add_special_tokens=False)))
    return st.lists(st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(byte_token_ids(tok)),
                              st.sampled_from(tok.all_special_ids), st.sampled_from(pool)),
                    max_size=40)


@pytest.mark.parametrize("name", BACKENDS)
def test_random_ids_stream_equals_decode(name):
    tok = load(name)

    @SETTINGS
    @given(ids_strategy(name), st.booleans())
    def check(ids, skip):
        full = tok.decode(ids, skip_special_tokens=skip)
        assert stream(tok, ids, skip=skip, check_prefix_of=full) == full

    check()


@pytest.mark.parametrize("name", BACKENDS)
def test_text_split_into_bytes_never_emits_replacement(name):
    """Characters of 1 to 4 bytes fed one byte token at a time (the worst split): nothing comes
    out until a character is complete, and no U+FFFD ever does."""
    tok = load(name)

    @SETTINGS
    @given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20),
           st.lists(st.booleans(), max_size=20))
    def check(text, as_bytes):
        # Mix whole tokens and byte tokens: each word either encoded or spelled out in bytes.
        ids = []
        for k, word in enumerate(text.split(" ")):
            piece = (" " if k else "") + word
            if as_bytes[k] if k < len(as_bytes) else False:
                ids += as_byte_tokens(tok, piece)
            else:
                ids += tok.encode(piece, add_special_tokens=False)
        full = tok.decode(ids)
        detok = IncrementalDetokenizer(tok)
        out = ""
        for i in ids:
            delta = detok.add(i)
            assert "\ufffd" not in delta
            out += delta
        assert out + detok.flush() == full

    check()


@pytest.mark.parametrize("name", BACKENDS)
def test_cjk_and_emoji_byte_by_byte(name):
    tok = load(name)
    text = "你好, 世界 😀🚀 👨‍👩‍👧"
    ids = as_byte_tokens(tok, text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == text == tok.decode(ids)
    assert deltas[:4] == ["", "", "你", ""]  # 3 bytes, then the next character starts
    assert detok.flush() == ""


@pytest.mark.parametrize("name", BACKENDS)
def test_incomplete_character_at_the_end_is_flushed_as_decode_shows_it(name):
    tok = load(name)
    ids = tok.encode("ok", add_special_tokens=False) + as_byte_tokens(tok, "😀")[:3]
    detok = IncrementalDetokenizer(tok)
    assert detok.add_many(ids) == "ok"
    rest = detok.flush()
    assert "ok" + rest == tok.decode(ids) and rest and set(rest) == {"\ufffd"}


@pytest.mark.parametrize("name", [LLAMA2, STORIES, GGUF])
def test_sentencepiece_leading_space(name):
    """The "▁" of the first piece is dropped as decode drops it; later ones are spaces; with
    the prompt as context, the first generated piece keeps its space."""
    tok = load(name)
    ids = tok.encode("Hello world again", add_special_tokens=False)
    deltas = [IncrementalDetokenizer(tok).add(ids[0])]
    assert not deltas[0].startswith(" ")
    assert stream(tok, [tok.bos_token_id] + ids) == "Hello world again"
    prompt = tok.encode("Say:")
    assert stream(tok, ids, prompt=prompt) == " Hello world again"
    assert stream(tok, ids, prompt=prompt) == tok.decode(prompt + ids)[len(tok.decode(prompt)):]


@pytest.mark.parametrize("name", BACKENDS)
def test_special_tokens(name):
    tok = load(name)
    special = tok.eos_token_id
    ids = tok.encode("a b", add_special_tokens=False) + [special] + tok.encode(
        "c", add_special_tokens=False)
    assert stream(tok, ids) == tok.decode(ids)
    assert tok.convert_ids_to_tokens(special) not in stream(tok, ids)
    assert stream(tok, ids, skip=False) == tok.decode(ids, skip_special_tokens=False)
    assert tok.convert_ids_to_tokens(special) in stream(tok, ids, skip=False)


@pytest.mark.parametrize("name", BACKENDS)
def test_prompt_context(name):
    """With the prompt as context the deltas continue the prompt's text, whatever the prompt
    ends with (a chat header, a space, half a character completed later is not a case)."""
    tok = load(name)

    @SETTINGS
    @given(st.sampled_from(["Q: what?", "日本", "x ", "<|im_start|>assistant\n", "a😀"]),
           ids_strategy(name))
    def check(prompt_text, ids):
        prompt = tok.encode(prompt_text)
        head = tok.decode(prompt)
        full = tok.decode(prompt + ids)
        if not full.startswith(head) or head.endswith("\ufffd"):
            return  # the generated bytes rewrite the prompt's last character
        assert stream(tok, ids, prompt=prompt) == full[len(head):]

    check()


@pytest.mark.parametrize("name", BACKENDS)
def test_work_per_token_is_bounded(name):
    """A long run of bytes that never form a character (which DecodeStream alone would hold
    forever) still comes out as it goes, with a window of a few tokens."""
    tok = load(name)
    cont = byte_token_ids(tok)[0x80]  # a lone continuation byte: U+FFFD for good
    ids = tok.encode("start", add_special_tokens=False) + [cont] * 200
    detok = IncrementalDetokenizer(tok)
    out, longest = "", 0
    for i in ids:
        out += detok.add(i)
        inner = detok._stream
        window = inner.window if getattr(inner, "window", None) is not None else inner
        longest = max(longest, len(getattr(window, "ids", getattr(window, "held", []))))
    assert longest <= _MAX_HELD + 4
    assert out.count("\ufffd") >= 190
    assert out + detok.flush() == tok.decode(ids)


def test_detokenizer_from_tokenizer_and_add_many():
    tok = load(QWEN3)
    ids = tok.encode("streaming 流式 ✓")
    detok = tok.detokenizer()
    assert detok.add_many(ids[:3]) + detok.add_many(ids[3:]) + detok.flush() == tok.decode(ids)


@pytest.mark.parametrize("name", [LLAMA2, STORIES, GGUF])
def test_start_state_matches_decoding(name):
    """still_at_start (used to place a prompt's tail) agrees with the decoder's own state."""
    backend = load(name)._backend
    space = load(name).convert_tokens_to_ids("▁")

    @SETTINGS
    @given(st.lists(st.one_of(st.just(space), st.integers(0, 300), st.sampled_from([0, 1, 2])),
                    max_size=6), st.booleans(), st.booleans())
    def check(ids, skip, at_start):
        kept = [i for i in ids if not (skip and i in backend.special_ids)]
        assert backend.still_at_start(ids, skip, at_start) == backend._decode_pieces(
            kept, at_start)[1]

    check()


def test_decode_stream_is_used_and_agrees_with_the_window():
    """On text, DecodeStream (tokenizer.json) and the Python window emit the same deltas, token
    for token; DecodeStream alone does the work."""
    from fastllm.tokenizer.base import _WindowStream

    tok = load(QWEN3)
    ids = tok.encode(SAMPLE * 2, add_special_tokens=False) + as_byte_tokens(tok, "😀é")
    ids.append(tok.eos_token_id)
    detok, window = IncrementalDetokenizer(tok), _WindowStream(tok._backend, True, [])
    for i in ids:
        assert detok.add(i) == window.step(i)
    assert detok._stream.window is None
