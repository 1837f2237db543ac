"""Tool calls in a chat reply, in the formats model families are trained to write them (vLLM's
``--tool-call-parser`` names):

- ``hermes`` (Hermes, Qwen 2.5/3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  per call, text around the calls;
- ``llama3_json`` (Llama 3.1-3.3): the reply is ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), possibly after ``<|python_tag|>``, several calls joined by ``;``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after any text.

Each parser reads a whole reply (:meth:`ToolParser.parse`) or a streamed one delta by delta
(:meth:`ToolParser.stream`): text is released as content only once it cannot be the start of
a call, a call is announced (index, id, name) once its name is read, then its arguments follow
in fragments, as the raw JSON text the model wrote. A call whose JSON does not hold together
is left in the content; streamed, that is decided when its name is read (a call broken later
is closed where it breaks). Whitespace between text and calls is dropped.

Each parser also writes the Lark grammar (llguidance's dialect, JSON schemas inlined with
``%json``) of its own call format restricted to given tools, with arguments valid for each
tool's ``parameters``: ``tool_choice`` ``"required"`` or a named function is enforced with it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from fastllm.tokenizer import Tokenizer

__all__ = ["PARSERS", "ToolCall", "ToolCallDelta", "ToolCallStream", "ToolParser",
           "GenericToolFormat", "detect_parser", "special_token_id", "json_lark", "lark_regex_literal", "new_call_id",
           "partial_suffix"]


def special_token_id(tokenizer: Tokenizer, text: str) -> int | None:
    """The id of the special token ``text``; None when ``text`` is no token of the vocabulary
    (whose lookup gives the unknown token's id, itself often special) or not a special one."""
    token_id = tokenizer.convert_tokens_to_ids(text)
    if token_id is None or token_id == tokenizer.unk_token_id:
        return None
    return token_id if token_id in set(tokenizer.all_special_ids) else None


def new_call_id() -> str:
    """An id in OpenAI's shape (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)


@dataclass
class ToolCallDelta:
    """A piece of a streamed call: the first one of call ``index`` has its id and name."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


# ---- a JSON object's top-level fields, from a prefix of its text ----------------------------

_WHITESPACE = re.compile(r"\s*")
_SCALAR = re.compile(r"-?[0-9][0-9.eE+-]*|true|false|null")


@dataclass
class _ObjectScan:
    """What a (possibly unfinished) JSON object's text shows so far.

    fields: key -> (start, end) of its value's text; end is None while the value is unfinished.
    end: the index after the closing brace, None while unfinished or broken.
    broken: the index where the text stops being a JSON object, or None.
    """

    fields: dict[str, tuple[int, int | None]]
    end: int | None = None
    broken: int | None = None


def _string_end(text: str, i: int) -> int | None:
    """The index after the string starting at ``text[i] == '"'``; None if unfinished."""
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at ``i``, None if unfinished; -1 if ``text[i]``
    cannot start a value. Containers are matched by brackets only (json.loads checks them)."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth = 0
        while i < len(text):
            if text[i] == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if text[i] in "{[":
                depth += 1
            elif text[i] in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    match = _SCALAR.match(text, i)
    if match is None:
        return None if "true".startswith(text[i:]) or "false".startswith(text[i:]) or \
            "null".startswith(text[i:]) else -1
    return None if match.end() == len(text) else match.end()  # more digits may come


def _scan_object(text: str, start: int) -> _ObjectScan:
    """The top-level fields of the JSON object starting at ``text[start] == '{'``."""
    scan = _ObjectScan({})
    i = _WHITESPACE.match(text, start + 1).end()
    if text[i:i + 1] == "}":
        scan.end = i + 1
        return scan
    while i < len(text):
        if text[i] != '"':
            scan.broken = i
            return scan
        key_end = _string_end(text, i)
        if key_end is None:
            return scan
        key = json.loads(text[i:key_end])
        i = _WHITESPACE.match(text, key_end).end()
        if i == len(text):
            return scan
        if text[i] != ":":
            scan.broken = i
            return scan
        i = _WHITESPACE.match(text, i + 1).end()
        if i == len(text):
            return scan
        value_end = _value_end(text, i)
        if value_end == -1:
            scan.broken = i
            return scan
        scan.fields[key] = (i, value_end)
        if value_end is None:
            return scan
        i = _WHITESPACE.match(text, value_end).end()
        if i == len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != ",":
            scan.broken = i
            return scan
        i = _WHITESPACE.match(text, i + 1).end()
    return scan


# ---- the parsers ----------------------------------------------------------------------------

class ToolParser:
    """One model family's tool-call format. Subclasses set the class attributes and, where
    the format is not "a marker, then calls", override :meth:`_find_start`.

    Attributes:
        name: the ``--tool-call-parser`` name.
        template_markers: strings whose presence in a chat template means this format.
        start: the marker that opens a run of calls.
        open, separator, close: the run's brackets and the text between its calls ("" for
            none; the close marker may be missing at the end of the reply).
        arguments_keys: the keys a call's arguments may come under, the first one written by
            the grammar.
    """

    name: ClassVar[str]
    template_markers: ClassVar[tuple[str, ...]]
    start: ClassVar[str]
    open: ClassVar[str] = ""
    separator: ClassVar[str] = ""
    close: ClassVar[str] = ""
    arguments_keys: ClassVar[tuple[str, ...]] = ("arguments",)
    # How the grammar joins the pieces (the template's own spacing).
    grammar_open: ClassVar[str] = ""
    grammar_separator: ClassVar[str] = ""
    grammar_close: ClassVar[str] = ""
    grammar_between_runs: ClassVar[str | None] = None  # None: all calls in one run

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        # A marker that is a special token (Mistral's [TOOL_CALLS]) is dropped by the
        # detokenizer unless told otherwise, and matched by llguidance only by its id.
        self.special_marker = special_token_id(tokenizer, self.start)

    @property
    def skip_special_tokens(self) -> bool:
        """Whether the reply's text may leave special tokens out (not when the marker is
        one)."""
        return self.special_marker is None

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The reply's content (the text outside the calls) and its calls."""
        stream = self.stream()
        content = stream.feed(text, final=True)[0]
        return content, [ToolCall(name, arguments, call_id)
                         for call_id, name, arguments in stream.calls]

    def stream(self) -> ToolCallStream:
        """A reader for one streamed reply."""
        return ToolCallStream(self)

    def _find_start(self, text: str, pos: int, final: bool) -> tuple[int, int | None, int]:
        """Looks for a run of calls from ``pos``: (where content surely ends, where the marker
        starts or None, where the run's body starts)."""
        index = text.find(self.start, pos)
        if index >= 0:
            return index, index, index + len(self.start)
        return len(text) - (0 if final else partial_suffix(text, pos, self.start)), None, 0

    def _run_end(self, text: str, i: int, final: bool) -> tuple[str, int] | None:
        """After a call at ``i``: ("next", index of the next call's brace), ("end", index after
        the run), or None while the text cannot tell."""
        i = _WHITESPACE.match(text, i).end()
        for kind, marker in (("next", self.separator), ("end", self.close)):
            if not marker:
                continue
            if text.startswith(marker, i):
                i = _WHITESPACE.match(text, i + len(marker)).end()
                if kind == "end":
                    return "end", i
                if i == len(text):
                    return None if not final else ("end", i)
                return ("next", i) if text[i] == "{" else ("end", i)
            if not final and marker.startswith(text[i:]):
                return None
        return "end", i

    def grammar(self, tools: list[dict[str, Any]], parallel: bool,
                optional: bool = False) -> str:
        """The Lark grammar of this format's calls of ``tools`` (OpenAI tool dicts): one call
        or, when ``parallel``, one or more; when ``optional`` (``tool_choice`` "auto"), the
        reply may instead be text, or text and then the calls."""
        key = self.arguments_keys[0]
        schema = {"anyOf": [{"type": "object",
                             "properties": {"name": {"const": tool["function"]["name"]},
                                            key: tool["function"].get("parameters")
                                            or {"type": "object"}},
                             "required": ["name", key], "additionalProperties": False}
                            for tool in tools]}
        rules = f"obj: {json_lark(schema)}\n"
        if self.grammar_between_runs is not None:  # a run per call
            rules += f"call: {self._marker_lark()} {_lark(self.grammar_open)} obj " \
                     f"{_lark(self.grammar_close)}\n"
            calls = f"{_lark(self.grammar_open)} obj {_lark(self.grammar_close)}"
            if parallel:
                calls += f" ({_lark(self.grammar_between_runs)} call)*"
        else:
            more = f" ({_lark(self.grammar_separator)} obj)*" if parallel else ""
            calls = f"{_lark(self.grammar_open)} obj{more} {_lark(self.grammar_close)}"
        top, text_rules = self._reply_lark(calls, optional)
        return f"start: {top}\n{rules}{text_rules}"

    def _reply_lark(self, calls: str, optional: bool) -> tuple[str, str]:
        """The top rule of a reply whose calls, after the start marker, are ``calls``, and the
        rules it needs: when ``optional``, text before the marker holds no marker and ends at
        the first one, and a reply may be text alone."""
        marker = self._marker_lark()
        if not optional:
            return f"{marker} {calls}", ""
        if self.special_marker is not None:  # no text holds a special token
            return (f"FREE_TEXT | FREE_TEXT {marker} {calls} | {marker} {calls}",
                    "FREE_TEXT: /(?s:.*)/\n")
        escaped = lark_regex_literal(self.start)
        return (f"FREE_TEXT | head {calls}",
                f"FREE_TEXT: /(?s:.*)/ & ~/(?s:.*){escaped}(?s:.*)/\n"
                f"head[lazy]: /(?s:.*){escaped}/\n")

    def _marker_lark(self) -> str:
        """The start marker in Lark: a special token by its id, other text as text."""
        return _lark(self.start) if self.special_marker is None else f"<[{self.special_marker}]>"


# The spacing json.dumps (and the templates) write; no free whitespace, which a small model may
# spend its tokens on.
_JSON_SPACING = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def json_lark(schema: dict[str, Any]) -> str:
    """``schema`` as an inline Lark ``%json`` rule body, in json.dumps' spacing."""
    return f"%json {json.dumps({'x-guidance': _JSON_SPACING, **schema})}"


def lark_regex_literal(text: str) -> str:
    """``text`` matched literally inside a Lark ``/.../`` regex (where "/" ends the regex)."""
    return re.escape(text).replace("/", "\\/")


def _lark(text: str) -> str:
    return json.dumps(text) if text else ""


def partial_suffix(text: str, pos: int, marker: str) -> int:
    """The length of the longest end of ``text[pos:]`` that begins ``marker``."""
    for length in range(min(len(marker) - 1, len(text) - pos), 0, -1):
        if marker.startswith(text[len(text) - length:]):
            return length
    return 0


class HermesToolParser(ToolParser):
    name = "hermes"
    template_markers = ("<tool_call>",)
    start = "<tool_call>"
    close = "</tool_call>"
    grammar_open = "\n"
    grammar_close = "\n</tool_call>"
    grammar_between_runs = "\n"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    template_markers = ("<|python_tag|>", "ipython")
    start = "<|python_tag|>"
    separator = ";"
    arguments_keys = ("parameters", "arguments")
    grammar_separator = "; "

    def _find_start(self, text: str, pos: int, final: bool) -> tuple[int, int | None, int]:
        # Calls are the whole reply: only at its start (after the tag, which the detokenizer
        # drops as a special token anyway).
        if pos > 0:
            return len(text), None, 0
        head = _WHITESPACE.match(text).end()
        if text.startswith(self.start, head):
            head = _WHITESPACE.match(text, head + len(self.start)).end()
        if text[head:head + 1] == "{":
            return 0, 0, head
        if not final and self.start.startswith(text[_WHITESPACE.match(text).end():]):
            return 0, None, 0
        return len(text), None, 0

    def _reply_lark(self, calls: str, optional: bool) -> tuple[str, str]:
        # The model may begin with the tag; the grammar starts at the JSON. Calls are the whole
        # reply: text is a reply that does not start with a brace.
        if not optional:
            return calls, ""
        return f"FREE_TEXT | {calls}", "FREE_TEXT: /(?s:.*)/ & ~/[ \\t\\r\\n]*[{](?s:.*)/\n"


class MistralToolParser(ToolParser):
    name = "mistral"
    template_markers = ("[TOOL_CALLS]",)
    start = "[TOOL_CALLS]"
    open, separator, close = "[", ",", "]"
    grammar_open, grammar_separator, grammar_close = "[", ", ", "]"


PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def detect_parser(template: str) -> str | None:
    """The parser a chat template's text calls for (its call markup), or None."""
    # Mistral's and Hermes' markers first: some templates mention "ipython" in passing.
    for name in ("mistral", "hermes", "llama3_json"):
        if any(marker in template for marker in PARSERS[name].template_markers):
            return name
    return None


class GenericToolFormat:
    """Tool calling for a model whose chat template renders no tools, or writes calls in no
    format a parser here knows (llama.cpp's generic mode, in Hermes' markup, which many small
    chat models have met): the tools are described in the system message
    (:meth:`system_prompt`), the reply is held by the Hermes grammar (calls or text under
    "auto") and read by the Hermes parser, and earlier calls and results in the conversation
    are written in that same markup (:meth:`history`), since the template has no place for
    them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.parser = HermesToolParser(tokenizer)

    @staticmethod
    def system_prompt(tools: list[dict[str, Any]], parallel: bool) -> str:
        """The description of ``tools`` (OpenAI tool dicts) and of how to call them."""
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        how_many = ("You may call several functions, one block each." if parallel
                    else "Call at most one function.")
        return ("# Tools\n\nYou may call functions to answer the user. The functions, as "
                f"JSON schemas:\n<tools>\n{listed}\n</tools>\n\nTo call a function, write a "
                "JSON object with its name and arguments in a <tool_call></tool_call> block:\n"
                '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n'
                f"</tool_call>\n{how_many} Otherwise answer in plain text. A function's result "
                "comes back in a <tool_response></tool_response> block.")

    @staticmethod
    def history(message: dict[str, Any]) -> dict[str, Any]:
        """A chat message (OpenAI's fields, a call's arguments as an object) as the template
        can show it: an assistant's calls as Hermes blocks after its text, a tool's result as a
        user message in a <tool_response> block."""
        if message["role"] == "tool":
            return {"role": "user",
                    "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
        if message["role"] != "assistant" or not message.get("tool_calls"):
            return message
        blocks = [json.dumps({"name": call["function"]["name"],
                              "arguments": call["function"]["arguments"]}, ensure_ascii=False)
                  for call in message["tool_calls"]]
        calls = "\n".join(f"<tool_call>\n{block}\n</tool_call>" for block in blocks)
        text = message.get("content") or ""
        rest = {k: v for k, v in message.items() if k not in ("content", "tool_calls")}
        return {**rest, "content": f"{text}\n\n{calls}" if text else calls}


# ---- reading a reply delta by delta ------------------------------------------------------------

class ToolCallStream:
    """Reads one reply as it comes: :meth:`feed` takes each new piece of text and returns the
    content and call pieces it releases. ``calls`` holds (id, name, arguments) of the calls
    announced so far."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.pos = 0  # text before this is handed out (or dropped)
        self.calls: list[tuple[str, str, str]] = []
        # "content"; "run": after a marker; "call": at a call's brace; "between": after a call
        self._state = "content"
        self._marker = 0  # where the current run's marker starts
        self._first = True  # the current call is its run's first (not yet announced)
        self._announced = False  # the current call is in `calls`
        self._after_run = False  # whitespace at pos follows a run: dropped
        self._gap = ""  # the whitespace before the current run's marker

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """Takes ``delta`` (``final``: the reply ends with it); returns the content released
        and the call pieces, in order (content only ever comes before a call's first piece
        or between calls)."""
        self.text += delta
        content: list[str] = []
        pieces: list[ToolCallDelta] = []
        while self._step(final, content, pieces):
            pass
        return "".join(content), pieces

    def _step(self, final: bool, content: list[str], pieces: list[ToolCallDelta]) -> bool:
        """Advances as far as one state allows; whether to go on."""
        text, parser = self.text, self.parser
        if self._state == "content":
            certain, marker, body = parser._find_start(text, self.pos, final)
            piece = text[self.pos:certain if marker is None else marker]
            if self._after_run:
                stripped = piece.lstrip()
                self.pos += len(piece) - len(stripped)
                piece = stripped
                self._after_run = not piece
            if marker is None:
                # Whitespace may be followed by a call: hold it until something else comes.
                kept = piece if final else piece.rstrip()
                content.append(kept)
                self.pos += len(kept)
                return False
            content.append(piece.rstrip())
            self._gap = piece[len(content[-1]):]  # dropped if calls follow
            self._state, self._marker, self.pos = "run", marker, body
            self._first, self._after_run = True, True
            return True
        if self._state == "run":  # after the marker: the opening bracket, then a brace
            i = _WHITESPACE.match(text, self.pos).end()
            if parser.open and text.startswith(parser.open, i):
                i = _WHITESPACE.match(text, i + len(parser.open)).end()
            elif parser.open and i < len(text):
                return self._not_a_call(content)
            if i == len(text):
                if final:
                    return self._not_a_call(content)
                return False
            if text[i] != "{":
                return self._not_a_call(content)
            self._state, self.pos = "call", i
            return True
        if self._state == "between":  # after a call: the next one, or the run's end
            after = parser._run_end(text, self.pos, final)
            if after is None:
                return False
            kind, self.pos = after
            self._state = "call" if kind == "next" else "content"
            self._after_run = True
            return True
        return self._call(final, content, pieces)

    def _not_a_call(self, content: list[str]) -> bool:
        """The run at the marker is not calls after all: its text is content."""
        if self._first:
            self._state, self.pos, self._after_run = "content", self._marker, False
            # The marker itself is content now: step past it so it is not found again.
            content.append(self._gap + self.text[self._marker:
                                                 self._marker + len(self.parser.start)])
            self.pos = self._marker + len(self.parser.start)
            return True
        self._state, self._after_run = "content", False
        return True

    def _call(self, final: bool, content: list[str], pieces: list[ToolCallDelta]) -> bool:
        text, start = self.text, self.pos
        scan = _scan_object(text, start)
        if not self._announced:
            name = self._name(scan, text, start, final)
            if name is None:
                if scan.broken is not None or scan.end is not None or final:
                    return self._not_a_call(content)
                return False
            self.calls.append((new_call_id(), name, ""))
            self._announced = True
            pieces.append(ToolCallDelta(len(self.calls) - 1, id=self.calls[-1][0], name=name))
        arguments = self._arguments(scan, text)
        call_id, name, sent = self.calls[-1]
        if len(arguments) > len(sent) and arguments.startswith(sent):
            pieces.append(ToolCallDelta(len(self.calls) - 1, arguments=arguments[len(sent):]))
            self.calls[-1] = (call_id, name, arguments)
        if scan.end is None and scan.broken is None and not final:
            return False
        # The call is over: whole, broken (the rest is content) or cut off by the reply's end.
        self._announced, self._first = False, False
        if scan.end is None:
            self._state, self.pos, self._after_run = "content", scan.broken or len(text), False
            return scan.broken is not None
        self._state, self.pos = "between", scan.end
        return True

    def _name(self, scan: _ObjectScan, text: str, start: int, final: bool) -> str | None:
        """The call's name once it may be announced: the name is read and, if the object is
        whole, the object is a call (a dict with a string name and object arguments)."""
        if scan.end is not None:
            try:
                call = json.loads(text[start:scan.end])
            except json.JSONDecodeError:
                return None
            arguments = next((call[k] for k in self.parser.arguments_keys if k in call), {})
            if isinstance(call.get("name"), str) and isinstance(arguments, dict):
                return call["name"]
            return None
        if final or "name" not in scan.fields or scan.fields["name"][1] is None:
            return None
        value_start, value_end = scan.fields["name"]
        name = json.loads(text[value_start:value_end]) if text[value_start] == '"' else None
        return name if isinstance(name, str) else None

    def _arguments(self, scan: _ObjectScan, text: str) -> str:
        """The arguments' text so far: the raw JSON of the value; "{}" for a whole call
        without them."""
        key = next((k for k in self.parser.arguments_keys if k in scan.fields), None)
        if key is None:
            return "{}" if scan.end is not None else ""
        value_start, value_end = scan.fields[key]
        if value_end is not None:
            return text[value_start:value_end]
        return text[value_start:].rstrip() if text[value_start] in "{[" else ""
