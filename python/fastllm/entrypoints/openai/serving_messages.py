"""``POST /v1/messages``: Anthropic's Messages API as a chat request of the same engine and chat
template (:meth:`OpenAIServing.run_chat`): ``system`` becomes the system message,
``stop_sequences`` stop strings, ``output_config.format`` structured output; ``stop_reason`` is
``end_turn`` (end of sequence), ``max_tokens`` or ``stop_sequence`` (with the one that
matched). ``POST /v1/messages/count_tokens`` counts the rendered prompt.

A streamed message sends Anthropic's events: ``message_start``, ``content_block_start``,
``content_block_delta`` (``text_delta``)..., ``content_block_stop``, ``message_delta`` (stop
reason and output tokens), ``message_stop``; an error after the start is an ``error`` event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastllm.engine.outputs import RequestOutput
from fastllm.entrypoints.openai import protocol as api
from fastllm.entrypoints.openai import protocol_messages as am
from fastllm.entrypoints.openai.serving import (APIError, OpenAIServing, as_api_error,
                                                count_usage, merge_streams, named_event)

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
        chat = api.ChatCompletionRequest(
            model=req.model, messages=_messages(req), max_tokens=req.max_tokens,
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            stop=req.stop_sequences, stream=req.stream, response_format=_response_format(req),
            user=None if req.metadata is None else req.metadata.user_id)
        result = await self.serving.run_chat(chat, until_disconnected, _PARAMS)
        if req.stream:
            return self._events(result)
        output, = result
        stop_reason, stop_sequence = _stop(output)
        return am.MessageResponse(
            id=am.message_id(), content=[am.TextContent(text=output.outputs[0].text)],
            model=self.serving.model_name, stop_reason=stop_reason, stop_sequence=stop_sequence,
            usage=_usage(output))

    def count_tokens(self, req: am.CountTokensRequest) -> am.CountTokensResponse:
        """How many tokens ``req``'s conversation is, rendered with the chat template."""
        chat = api.ChatCompletionRequest(model=req.model, messages=_messages(req))
        self.serving.check_model(chat.model)
        return am.CountTokensResponse(input_tokens=len(self.serving.chat_prompt(chat)))

    async def _events(self, streams: list) -> AsyncIterator[str]:
        started = streams[0].first.output  # opening a stream waits for its first update
        try:
            yield named_event("message_start", {"message": am.MessageResponse(
                id=am.message_id(), content=[], model=self.serving.model_name,
                usage=am.MessagesUsage(input_tokens=len(started.prompt_token_ids),
                                       output_tokens=0)).model_dump()})
            yield named_event("content_block_start", {
                "index": 0, "content_block": am.TextContent(text="").model_dump()})
            async for _, delta in merge_streams(streams):
                if delta.text:
                    yield named_event("content_block_delta", {
                        "index": 0, "delta": {"type": "text_delta", "text": delta.text}})
                last = delta.output
            yield named_event("content_block_stop", {"index": 0})
            stop_reason, stop_sequence = _stop(last)
            yield named_event("message_delta", {
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": {"output_tokens": _usage(last).output_tokens}})
            yield named_event("message_stop", {})
        except Exception as error:  # the status line is sent: say it in the stream
            failed = as_api_error(error).renamed(_PARAMS)
            yield named_event("error", {"error": am.error_body(
                failed.status, failed.message, failed.param)["error"]})


def _text(content: str | list[am.TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def _messages(req: am.CountTokensRequest) -> list[dict[str, str]]:
    """The chat messages: the system prompt first, then the conversation's."""
    if req.tools:
        raise APIError(400, "tools are not supported by /v1/messages yet", param="tools")
    system = [] if req.system is None else [{"role": "system", "content": _text(req.system)}]
    return system + [{"role": m.role, "content": _text(m.content)} for m in req.messages]


def _response_format(req: am.MessagesRequest) -> api.ResponseFormat | None:
    if req.output_config is None or req.output_config.format is None:
        return None
    return api.ResponseFormat(type="json_schema", json_schema=api.JsonSchemaFormat(
        schema=req.output_config.format.json_schema))


def _stop(output: RequestOutput) -> tuple[am.StopReason, str | None]:
    """Anthropic's stop reason and the stop sequence that matched."""
    completion = output.outputs[0]
    if completion.finish_reason == "length":
        return "max_tokens", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def _usage(output: RequestOutput) -> am.MessagesUsage:
    usage = count_usage([output], 1)
    return am.MessagesUsage(input_tokens=usage.prompt_tokens,
                            output_tokens=usage.completion_tokens)
