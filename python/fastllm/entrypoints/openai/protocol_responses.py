"""The OpenAI Responses API's shapes (``POST /v1/responses``), as pydantic models, for a
stateless server: the conversation comes whole in ``input``, nothing is stored.

Function tools work as in chat completions (``tool_choice`` auto / required / none / a named
function, ``parallel_tool_calls``): calls come back as ``function_call`` output items, their
results go in as ``function_call_output`` input items, and a reasoning parser's reading comes
back as a ``reasoning`` output item (sent back in ``input``, it is left out of the prompt).
Fields the server cannot honour are refused with a 400 naming them: ``store: true``,
``previous_response_id`` and ``conversation`` (they need server-side state), tools other than
functions, ``background: true``.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, Tag

from fastllm.entrypoints.openai.protocol import (
    Probability, _Request, _Response, type_discriminator)

__all__ = ["FunctionCallItem", "OutputMessage", "OutputText", "ReasoningItem", "ResponseObject",
           "ResponsesRequest", "ResponseUsage", "response_id"]


def response_id(prefix: str) -> str:
    """An id as OpenAI writes them in this API: ``resp_...``, ``msg_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- the request -------------------------------------------------------------------------------

class InputText(_Request):
    # output_text parts come back in a previous response's output items, with their extras.
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(_Request):
    """A message item: ``{"role", "content"}`` (the SDK's EasyInputMessage) or a previous
    response's output message fed back."""

    type: Literal["message"] = "message"  # first, so that another item type is named first
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: str | None = None


class FunctionCallInput(_Request):
    """A call the model made in an earlier response, fed back."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputInput(_Request):
    """A call's result."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningInput(_Request):
    """An earlier response's reasoning item, fed back: not shown to the model again."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = Annotated[Union[Annotated[InputMessage, Tag("InputMessage")],
                            Annotated[FunctionCallInput, Tag("FunctionCallInput")],
                            Annotated[FunctionCallOutputInput, Tag("FunctionCallOutputInput")],
                            Annotated[ReasoningInput, Tag("ReasoningInput")]],
                      # A message may leave its type out (the SDK's EasyInputMessage); an
                      # unknown type is a message's error.
                      type_discriminator({"function_call": "FunctionCallInput",
                                          "function_call_output": "FunctionCallOutputInput",
                                          "reasoning": "ReasoningInput"},
                                         default="InputMessage")]


class FunctionTool(_Request):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class FunctionChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    # "schema" shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: Union[str, Annotated[list[InputItem], Field(min_length=1)]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Probability | None = None
    text: TextConfig | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Refused by the serving unless they ask for nothing a stateless server without tools lacks.
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    truncation: Literal["disabled"] | None = None
    # "message.output_text.logprobs" adds each output token's logprobs (and top_logprobs
    # alternatives) to output_text; what other values ask for, items this server never makes
    # (file search results, images, encrypted reasoning), there is none of.
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


# ---- the response ------------------------------------------------------------------------------

class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(_Response):
    id: str
    type: Literal["message"] = "message"
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(_Response):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(_Response):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(_Response):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Union[ReasoningItem, OutputMessage, FunctionCallItem]


class InputTokensDetails(_Response):
    cached_tokens: int = 0


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(_Response):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Response):
    """A response, as the API returns it and as its stream's lifecycle events carry it."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    store: bool = False
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any]
    tool_choice: Any = "auto"
    tools: list[Any] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None
