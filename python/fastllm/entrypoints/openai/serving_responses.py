"""``POST /v1/responses``: OpenAI's Responses API, stateless, as a chat request of the same
engine and chat template (:meth:`OpenAIServing.run_chat`): ``instructions`` become the system
message, ``input`` the conversation, ``text.format`` structured output.

A streamed response sends the API's events, numbered: ``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, then ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` ended it, as OpenAI does).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastllm.engine.outputs import RequestOutput
from fastllm.entrypoints.openai import protocol as api
from fastllm.entrypoints.openai import protocol_responses as rs
from fastllm.entrypoints.openai.serving import (APIError, OpenAIServing, as_api_error,
                                                count_usage, merge_streams, named_event)

__all__ = ["ResponsesServing"]

T = TypeVar("T")

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
        _refuse_what_needs_state_or_tools(req)
        chat = api.ChatCompletionRequest(
            model=req.model, messages=_messages(req), max_completion_tokens=req.max_output_tokens,
            temperature=req.temperature, top_p=req.top_p, user=req.user,
            response_format=_response_format(req.text), stream=req.stream)
        started = _response(req, self.serving.model_name)
        result, _ = await self.serving.run_chat(chat, until_disconnected, _PARAMS)
        if req.stream:
            return self._events(started, result)
        output, = result
        return _finished(started, rs.OutputMessage(
            id=rs.response_id("msg"), status=_status(output),
            content=[rs.OutputText(text=output.outputs[0].text)]), output)

    async def _events(self, started: rs.ResponseObject, streams: list) -> AsyncIterator[str]:
        numbers = itertools.count()

        def event(name: str, **body: Any) -> str:
            return named_event(name, {**body, "sequence_number": next(numbers)})

        item = rs.OutputMessage(id=rs.response_id("msg"), status="in_progress", content=[])
        at = {"item_id": item.id, "output_index": 0, "content_index": 0}
        try:
            yield event("response.created", response=started.model_dump())
            yield event("response.in_progress", response=started.model_dump())
            yield event("response.output_item.added", output_index=0, item=item.model_dump())
            yield event("response.content_part.added", **at,
                        part=rs.OutputText(text="").model_dump())
            text, last = "", None
            async for _, delta in merge_streams(streams):
                last = delta.output
                if delta.text:
                    text += delta.text
                    yield event("response.output_text.delta", **at, delta=delta.text,
                                logprobs=[])
            part = rs.OutputText(text=text)
            yield event("response.output_text.done", **at, text=text, logprobs=[])
            yield event("response.content_part.done", **at, part=part.model_dump())
            item = rs.OutputMessage(id=item.id, status=_status(last), content=[part])
            yield event("response.output_item.done", output_index=0, item=item.model_dump())
            done = _finished(started, item, last)
            yield event(f"response.{done.status}", response=done.model_dump())
        except Exception as error:  # the status line is sent: say it in the stream
            failed = as_api_error(error).renamed(_PARAMS)
            yield event("error", code=failed.code, message=failed.message, param=failed.param)


def _refuse_what_needs_state_or_tools(req: rs.ResponsesRequest) -> None:
    stateful = {"store": req.store, "previous_response_id": req.previous_response_id,
                "conversation": req.conversation, "background": req.background}
    for field, value in stateful.items():
        if value not in (None, False):
            raise APIError(400, f"{field} is not supported: this server keeps no state, send "
                                f"the whole conversation in input", param=field)
    if req.tools:
        raise APIError(400, "tools are not supported by /v1/responses yet", param="tools")


def _messages(req: rs.ResponsesRequest) -> list[dict[str, str]]:
    """The chat messages: the instructions as the system message, then the input's."""
    messages = [] if req.instructions is None else [
        {"role": "system", "content": req.instructions}]
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    return messages + [{"role": item.role, "content": item.content if isinstance(
        item.content, str) else "".join(part.text for part in item.content)}
        for item in req.input]


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
        user=req.user)


def _status(output: RequestOutput) -> str:
    return "incomplete" if output.outputs[0].finish_reason == "length" else "completed"


def _finished(started: rs.ResponseObject, item: rs.OutputMessage,
              output: RequestOutput) -> rs.ResponseObject:
    """``started`` with its output item, final status and usage."""
    usage = count_usage([output], 1)
    status = _status(output)
    return started.model_copy(update={
        "status": status, "output": [item],
        "incomplete_details": rs.IncompleteDetails(reason="max_output_tokens")
        if status == "incomplete" else None,
        "usage": rs.ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=rs.InputTokensDetails(cached_tokens=output.num_cached_tokens),
            output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens)})
