"""The Anthropic Messages API's shapes (``POST /v1/messages`` and
``/v1/messages/count_tokens``), as pydantic models, and its error shape.

Sampling takes ``temperature``, ``top_p`` and ``top_k`` (which Anthropic's API had and vLLM
keeps); ``output_config.format`` (a JSON schema) is structured output. Text content only:
``tools`` and content blocks other than ``text`` (images, documents,
tool use and results, thinking) are refused with a 400 naming them.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from fastllm.entrypoints.openai.protocol import Probability, _Request, _Response

__all__ = ["CountTokensRequest", "CountTokensResponse", "MessageResponse", "MessagesRequest",
           "MessagesUsage", "TextBlock", "error_body", "message_id"]

# Anthropic's error type for each status it answers with.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


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


class MessageParam(_Request):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]


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
    tools: list[dict[str, Any]] | None = None  # refused by the serving when not empty


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


class MessagesUsage(_Response):
    input_tokens: int
    output_tokens: int


StopReason = Literal["end_turn", "max_tokens", "stop_sequence"]


class MessageResponse(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[TextContent]
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class CountTokensResponse(_Response):
    input_tokens: int
