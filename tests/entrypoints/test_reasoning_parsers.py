"""The reasoning parsers on replies written by hand: whole and streamed, split at every token
boundary of the real Qwen3 tokenizer (where ``<think>`` and ``</think>`` are single tokens),
token by token and character by character; where a reply starts, read from prompts the real
Qwen3 template writes; and the grammar that puts free reasoning before a constrained answer,
run through llguidance."""

from __future__ import annotations

import json

import pytest

from fastllm.engine.structured_output import GrammarCompiler
from fastllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from fastllm.sampling import StructuredOutputsParams
from fastllm.tokenizer import Tokenizer

# (parser, where the reply starts, reply, reasoning, answer)
CASES = [
    ("qwen3", "model", "<think>\nLet me think.\n</think>\n\nThe answer is 4.", "Let me think.",
     "The answer is 4."),
    ("qwen3", "model", "The answer is 4.", "", "The answer is 4."),
    ("qwen3", "model", "\n <thinking> is a word, <think> is not", "",
     "\n <thinking> is a word, <think> is not"),
    ("qwen3", "model", "<think>\ncut off mid-", "cut off mid-", ""),
    ("qwen3", "model", "<think>a\n\n b </think>b</think>c", "a\n\n b", "b</think>c"),
    ("qwen3", "model", "<think></think>\n\n答え", "", "答え"),
    ("qwen3", "reasoning", "Opened by the prompt.\n</think>\n\nDone", "Opened by the prompt.",
     "Done"),
    ("qwen3", "answer", "<think>x</think>y", "", "<think>x</think>y"),
    ("deepseek_r1", "reasoning", "No start marker, 日本.</think>\n\nanswer", "No start marker, 日本.",
     "answer"),
    ("deepseek_r1", "reasoning", "<think>\nr\n</think>a\n", "r", "a\n"),
    ("deepseek_r1", "reasoning", "never ends ", "never ends", ""),
    ("deepseek_r1", "reasoning", "\n\nr</think>", "r", ""),
    ("deepseek_r1", "answer", "plain", "", "plain"),
]


@pytest.fixture(scope="module")
def tokenizer(model_path) -> Tokenizer:
    return Tokenizer.from_pretrained(model_path("qwen3_tokenizer"))


def streamed(stream, pieces: list[str]) -> tuple[str, str]:
    reasoning, answer = "", ""
    for i, piece in enumerate(pieces):
        r, a = stream.feed(piece, final=i == len(pieces) - 1)
        reasoning, answer = reasoning + r, answer + a
    return reasoning, answer


def token_texts(tokenizer: Tokenizer, text: str) -> list[str]:
    """``text`` cut where its tokens meet (each piece one token's text)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


@pytest.mark.parametrize("name, start, reply, reasoning, answer", CASES)
def test_parse_whole_and_streamed(tokenizer, name, start, reply, reasoning, answer):
    parser = REASONING_PARSERS[name](tokenizer)
    assert parser.parse(reply, start) == (reasoning, answer)
    tokens = token_texts(tokenizer, reply)
    if "<think>" in reply:
        assert "<think>" in tokens  # the marker is one token: splits fall around it
    boundaries = [len("".join(tokens[:k])) for k in range(1, len(tokens))]
    for cut in boundaries:
        assert streamed(parser.stream(start), [reply[:cut], reply[cut:]]) == (reasoning, answer)
    assert streamed(parser.stream(start), tokens) == (reasoning, answer)
    assert streamed(parser.stream(start), list(reply)) == (reasoning, answer)


def test_stream_never_shows_a_marker(tokenizer):
    """Reasoning and answer are released as they come, never holding a piece of a marker."""
    parser = REASONING_PARSERS["qwen3"](tokenizer)
    stream = parser.stream("model")
    reply = "<think>\nStep one. Step two.\n</think>\n\nFour."
    released = [stream.feed(char) for char in reply]
    assert "".join(r for r, _ in released) == "Step one. Step two."
    assert "".join(a for _, a in released) == "Four."
    assert all("<" not in r + a and "/" not in r + a for r, a in released)
    # Released at once, not at the end: "Step one." is out before the marker arrives.
    assert "".join(r for r, _ in released[:reply.index("Step two")]) == "Step one."
    assert stream.in_reasoning is False


def test_where_a_reply_starts(tokenizer):
    question = [{"role": "user", "content": "2+2?"}]

    def tail(**kwargs) -> str:
        return tokenizer.apply_chat_template(question, add_generation_prompt=True, **kwargs)

    qwen3 = REASONING_PARSERS["qwen3"](tokenizer)
    r1 = REASONING_PARSERS["deepseek_r1"](tokenizer)
    # Qwen3's template closes an empty reasoning block when thinking is off.
    assert qwen3.start_of(tail(enable_thinking=False)) == "answer"
    assert r1.start_of(tail(enable_thinking=False)) == "answer"
    # With thinking on, the model writes <think> itself (qwen3), or reasons anyway (R1).
    assert qwen3.start_of(tail()) == "model"
    assert r1.start_of(tail()) == "reasoning"
    # A template that opens the block (DeepSeek-R1's, Qwen3 thinking-only models').
    assert qwen3.start_of("<|im_start|>assistant\n<think>\n") == "reasoning"


def accepts(compiler: GrammarCompiler, grammar: str, text: str, tokenizer: Tokenizer) -> bool:
    matcher = compiler.matcher(StructuredOutputsParams(grammar=grammar))
    try:
        for token in tokenizer.encode(text, add_special_tokens=False):
            matcher.advance(token)
    except ValueError:
        return False
    return matcher._matcher.is_accepting()


def test_grammar_applies_after_the_reasoning(tokenizer):
    compiler = GrammarCompiler(tokenizer, 151936)
    parser = REASONING_PARSERS["qwen3"](tokenizer)
    answer = 'start: %json {"type": "object", "properties": {"a": {"enum": [1, 2]}}, ' \
             '"required": ["a"], "additionalProperties": false}\n'
    good = json.dumps({"a": 1})
    thought = "<think>\nI may write {anything} here, even </thin.\n</think>\n\n"
    forced = parser.grammar(answer, "reasoning")
    optional = parser.grammar(answer, "model")
    assert parser.grammar(answer, "answer") == answer
    assert accepts(compiler, forced, thought + good, tokenizer)
    assert not accepts(compiler, forced, good, tokenizer)  # the reasoning must come
    assert not accepts(compiler, forced, thought + json.dumps({"a": 3}), tokenizer)
    # The reasoning ends at its first end marker: the answer cannot hold another.
    assert not accepts(compiler, forced, thought + "</think>\n\n" + good, tokenizer)
    assert accepts(compiler, optional, thought + good, tokenizer)
    assert accepts(compiler, optional, good, tokenizer)
    assert not accepts(compiler, optional, "prose", tokenizer)
    # What the grammar lets through, the parser splits back.
    assert parser.parse(thought + good, "model") == (
        "I may write {anything} here, even </thin.", good)
