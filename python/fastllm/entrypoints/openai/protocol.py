"""The OpenAI API's request and response shapes (and the Jina/Cohere rerank shape vLLM and
llama.cpp serve), as pydantic models: a request that does not fit is a 400 naming the field.

Ranges are OpenAI's where it has one (temperature in [0, 2], penalties in [-2, 2], at most 20
top logprobs); the extensions vLLM accepts (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``chat_template_kwargs``,
``stream_options.continuous_usage_stats``) are accepted too. A field the server does not know
is ignored with one log line naming it, as vLLM does: clients written for other servers send
their own fields, and refusing them would fail every such request.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel, ConfigDict, Discriminator, Field, ValidationError, ValidatorFunctionWrapHandler,
    field_validator, model_validator)

__all__ = [
    "ChatCompletionChunk", "ChatCompletionRequest", "ChatCompletionResponse", "ChatMessage",
    "CompletionChunk", "CompletionRequest", "CompletionResponse", "EmbeddingRequest",
    "EmbeddingResponse", "ErrorResponse", "ModelCard",
    "ModelList", "RerankRequest", "RerankResponse", "Usage", "random_id", "type_discriminator",
]

MAX_TOP_LOGPROBS = 20  # OpenAI's bound
MAX_N = 16  # choices per request: each is a request of its own in the batch


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


logger = logging.getLogger("fastllm")


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _log_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields) | {field.alias for field in cls.model_fields.values()
                                             if field.alias}
            unknown = sorted(str(key) for key in data if key not in known)
            if unknown:
                logger.warning("%s: ignored fields the server does not know: %s",
                               cls.__name__, ", ".join(unknown))
        return data


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


def type_discriminator(members: dict[str, str], default: str) -> Discriminator:
    """A union's discriminator by an item's ``type``: ``members`` maps types to the members'
    tags, and any other type (or none) picks ``default``, whose own validation then names the
    type. Tag the members with their class names, which error paths leave out, so that an
    error names the item's field, not the member."""

    def tag(item: Any) -> str:
        kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
        return members.get(kind, default)

    return Discriminator(tag)


# ---- shared request parts ----------------------------------------------------------------------

class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk too


class JsonSchemaFormat(_Request):
    name: str = Field(default="schema", max_length=64)
    description: str | None = None
    # "schema" shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


Probability = Annotated[float, Field(gt=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]


class _SamplingFields(_Request):
    """The sampling fields both endpoints take."""

    model: str | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Probability | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True


# ---- completions -------------------------------------------------------------------------------

class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    # 0 with echo: the prompt's logprobs alone (lm-eval's loglikelihood requests).
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionChunk(CompletionResponse):
    pass


# ---- chat completions --------------------------------------------------------------------------

class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCallParam(_Request):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallParam(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(BaseModel):
    # Other fields go to the chat template as they are.
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class FunctionDefinition(_Request):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessageParam], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[ChatTool] | None = None
    # None: "auto" with tools, "none" without (OpenAI's defaults).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: e.g. enable_thinking

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _tool_choice(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # The union's own error names its members ("tool_choice.literal[...]"): one plain one.
        try:
            return handler(value)
        except ValidationError:
            raise ValueError('tool_choice must be "none", "auto", "required" or {"type": '
                             '"function", "function": {"name": ...}}') from None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # vLLM's: the reasoning, with --reasoning-parser
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Response):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class FunctionCallDelta(_Response):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Response):
    """A piece of a streamed call: its first has the id and name, the rest arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---- embeddings ----------------------------------------------------------------------------------

class EmbeddingRequest(_Request):
    model: str | None = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None


class EmbeddingData(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the float32 values' little-endian bytes


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Response):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


# ---- models, rerank, errors --------------------------------------------------------------------

class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or messages through the chat template (with tools)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessageParam], Field(min_length=1)] | None = None
    tools: list[ChatTool] | None = None
    add_generation_prompt: bool = True
    # Default: BOS and the like for a prompt, none for messages (the template writes them).
    add_special_tokens: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(_Response):
    prompt: str


class LoadLoRAAdapterRequest(_Request):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str
    lora_int_id: int | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "fastllm"
    root: str | None = None  # the model's (or the LoRA adapter's) files
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class RerankDocument(_Request):
    text: str


class RerankRequest(_Request):
    model: str | None = None
    query: str
    documents: list[Union[str, RerankDocument]]
    top_n: Annotated[int, Field(ge=0)] | None = None
    return_documents: bool = True


class RerankResult(_Response):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(_Response):
    total_tokens: int


class RerankResponse(_Response):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo
