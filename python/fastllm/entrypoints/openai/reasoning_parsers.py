"""Reasoning in a reply, as reasoning models write it (vLLM's ``--reasoning-parser`` names):
``qwen3`` (Qwen3, SmolLM3) and ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ) both think
between ``<think>`` and ``</think>`` and answer after it.

Where a reply starts is read from the end of its prompt (:meth:`ReasoningParser.start_of`):

- a prompt that ends with an empty, closed ``<think></think>`` (Qwen3 with
  ``chat_template_kwargs: {"enable_thinking": false}``) leaves the reply in the answer;
- one that opens ``<think>`` (DeepSeek-R1's template, Qwen3's thinking-only models') leaves it
  in the reasoning;
- otherwise the model decides: ``qwen3`` reads a reply that opens ``<think>`` itself as
  reasoning and any other as the answer (Qwen3's hybrid models write the marker when they
  think; a non-thinking Qwen3 never does), ``deepseek_r1`` reads every reply as reasoning up
  to ``</think>`` (R1 often leaves the opening marker out).

A ``<think>`` at the reply's start is dropped; a reply that never writes ``</think>`` after
starting in the reasoning is all reasoning. The reasoning and the answer come without the
whitespace around them.

A reply read delta by delta (:meth:`ReasoningParser.stream`) releases reasoning and answer text
as soon as it cannot be part of a marker (or of whitespace that ends the reasoning). A
constraint on the answer (a forced tool call, a JSON schema) applies once the reasoning ends:
:meth:`ReasoningParser.grammar` puts free reasoning up to the end marker before it.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, ClassVar, Literal

from fastllm.entrypoints.openai.tool_parsers import (
    lark_regex_literal, partial_suffix, special_token_id)

if TYPE_CHECKING:
    from fastllm.tokenizer import Tokenizer

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStream", "ReplyStart"]

# Where a reply starts: in the reasoning, in the answer, or as its first characters say.
ReplyStart = Literal["reasoning", "answer", "model"]


class ReasoningParser:
    """Reasoning between a start and an end marker, then the answer.

    Attributes:
        name: the ``--reasoning-parser`` name.
        start, end: the markers.
        needs_start: whether a reply the prompt leaves to the model reasons only when it
            opens with ``start`` (else it reasons until ``end`` whatever it starts with).
    """

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    needs_start: ClassVar[bool]

    def __init__(self, tokenizer: Tokenizer) -> None:
        # A marker that is a special token is dropped by the detokenizer unless told otherwise,
        # and matched by llguidance only by its id.
        self.special_start = special_token_id(tokenizer, self.start)
        self.special_end = special_token_id(tokenizer, self.end)
        self.special_markers = self.special_start is not None or self.special_end is not None

    @property
    def skip_special_tokens(self) -> bool:
        """Whether the reply's text may leave special tokens out (not when a marker is one)."""
        return not self.special_markers

    def start_of(self, prompt_tail: str) -> ReplyStart:
        """Where a reply to a prompt ending with ``prompt_tail`` starts."""
        tail = prompt_tail.rstrip()
        if tail.endswith(self.end):
            return "answer"
        if tail.endswith(self.start) or not self.needs_start:
            return "reasoning"
        return "model"

    def parse(self, text: str, start: ReplyStart) -> tuple[str, str]:
        """A whole reply's reasoning and answer."""
        return self.stream(start).feed(text, final=True)

    def stream(self, start: ReplyStart) -> ReasoningStream:
        """A reader for one streamed reply."""
        return ReasoningStream(self, start)

    def grammar(self, answer: str, start: ReplyStart) -> str:
        """The Lark grammar of a reply starting at ``start`` whose answer derives ``answer`` (a
        Lark grammar whose top rule is ``start``): free reasoning up to the end marker and the
        blank line models write after it, then the answer (when the model decides, the
        reasoning, opened by its start marker, may be left out)."""
        if start == "answer":
            return answer
        renamed = re.sub(r"^start:", "answer:", answer, flags=re.MULTILINE)
        if self.special_end is not None:
            reasoning = f"reasoning: REASONING_TEXT <[{self.special_end}]>\n" \
                        "REASONING_TEXT: /(?s:.*)/\n"
        else:
            # Lazy: the reasoning ends at the first end marker.
            reasoning = f"reasoning[lazy]: /(?s:.*){lark_regex_literal(self.end)}/\n"
        top = f"reasoning {json.dumps(chr(10) * 2)} answer"
        if start == "model":
            # The reply opens with the start marker or is the answer: llguidance cannot weigh
            # free reasoning against the answer's first token, a marker it can.
            marker = json.dumps(self.start) if self.special_start is None \
                else f"<[{self.special_start}]>"
            top = f"{marker} {top} | answer"
        return f"start: {top}\n{reasoning}{renamed}"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    needs_start = True


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    needs_start = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}


class ReasoningStream:
    """Reads one reply as it comes: :meth:`feed` takes each new piece of text and returns the
    reasoning and answer text it releases."""

    def __init__(self, parser: ReasoningParser, start: ReplyStart) -> None:
        self.parser = parser
        self.text = ""
        self.pos = 0  # text before this is handed out (or dropped)
        # "head": before the reasoning (a start marker may come); "reasoning"; "answer_head":
        # whitespace after the end marker; "answer"
        self._state = "answer" if start == "answer" else "head"
        self._needs_start = start == "model"  # no start marker: the reply is the answer
        self._reasoning_started = False  # whitespace before the reasoning's first character
        self._held = ""  # whitespace the reasoning ends with so far: released if more follows

    @property
    def in_reasoning(self) -> bool:
        """Whether the reply may still be in its reasoning."""
        return self._state in ("head", "reasoning")

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """Takes ``delta`` (``final``: the reply ends with it); returns the reasoning and the
        answer text released."""
        self.text += delta
        reasoning: list[str] = []
        answer: list[str] = []
        text, start, end = self.text, self.parser.start, self.parser.end
        while True:
            if self._state == "head":
                rest = text[self.pos:].lstrip()
                head = len(text) - len(rest)
                if not final and (not rest or start.startswith(rest)) and rest != start:
                    break  # whitespace, or what may be the start marker
                if rest.startswith(start):
                    self.pos, self._state = head + len(start), "reasoning"
                else:  # the answer keeps its leading whitespace when there is no reasoning
                    self._state = "answer" if self._needs_start else "reasoning"
            elif self._state == "reasoning":
                index = text.find(end, self.pos)
                stop = index if index >= 0 else len(text) - (
                    0 if final else partial_suffix(text, self.pos, end))
                reasoning.append(self._reasoning(text[self.pos:stop], ends=index >= 0 or final))
                self.pos = stop
                if index < 0:
                    break
                self.pos, self._state = index + len(end), "answer_head"
            elif self._state == "answer_head":
                rest = text[self.pos:].lstrip()
                self.pos = len(text) - len(rest)
                if not rest:
                    break
                self._state = "answer"
            else:
                answer.append(text[self.pos:])
                self.pos = len(text)
                break
        return "".join(reasoning), "".join(answer)

    def _reasoning(self, piece: str, ends: bool) -> str:
        """A piece of reasoning to release: leading whitespace dropped, trailing whitespace held
        until more reasoning follows (dropped when the reasoning ``ends`` here)."""
        if not self._reasoning_started:
            piece = piece.lstrip()
            self._reasoning_started = bool(piece)
        body = self._held + piece
        released = body.rstrip()
        self._held = "" if ends else body[len(released):]
        return released
