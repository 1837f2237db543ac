"""The tool-call parsers on replies written by hand in each family's format: whole and streamed
(character by character, so every split inside the markup and the JSON is met, and in random
pieces), several calls, text around them, malformed calls left as text; the template sniffing;
and each format's grammar, run through llguidance with the real Qwen3 tokenizer, accepting its
own calls and nothing outside the tools' schemas."""

from __future__ import annotations

import json
import random

import pytest

from fastllm.engine.structured_output import GrammarCompiler
from fastllm.entrypoints.openai.tool_parsers import PARSERS, detect_parser
from fastllm.sampling import StructuredOutputsParams
from fastllm.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TRICKY_ARGS = '{"q": "a } \\" {", "n": [1, {"x": 2}], "ok": true}'

# (format, reply, content, [(name, arguments)])
CASES = [
    ("hermes", 'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 2}}\n</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Paris", "days": 2}')]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
               f'{{"name": "b", "arguments": {TRICKY_ARGS}}}\n</tool_call>\nDone.',
     "Done.", [("a", "{}"), ("b", TRICKY_ARGS)]),
    ("hermes", '<tool_call>{"arguments": {"x": 1}, "name": "late_name"}</tool_call>', "",
     [("late_name", '{"x": 1}')]),
    ("hermes", '<tool_call>\n{"name": "no_close", "arguments": {"x": [1]}}', "",
     [("no_close", '{"x": [1]}')]),
    ("hermes", '<tool_call>\n{"name": "no_arguments"}\n</tool_call>', "", [("no_arguments", "{}")]),
    ("hermes", "a < b, <tool and <tool_call> alone", "a < b, <tool and <tool_call> alone", []),
    ("hermes", "<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after",
     []),
    ("hermes", '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
     '<tool_call>{"name": 3, "arguments": {}}</tool_call>', []),
    ("hermes", "\n plain reply, spaces kept \n", "\n plain reply, spaces kept \n", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}', "",
     [("get_weather", '{"city": "Oslo", "days": 1}')]),
    ("llama3_json", '<|python_tag|>{"name": "a", "arguments": {"x": 1}}; '
                    f'{{"name": "b", "parameters": {TRICKY_ARGS}}}', "",
     [("a", '{"x": 1}'), ("b", TRICKY_ARGS)]),
    ("llama3_json", 'The answer is {"name": "a", "parameters": {}}',
     'The answer is {"name": "a", "parameters": {}}', []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, '
                f'{{"name": "b", "arguments": {TRICKY_ARGS}}}]',
     "Sure.", [("a", '{"x": 1}'), ("b", TRICKY_ARGS)]),
    ("mistral", "[TOOL_CALLS] no list", "[TOOL_CALLS] no list", []),
]


@pytest.fixture(scope="module")
def tokenizer(model_path) -> Tokenizer:
    return Tokenizer.from_pretrained(model_path("qwen3_tokenizer"))


def streamed(parser, pieces: list[str]):
    """The content and calls a stream releases, checking the deltas' shape on the way."""
    stream = parser.stream()
    content, calls = "", []
    for i, piece in enumerate(pieces):
        text, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        content += text
        for delta in deltas:
            if delta.id is not None:  # a call's first piece: index, id and name
                assert delta.index == len(calls) and delta.name and delta.id.startswith("call_")
                calls.append([delta.name, delta.arguments])
            else:
                assert delta.index == len(calls) - 1 and delta.name is None
                calls[-1][1] += delta.arguments
    return content, [tuple(call) for call in calls]


@pytest.mark.parametrize("name, reply, content, calls", CASES)
def test_parse_whole_and_streamed(tokenizer, name, reply, content, calls):
    parser = PARSERS[name](tokenizer)
    got_content, got_calls = parser.parse(reply)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for call in got_calls:
        assert call.id.startswith("call_") and json.loads(call.arguments) is not None
    assert len({c.id for c in got_calls}) == len(got_calls)
    assert streamed(parser, list(reply)) == (content, calls)  # every split
    rng = random.Random(reply)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(reply)), min(4, len(reply) - 1)))
        pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
        assert streamed(parser, pieces) == (content, calls)


def test_stream_never_shows_markup_as_content(tokenizer):
    parser = PARSERS["hermes"](tokenizer)
    stream = parser.stream()
    reply = 'Hi <tool_call>\n{"name": "a", "arguments": {"x": "y"}}\n</tool_call>'
    released = [stream.feed(char)[0] for char in reply]
    assert "".join(released) == "Hi"
    assert all("<" not in text for text in released)
    # The call is announced as soon as its name is read, before its arguments end.
    stream = parser.stream()
    _, deltas = stream.feed('<tool_call>\n{"name": "a", "arguments": {"x": "y')
    assert [(d.name, d.arguments) for d in deltas] == [("a", ""), (None, '{"x": "y')]


def test_malformed_calls_are_text(tokenizer):
    parser = PARSERS["hermes"](tokenizer)
    for reply in ['<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>',
                  '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',
                  '<tool_call>\n{"name": "f", "arguments": {"a": 1}',  # cut off
                  '<tool_call>\n{"name": "f", "argu']:
        assert parser.parse(reply) == (reply, [])


def test_detect_parser(tokenizer):
    assert detect_parser(tokenizer.chat_template) == "hermes"
    assert detect_parser("{{ '[TOOL_CALLS]' }}{{ tool_call | tojson }}") == "mistral"
    assert detect_parser("<|start_header_id|>ipython<|end_header_id|>") == "llama3_json"
    assert detect_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None


class _MistralLike:
    """The Qwen3 tokenizer with its special <|im_start|> standing for Mistral's special
    [TOOL_CALLS], so the grammar has to name a special token."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.all_special_ids = tokenizer.all_special_ids
        self.unk_token_id = tokenizer.unk_token_id
        self.marker = tokenizer.convert_tokens_to_ids("<|im_start|>")

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.marker if token == "[TOOL_CALLS]" else None


def accepts(compiler: GrammarCompiler, grammar: str, ids: list[int]) -> bool:
    matcher = compiler.matcher(StructuredOutputsParams(grammar=grammar))
    try:
        for token in ids:
            matcher.advance(token)
    except ValueError:
        return False
    return matcher._matcher.is_accepting()


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_grammar_is_the_parsers_format(tokenizer, name):
    compiler = GrammarCompiler(tokenizer, 151936)
    parser = PARSERS[name](_MistralLike(tokenizer) if name == "mistral" else tokenizer)
    key = parser.arguments_keys[0]
    one = json.dumps({"name": "get_weather", key: {"city": "Paris", "days": 3}})
    two = json.dumps({"name": "get_time", key: {}})
    replies = {"hermes": (f"<tool_call>\n{one}\n</tool_call>",
                          f"<tool_call>\n{one}\n</tool_call>\n<tool_call>\n{two}\n</tool_call>"),
               "llama3_json": (one, f"{one}; {two}"),
               "mistral": (f"[{one}]", f"[{one}, {two}]")}[name]
    prefix = [parser.tokenizer.marker] if name == "mistral" else []
    # A special marker must stay in the reply's text for the parser to see it.
    assert parser.skip_special_tokens == (name != "mistral")

    def ids(text: str) -> list[int]:
        return prefix + tokenizer.encode(text, add_special_tokens=False)

    single = parser.grammar([WEATHER, TIME], parallel=False)
    parallel = parser.grammar([WEATHER, TIME], parallel=True)
    assert accepts(compiler, single, ids(replies[0]))
    assert not accepts(compiler, single, ids(replies[1]))
    assert accepts(compiler, parallel, ids(replies[1]))
    for bad in ({"city": "Rome", "days": 3}, {"city": "Paris"}, {"city": "Paris", "days": 0},
                {"city": "Paris", "days": 3, "extra": 1}):
        text = replies[0].replace(json.dumps({"city": "Paris", "days": 3}), json.dumps(bad))
        assert not accepts(compiler, single, ids(text)), bad
    renamed = replies[0].replace("get_weather", "get_wether")
    assert not accepts(compiler, single, ids(renamed))
    # What the grammar lets through, the parser reads back.
    text = tokenizer.decode(ids(replies[1]), skip_special_tokens=False).replace(
        "<|im_start|>", "[TOOL_CALLS]")
    _, calls = parser.parse(text)
    assert [c.name for c in calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_optional_grammar_is_text_or_calls(tokenizer, name):
    """tool_choice "auto" held by a grammar: text alone, or (text and) valid calls; one call
    at most when not ``parallel``."""
    compiler = GrammarCompiler(tokenizer, 151936)
    parser = PARSERS[name](_MistralLike(tokenizer) if name == "mistral" else tokenizer)
    key = parser.arguments_keys[0]
    one = json.dumps({"name": "get_weather", key: {"city": "Paris", "days": 3}})
    bad = json.dumps({"name": "get_weather", key: {"city": "Rome", "days": 3}})
    two = json.dumps({"name": "get_time", key: {}})
    marker = [parser.tokenizer.marker] if name == "mistral" else []

    def ids(text: str, calls: str | None) -> list[int]:
        head = tokenizer.encode(text, add_special_tokens=False) if text else []
        if calls is None:
            return head
        body = {"hermes": "<tool_call>\n" + calls.replace(
                    "\n\n", "\n</tool_call>\n<tool_call>\n") + "\n</tool_call>",
                "llama3_json": calls.replace("\n\n", "; "),
                "mistral": "[" + calls.replace("\n\n", ", ") + "]"}[name]
        return head + marker + tokenizer.encode(body, add_special_tokens=False)

    single = parser.grammar([WEATHER, TIME], parallel=False, optional=True)
    parallel = parser.grammar([WEATHER, TIME], parallel=True, optional=True)
    for grammar in (single, parallel):
        assert accepts(compiler, grammar, ids("It is sunny, {maybe}.", None))
        assert accepts(compiler, grammar, ids("", one))
        assert not accepts(compiler, grammar, ids("", bad))
        if name != "llama3_json":  # its calls are the whole reply
            assert accepts(compiler, grammar, ids("Let me check.\n\n", one))
            # Text holding the marker is the start of calls, not text.
            held = (ids("a ", None) + marker + ids(" b", None) if name == "mistral"
                    else ids("a " + parser.start + " b", None))
            assert not accepts(compiler, grammar, held)
    assert not accepts(compiler, single, ids("", f"{one}\n\n{two}"))
    assert accepts(compiler, parallel, ids("", f"{one}\n\n{two}"))


def test_a_marker_missing_from_the_vocabulary_is_text(model_path):
    """Llama 2's vocabulary has no <tool_call> nor <think>: looking them up gives the unknown
    token, which is special, but the markers are text, not that token."""
    from fastllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS

    llama2 = Tokenizer.from_pretrained(model_path("llama2_tokenizer"))
    assert llama2.convert_tokens_to_ids("<tool_call>") in llama2.all_special_ids
    assert PARSERS["hermes"](llama2).special_marker is None
    assert REASONING_PARSERS["qwen3"](llama2).skip_special_tokens
