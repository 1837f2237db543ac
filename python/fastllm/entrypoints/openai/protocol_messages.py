"""The Anthropic Messages API's shapes (``POST /v1/messages`` and
``/v1/messages/count_tokens``), as pydantic models, and its error shape.

Sampling takes ``temperature``, ``top_p`` and ``top_k`` (which Anthropic's API had and vLLM
keeps); ``output_config.format`` (a JSON schema) is structured output. Client tools
(``input_schema``) with ``tool_choice`` auto / any / tool / none; ``tool_use`` blocks in
assistant turns and ``tool_result`` blocks in user turns; ``thinking`` blocks of earlier turns
are accepted and left out of the prompt, as Anthropic does. Other content blocks (images,
documents) and server tools are refused with a 400 naming them.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, Tag

from fastllm.entrypoints.openai.protocol import (
    Probability, _Request, _Response, type_discriminator)

__all__ = ["CountTokensRequest", "CountTokensResponse", "MessageResponse", "MessagesRequest",
           "MessagesUsage", "TextBlock", "TextContent", "ThinkingContent", "ToolUseContent",
           "error_body", "message_id", "tool_use_id"]

# Anthropic's error type for each status it answers with.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id() -> str:
    """An id in Anthropic's shape for a tool_use block."""
    return f"toolu_{uuid.uuid4().hex[:24]}"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """Anthropic's error JSON. It has no field for the parameter at fault, so the message
    starts with it."""
    if param is not None and not message.startswith(f"{param}: "):
        message = f"{param}: {message}"
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# ---- the request -------------------------------------------------------------------------------

class TextBlock(_Request):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # a hint: the prefix cache needs none
    citations: list[Any] | None = None


class ToolUseBlock(_Request):
    """A call the assistant made in an earlier turn."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(_Request):
    """A call's result, in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(_Request):
    """An earlier turn's reasoning, sent back as it came: not shown to the model again."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


ContentBlock = Annotated[Union[Annotated[TextBlock, Tag("TextBlock")],
                               Annotated[ToolUseBlock, Tag("ToolUseBlock")],
                               Annotated[ToolResultBlock, Tag("ToolResultBlock")],
                               Annotated[ThinkingBlock, Tag("ThinkingBlock")]],
                         # An unknown type (an image, a document): a text block's error.
                         type_discriminator({"tool_use": "ToolUseBlock",
                                             "tool_result": "ToolResultBlock",
                                             "thinking": "ThinkingBlock",
                                             "redacted_thinking": "ThinkingBlock"},
                                            default="TextBlock")]


class MessageParam(_Request):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolParam(_Request):
    """A client tool: the model calls it with an ``input`` valid for ``input_schema``."""

    type: Literal["custom"] | None = None  # server tools (web search...) have other types
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # Anthropic's rule
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # with "tool": the tool to call
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Request):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class JsonOutputFormat(_Request):
    type: Literal["json_schema"]
    # "schema" shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] = Field(alias="schema")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class OutputConfig(_Request):
    format: JsonOutputFormat | None = None


class Metadata(_Request):
    user_id: str | None = None


class CountTokensRequest(_Request):
    """What a conversation is: what ``count_tokens`` counts and ``create`` answers."""

    model: str
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Probability | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None  # format: structured output


# ---- the response ------------------------------------------------------------------------------

class TextContent(_Response):
    type: Literal["text"] = "text"
    text: str


class ThinkingContent(_Response):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic's checks that its thinking came back unchanged: none here


class ToolUseContent(_Response):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessagesUsage(_Response):
    input_tokens: int
    output_tokens: int


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageResponse(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ThinkingContent | TextContent | ToolUseContent]
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class CountTokensResponse(_Response):
    input_tokens: int
