"""``POST /v1/messages``: Anthropic's Messages API as a chat request of the same engine and chat
template (:meth:`OpenAIServing.run_chat`): ``system`` becomes the system message,
``stop_sequences`` stop strings, ``output_config.format`` structured output, ``tools`` and
``tool_choice`` the chat request's (``any`` is "required", ``tool`` a named function,
``disable_parallel_tool_use`` ``parallel_tool_calls: false``), ``tool_use`` blocks an
assistant's calls and ``tool_result`` blocks tool messages (an error's text marked as one);
``thinking`` turns the template's ``enable_thinking`` on or off. The reply comes back as
blocks: ``thinking`` (what the reasoning parser read), ``text``, ``tool_use``; ``stop_reason``
is ``tool_use`` when the model called tools, else ``end_turn`` (end of sequence),
``max_tokens`` or ``stop_sequence`` (with the one that matched). ``POST
/v1/messages/count_tokens`` counts the rendered prompt, tools included.

A streamed message sends Anthropic's events: ``message_start``, then per block
``content_block_start``, ``content_block_delta`` (``thinking_delta``, ``text_delta`` or
``input_json_delta``)..., ``content_block_stop``, then ``message_delta`` (stop reason and output
tokens) and ``message_stop``; an error after the start is an ``error`` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastllm.engine.outputs import RequestOutput
from fastllm.entrypoints.openai import protocol as api
from fastllm.entrypoints.openai import protocol_messages as am
from fastllm.entrypoints.openai.serving import (APIError, OpenAIServing, ReplyFormat,
                                                as_api_error, count_usage, merge_streams,
                                                named_event)

__all__ = ["MessagesServing"]

T = TypeVar("T")

# The chat request's field names as this API names them, for errors.
_PARAMS = {"stop": "stop_sequences", "response_format": "output_config.format"}


class MessagesServing:
    """Serves ``POST /v1/messages`` and its ``count_tokens`` through the chat path of
    ``serving``."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, req: am.MessagesRequest,
                     until_disconnected: Callable[[Awaitable[T]], Awaitable[T]]
                     ) -> am.MessageResponse | AsyncIterator[str]:
        """The assistant's message answering ``req``, or with ``stream`` its events."""
        if req.messages[-1].role == "assistant":
            raise APIError(400, "a final assistant message (a prefill to continue) is not "
                                "supported", param="messages")
        chat = _chat_request(req, max_tokens=req.max_tokens, temperature=req.temperature,
                             top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences,
                             stream=req.stream, response_format=_response_format(req),
                             user=None if req.metadata is None else req.metadata.user_id)
        result, reply = await self.serving.run_chat(chat, until_disconnected, _PARAMS)
        model = self.serving.response_model(req.model)
        if req.stream:
            return self._events(result, reply, model)
        output, = result
        reasoning, text, calls = reply.parse(output.outputs[0].text)
        content: list[am.ThinkingContent | am.TextContent | am.ToolUseContent] = []
        if reasoning:
            content.append(am.ThinkingContent(thinking=reasoning))
        if text or not calls:
            content.append(am.TextContent(text=text))
        content += [am.ToolUseContent(id=am.tool_use_id(), name=call.name,
                                      input=json.loads(call.arguments)) for call in calls]
        stop_reason, stop_sequence = _stop(output, bool(calls))
        return am.MessageResponse(
            id=am.message_id(), content=content, model=model,
            stop_reason=stop_reason, stop_sequence=stop_sequence, usage=_usage(output))

    def count_tokens(self, req: am.CountTokensRequest) -> am.CountTokensResponse:
        """How many tokens ``req``'s conversation is, rendered with the chat template (and its
        tools, as ``create`` shows them)."""
        chat = _chat_request(req)
        self.serving.check_model(chat.model)
        try:
            tool_use = self.serving.tool_use(chat)
        except APIError as error:
            raise error.renamed(_PARAMS) from None
        return am.CountTokensResponse(input_tokens=len(self.serving.chat_prompt(chat, tool_use)))

    async def _events(self, streams: list, reply: ReplyFormat,
                      model: str) -> AsyncIterator[str]:
        started = streams[0].first.output  # opening a stream waits for its first update
        reader, blocks = reply.reader(), _Blocks()
        try:
            yield named_event("message_start", {"message": am.MessageResponse(
                id=am.message_id(), content=[], model=model,
                usage=am.MessagesUsage(input_tokens=len(started.prompt_token_ids),
                                       output_tokens=0)).model_dump()})
            async for _, delta in merge_streams(streams):
                reasoning, text, pieces = reader.feed(delta.text,
                                                      final=delta.finish_reason is not None)
                events = []
                if reasoning:
                    events += blocks.delta(am.ThinkingContent(thinking=""),
                                           {"type": "thinking_delta", "thinking": reasoning})
                if text:
                    events += blocks.delta(am.TextContent(text=""),
                                           {"type": "text_delta", "text": text})
                for piece in pieces:
                    if piece.id is not None:  # a new call: a block of its own
                        events += blocks.open(am.ToolUseContent(id=am.tool_use_id(),
                                                                name=piece.name, input={}))
                    if piece.arguments:
                        events += blocks.delta(None, {"type": "input_json_delta",
                                                      "partial_json": piece.arguments})
                for event in events:
                    yield event
                last = delta.output
            for event in blocks.close(empty_text=True):
                yield event
            stop_reason, stop_sequence = _stop(last, bool(reader.calls))
            yield named_event("message_delta", {
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": {"output_tokens": _usage(last).output_tokens}})
            yield named_event("message_stop", {})
        except Exception as error:  # the status line is sent: say it in the stream
            failed = as_api_error(error).renamed(_PARAMS)
            yield named_event("error", {"error": am.error_body(
                failed.status, failed.message, failed.param)["error"]})


class _Blocks:
    """The content blocks of a streamed message, one open at a time and numbered in order:
    each method returns the events to send."""

    def __init__(self) -> None:
        self.count = 0  # blocks opened so far
        self.open_type: str | None = None

    def open(self, block: am.ThinkingContent | am.TextContent | am.ToolUseContent) -> list[str]:
        """Closes the open block and opens ``block`` (as it starts: empty)."""
        events = self.close()
        self.open_type = block.type
        self.count += 1
        return events + [named_event("content_block_start", {
            "index": self.count - 1, "content_block": block.model_dump()})]

    def delta(self, block: am.ThinkingContent | am.TextContent | None,
              delta: dict[str, Any]) -> list[str]:
        """``delta`` in the open block, after opening ``block`` when another kind is open
        (None: the delta continues the open block, a call's)."""
        events = [] if block is None or block.type == self.open_type else self.open(block)
        return events + [named_event("content_block_delta", {"index": self.count - 1,
                                                             "delta": delta})]

    def close(self, empty_text: bool = False) -> list[str]:
        """Closes the open block; with ``empty_text``, a message without blocks gets an empty
        text block first (Anthropic's shape of a reply with nothing to say)."""
        events = []
        if empty_text and self.count == 0:
            events = self.open(am.TextContent(text=""))
        if self.open_type is None:
            return events
        self.open_type = None
        return events + [named_event("content_block_stop", {"index": self.count - 1})]


def _text(content: str | list[am.TextBlock]) -> str:
    """The text of a string or of text blocks."""
    return content if isinstance(content, str) else "".join(block.text for block in content)


def _chat_request(req: am.CountTokensRequest, **fields: Any) -> api.ChatCompletionRequest:
    """The chat request of ``req``'s conversation, tools and thinking, with ``fields`` (the
    sampling ones) added."""
    if req.thinking is not None and req.thinking.type != "adaptive":
        fields["chat_template_kwargs"] = {"enable_thinking": req.thinking.type == "enabled"}
    tools = [api.ChatTool(type="function", function=api.FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.input_schema))
        for tool in req.tools or []]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool" and choice.name is None:
            raise APIError(400, 'a tool_choice of type "tool" needs the tool\'s name',
                           param="tool_choice.name")
        fields["tool_choice"] = (
            api.NamedToolChoice(type="function", function=api.NamedFunction(name=choice.name))
            if choice.type == "tool" else {"any": "required"}.get(choice.type, choice.type))
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return api.ChatCompletionRequest(model=req.model, messages=_messages(req),
                                     tools=tools or None, **fields)


def _messages(req: am.CountTokensRequest) -> list[dict[str, Any]]:
    """The chat messages: the system prompt first, then the conversation's; an assistant's
    tool_use blocks are its calls, a user's tool_result blocks tool messages before its text.
    Thinking blocks of earlier turns are left out, as Anthropic leaves them out of the
    context."""
    messages = [] if req.system is None else [{"role": "system", "content": _text(req.system)}]
    for i, message in enumerate(req.messages):
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        text, calls, results = [], [], 0
        for j, block in enumerate(message.content):
            turn = {"tool_use": "assistant", "tool_result": "user"}.get(block.type)
            if turn is not None and message.role != turn:
                raise APIError(400, f"{block.type} blocks belong in {turn} turns",
                               param=f"messages.{i}.content.{j}.type")
            if block.type == "text":
                text.append(block.text)
            elif block.type == "tool_use":
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name,
                    "arguments": json.dumps(block.input, ensure_ascii=False)}})
            elif block.type == "tool_result":
                result = _text(block.content or "")
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                 "content": f"Error: {result}" if block.is_error else result})
                results += 1
        if text or calls or not results:
            messages.append({"role": message.role, "content": "".join(text),
                             **({"tool_calls": calls} if calls else {})})
    return messages


def _response_format(req: am.MessagesRequest) -> api.ResponseFormat | None:
    if req.output_config is None or req.output_config.format is None:
        return None
    return api.ResponseFormat(type="json_schema", json_schema=api.JsonSchemaFormat(
        schema=req.output_config.format.json_schema))


def _stop(output: RequestOutput, called: bool) -> tuple[am.StopReason, str | None]:
    """Anthropic's stop reason (``called``: the reply called tools) and the stop sequence
    that matched."""
    completion = output.outputs[0]
    if completion.finish_reason == "length":
        return "max_tokens", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return ("tool_use" if called else "end_turn"), None


def _usage(output: RequestOutput) -> am.MessagesUsage:
    usage = count_usage([output], 1)
    return am.MessagesUsage(input_tokens=usage.prompt_tokens,
                            output_tokens=usage.completion_tokens)
