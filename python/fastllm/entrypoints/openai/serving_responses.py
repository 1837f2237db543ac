"""``POST /v1/responses``: OpenAI's Responses API, stateless, as a chat request of the same
engine and chat template (:meth:`OpenAIServing.run_chat`): ``instructions`` become the system
message, ``input`` the conversation (``function_call`` items an assistant's calls,
``function_call_output`` items tool messages), ``text.format`` structured output, ``tools``,
``tool_choice`` and ``parallel_tool_calls`` the chat request's. The output is a ``reasoning``
item (with a reasoning parser), a ``message`` item and a ``function_call`` item per call.

A streamed response sends the API's events, numbered: ``response.created``,
``response.in_progress``, then per output item ``response.output_item.added``, its content's
events (``response.content_part.added``, ``response.reasoning_text.delta`` or
``response.output_text.delta``..., their ``.done``, ``response.content_part.done``; for a call
``response.function_call_arguments.delta``... and ``.done``) and
``response.output_item.done``, then ``response.completed`` (or ``response.incomplete`` when
``max_output_tokens`` ended it, as OpenAI does).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastllm.engine.outputs import RequestOutput
from fastllm.entrypoints.openai import protocol as api
from fastllm.entrypoints.openai import protocol_responses as rs
from fastllm.entrypoints.openai.serving import (APIError, OpenAIServing, ReplyFormat,
                                                as_api_error, count_usage, merge_streams,
                                                named_event)

__all__ = ["ResponsesServing"]

T = TypeVar("T")

# The include value that adds output tokens' logprobs to output_text.
_LOGPROBS = "message.output_text.logprobs"
# The chat request's field names as this API names them, for errors.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
           "response_format": "text.format"}


class ResponsesServing:
    """Serves ``POST /v1/responses`` through the chat path of ``serving``."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, req: rs.ResponsesRequest,
                     until_disconnected: Callable[[Awaitable[T]], Awaitable[T]]
                     ) -> rs.ResponseObject | AsyncIterator[str]:
        """The response to ``req``, or with ``stream`` its events."""
        _refuse_what_needs_state(req)
        logprobs = req.include is not None and _LOGPROBS in req.include
        top = (req.top_logprobs or 0) if logprobs else 0
        chat = api.ChatCompletionRequest(
            model=req.model, messages=_messages(req), max_completion_tokens=req.max_output_tokens,
            temperature=req.temperature, top_p=req.top_p, user=req.user,
            response_format=_response_format(req.text), stream=req.stream,
            tools=[api.ChatTool(type="function", function=api.FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.parameters,
                strict=tool.strict)) for tool in req.tools] if req.tools else None,
            tool_choice=api.NamedToolChoice(type="function", function=api.NamedFunction(
                name=req.tool_choice.name)) if isinstance(req.tool_choice, rs.FunctionChoice)
            else req.tool_choice, parallel_tool_calls=req.parallel_tool_calls,
            logprobs=logprobs, top_logprobs=top if logprobs else None)
        started = _response(req, self.serving.response_model(req.model))
        result, reply = await self.serving.run_chat(chat, until_disconnected, _PARAMS)
        if req.stream:
            return self._events(started, result, reply, top if logprobs else None)
        output, = result
        reasoning, text, calls = reply.parse(output.outputs[0].text)
        status = _status(output)
        items: list[rs.OutputItem] = []
        if reasoning:
            items.append(rs.ReasoningItem(id=rs.response_id("rs"), status=status,
                                          content=[rs.ReasoningText(text=reasoning)]))
        if text or not calls:
            # As vLLM: every output token's logprobs, the reasoning's included.
            entries = self._logprobs(output.outputs[0].logprobs, top) if logprobs else []
            items.append(rs.OutputMessage(id=rs.response_id("msg"), status=status, content=[
                rs.OutputText(text=text, logprobs=entries)]))
        items += [rs.FunctionCallItem(id=rs.response_id("fc"), call_id=call.id, name=call.name,
                                      arguments=call.arguments, status="completed")
                  for call in calls]
        return _finished(started, items, output)

    def _logprobs(self, entries: list | None, top: int) -> list[dict[str, Any]]:
        """Sampled tokens' logprob entries as output_text shows them (the chat API's
        token, logprob, bytes and top_logprobs)."""
        return [token.model_dump() for token in
                self.serving.chat_logprobs(entries, top).content]

    async def _events(self, started: rs.ResponseObject, streams: list, reply: ReplyFormat,
                      top: int | None) -> AsyncIterator[str]:
        """The response's events; with ``top`` (logprobs included), each output_text delta
        carries the logprobs of the tokens since the last one."""
        numbers = itertools.count()

        def event(name: str, **body: Any) -> str:
            return named_event(name, {**body, "sequence_number": next(numbers)})

        items = _StreamedItems(event)
        reader = reply.reader()
        try:
            yield event("response.created", response=started.model_dump())
            yield event("response.in_progress", response=started.model_dump())
            last = None
            pending: list[dict[str, Any]] = []  # logprobs of tokens not yet in a delta
            async for _, delta in merge_streams(streams):
                last = delta.output
                if top is not None:
                    pending += self._logprobs(delta.logprobs, top)
                reasoning, text, pieces = reader.feed(delta.text,
                                                      final=delta.finish_reason is not None)
                events: list[str] = []
                if reasoning:
                    events += items.text("reasoning", reasoning)
                if text:
                    events += items.text("message", text, pending)
                    pending = []
                for piece in pieces:
                    if piece.id is not None:
                        events += items.call(piece.id, piece.name)
                    if piece.arguments:
                        events += items.arguments(piece.arguments)
                for line in events:
                    yield line
            if pending and items.kind == "message":  # tokens without text (an end token)
                for line in items.text("message", "", pending):
                    yield line
            for line in items.close(_status(last), empty_message=True):
                yield line
            done = _finished(started, items.done, last)
            yield event(f"response.{done.status}", response=done.model_dump())
        except Exception as error:  # the status line is sent: say it in the stream
            failed = as_api_error(error).renamed(_PARAMS)
            yield event("error", code=failed.code, message=failed.message, param=failed.param)


class _StreamedItems:
    """The output items of a streamed response, one open at a time and numbered in order:
    each method returns the events to send (``event`` writes one)."""

    def __init__(self, event: Callable[..., str]) -> None:
        self.event = event
        self.done: list[rs.OutputItem] = []  # closed items, as the final response lists them
        self.kind: str | None = None  # the open item's: "reasoning", "message" or "call"
        self.id, self.body = "", ""  # the open item's id and text (or arguments) so far
        self.logprobs: list[dict[str, Any]] = []  # the open message's token logprobs so far
        self._call: tuple[str, str] = ("", "")  # the open call's call id and name

    def text(self, kind: str, delta: str,
             logprobs: list[dict[str, Any]] | None = None) -> list[str]:
        """``delta`` of a reasoning or message item (a message's with ``logprobs``), opening
        one unless that kind is open."""
        events = [] if self.kind == kind else self._open(kind)
        self.body += delta
        if kind == "reasoning":
            return events + [self.event("response.reasoning_text.delta", **self._at(),
                                        delta=delta)]
        self.logprobs += logprobs or []
        return events + [self.event("response.output_text.delta", **self._at(), delta=delta,
                                    logprobs=logprobs or [])]

    def call(self, call_id: str, name: str) -> list[str]:
        """Opens a function_call item."""
        self._call = (call_id, name)
        return self._open("call")

    def arguments(self, delta: str) -> list[str]:
        """``delta`` of the open call's arguments."""
        self.body += delta
        return [self.event("response.function_call_arguments.delta", item_id=self.id,
                           output_index=len(self.done), delta=delta)]

    def close(self, status: str, empty_message: bool = False) -> list[str]:
        """Closes the open item (its status ``status`` unless a call's); with
        ``empty_message``, a response without items gets an empty message first."""
        events = self._open("message") if empty_message and not self.done and \
            self.kind is None else []
        if self.kind is None:
            return events
        if self.kind == "call":
            call_id, name = self._call
            item: rs.OutputItem = rs.FunctionCallItem(id=self.id, call_id=call_id, name=name,
                                                      arguments=self.body, status="completed")
            events.append(self.event("response.function_call_arguments.done", item_id=self.id,
                                     output_index=len(self.done), arguments=self.body))
        else:
            if self.kind == "reasoning":
                part: rs.ReasoningText | rs.OutputText = rs.ReasoningText(text=self.body)
                item = rs.ReasoningItem(id=self.id, status=status, content=[part])
                events.append(self.event("response.reasoning_text.done", **self._at(),
                                         text=self.body))
            else:
                part = rs.OutputText(text=self.body, logprobs=self.logprobs)
                item = rs.OutputMessage(id=self.id, status=status, content=[part])
                events.append(self.event("response.output_text.done", **self._at(),
                                         text=self.body, logprobs=self.logprobs))
            events.append(self.event("response.content_part.done", **self._at(),
                                     part=part.model_dump()))
        events.append(self.event("response.output_item.done", output_index=len(self.done),
                                 item=item.model_dump()))
        self.done.append(item)
        self.kind, self.body, self.logprobs = None, "", []
        return events

    def _open(self, kind: str) -> list[str]:
        events = self.close("completed")
        self.kind, self.body = kind, ""
        if kind == "call":
            self.id = rs.response_id("fc")
            call_id, name = self._call
            item: rs.OutputItem = rs.FunctionCallItem(id=self.id, call_id=call_id, name=name,
                                                      arguments="", status="in_progress")
            return events + [self.event("response.output_item.added",
                                        output_index=len(self.done), item=item.model_dump())]
        if kind == "reasoning":
            self.id = rs.response_id("rs")
            item, part = (rs.ReasoningItem(id=self.id, status="in_progress", content=[]),
                          rs.ReasoningText(text=""))
        else:
            self.id = rs.response_id("msg")
            item, part = (rs.OutputMessage(id=self.id, status="in_progress", content=[]),
                          rs.OutputText(text=""))
        return events + [
            self.event("response.output_item.added", output_index=len(self.done),
                       item=item.model_dump()),
            self.event("response.content_part.added", **self._at(), part=part.model_dump())]

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.id, "output_index": len(self.done), "content_index": 0}


def _refuse_what_needs_state(req: rs.ResponsesRequest) -> None:
    stateful = {"store": req.store, "previous_response_id": req.previous_response_id,
                "conversation": req.conversation, "background": req.background}
    for field, value in stateful.items():
        if value not in (None, False):
            raise APIError(400, f"{field} is not supported: this server keeps no state, send "
                                f"the whole conversation in input", param=field)


def _messages(req: rs.ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages: the instructions as the system message, then the input's items (a
    run of function_call items one assistant message's calls, joined to the assistant text
    before them; reasoning items left out, as OpenAI leaves them out of the context)."""
    messages: list[dict[str, Any]] = [] if req.instructions is None else [
        {"role": "system", "content": req.instructions}]
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        if isinstance(item, rs.FunctionCallInput):
            try:
                json.loads(item.arguments)
            except json.JSONDecodeError as error:
                raise APIError(400, f"a function call's arguments are not JSON: {error}",
                               param=f"input.{i}.arguments") from None
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, rs.FunctionCallOutputInput):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output)})
        elif isinstance(item, rs.InputMessage):
            messages.append({"role": item.role, "content": _text(item.content)})
    return messages


def _text(content: str | list[rs.InputText]) -> str:
    """The text of a string or of text parts."""
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _response_format(text: rs.TextConfig | None) -> api.ResponseFormat | None:
    form = None if text is None else text.format
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return api.ResponseFormat(type="json_object")
    if form.json_schema is None:
        raise APIError(400, 'text.format {"type": "json_schema"} needs a "schema"',
                       param="text.format")
    return api.ResponseFormat(type="json_schema", json_schema=api.JsonSchemaFormat(
        name=form.name or "schema", description=form.description, schema=form.json_schema,
        strict=form.strict))


def _response(req: rs.ResponsesRequest, model: str) -> rs.ResponseObject:
    """The response to ``req`` as it starts: in progress, no output yet."""
    text = {"format": {"type": "text"}} if req.text is None or req.text.format is None \
        else req.text.model_dump(by_alias=True, exclude_none=True)
    return rs.ResponseObject(
        id=rs.response_id("resp"), status="in_progress", instructions=req.instructions,
        max_output_tokens=req.max_output_tokens, model=model,
        temperature=req.temperature, top_p=req.top_p, text=text, metadata=req.metadata or {},
        user=req.user, tools=[tool.model_dump(exclude_none=True) for tool in req.tools or []],
        tool_choice=req.tool_choice.model_dump() if isinstance(req.tool_choice,
                                                               rs.FunctionChoice)
        else req.tool_choice or "auto", parallel_tool_calls=req.parallel_tool_calls)


def _status(output: RequestOutput) -> str:
    return "incomplete" if output.outputs[0].finish_reason == "length" else "completed"


def _finished(started: rs.ResponseObject, items: list[rs.OutputItem],
              output: RequestOutput) -> rs.ResponseObject:
    """``started`` with its output items, final status and usage."""
    usage = count_usage([output], 1)
    status = _status(output)
    return started.model_copy(update={
        "status": status, "output": items,
        "incomplete_details": rs.IncompleteDetails(reason="max_output_tokens")
        if status == "incomplete" else None,
        "usage": rs.ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=rs.InputTokensDetails(cached_tokens=output.num_cached_tokens),
            output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens)})
