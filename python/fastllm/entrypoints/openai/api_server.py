"""``fastllm serve``: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over
:class:`fastllm.AsyncLLM`.

    fastllm serve MODEL [--host 127.0.0.1] [--port 8000] [--api-key KEY]

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` answers
with server-sent events), ``POST /v1/responses`` (OpenAI's Responses API, stateless), ``POST
/v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's Messages API), ``GET
/v1/models``, ``POST /v1/rerank`` (with a Qwen3-Reranker model), ``POST /tokenize``,
``/detokenize`` and ``/reset_prefix_cache`` (vLLM's), ``GET /health`` and ``GET /metrics``
(Prometheus). Errors are OpenAI's error JSON with the field at fault in ``param``
(Anthropic's under ``/v1/messages``). A client that disconnects aborts its requests, freeing
their KV blocks at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastllm.entrypoints.async_llm import AsyncLLM
from fastllm.entrypoints.openai import protocol as api
from fastllm.entrypoints.openai import protocol_messages, protocol_responses
from fastllm.entrypoints.openai.embeddings import EmbeddingServing
from fastllm.entrypoints.openai.metrics import ServerMetrics
from fastllm.entrypoints.openai.rerank import RerankServing
from fastllm.entrypoints.openai.serving import (APIError, OpenAIServing, ServingLimits,
                                                as_api_error)
from fastllm.entrypoints.openai.serving_messages import MessagesServing
from fastllm.entrypoints.openai.serving_responses import ResponsesServing
from fastllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from fastllm.entrypoints.openai.tokenization import TokenizationServing
from fastllm.entrypoints.openai.tool_parsers import PARSERS

__all__ = ["ClientDisconnected", "ServerConfig", "bind", "build_app", "build_server",
           "is_anthropic_path", "json_error", "until_disconnected"]

logger = logging.getLogger("fastllm")
T = TypeVar("T")


@dataclass
class ServerConfig:
    """How the server listens and what it admits.

    Attributes:
        host, port: where to listen; 127.0.0.1 unless told otherwise.
        api_key: when set, ``/v1/*`` and ``/rerank`` need ``Authorization: Bearer KEY``
            (``/v1/messages`` takes Anthropic's ``x-api-key: KEY`` too).
        max_waiting_requests: engine requests queued past which a call gets a 503.
        max_body_bytes: the largest request body (past it, a 413).
        chat_template: a Jinja chat template overriding the tokenizer's.
        pooling: how ``/v1/embeddings`` pools the final hidden states: "last" or "mean".
        tool_call_parser: how tool calls are read from replies (``hermes``, ``llama3_json``,
            ``mistral``); None picks it from the chat template.
        reasoning_parser: how a reply's reasoning is told from its answer (``qwen3``,
            ``deepseek_r1``); None: replies are all answer.
        lora_modules: LoRA adapters served from the start, name -> peft folder or hub repo
            (the engine needs ``enable_lora``); a request's ``model`` names one.
        allow_runtime_lora_updating: serve ``POST /v1/load_lora_adapter`` and
            ``/v1/unload_lora_adapter`` (vLLM's runtime updating), which load and unload
            adapters while the server runs.
        data_parallel_rank: this server's rank among data-parallel replicas (``fastllm serve
            --data-parallel-rank``): its metrics carry ``engine="<rank>"``. None: no rank.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_waiting_requests: int = 256
    max_body_bytes: int = 4 << 20
    chat_template: str | None = None
    pooling: str = "last"
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    lora_modules: dict[str, str] = field(default_factory=dict)
    allow_runtime_lora_updating: bool = False
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        if self.pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {self.pooling!r}")
        for name in ("max_waiting_requests", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        rank = self.data_parallel_rank
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)
                                 or rank < 0):
            raise ValueError(f"data_parallel_rank must be None or an int >= 0, got {rank!r}")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be an int in [0, 65536), got {self.port!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}")


_ENDPOINTS = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
              "/v1/embeddings", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
              "/v1/rerank", "/rerank", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
              "/tokenize", "/detokenize", "/reset_prefix_cache"}


class ClientDisconnected(Exception):
    """The client went away before its reply was ready (see :func:`until_disconnected`)."""


def _union_member(part: str | int) -> bool:
    """Whether a validation error's path part names a union's member (``str``,
    ``list[TextPart]``, ``RerankDocument``) rather than a field or an index."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part
                                       or part[:1].isupper())


def is_anthropic_path(path: str) -> bool:
    """Whether ``path`` is one of the Anthropic Messages API's (its errors take that shape)."""
    return path.startswith("/v1/messages")


def _error_body(path: str, error: APIError) -> dict[str, Any]:
    """The error in the shape of the API ``path`` belongs to."""
    if is_anthropic_path(path):
        return protocol_messages.error_body(error.status, error.message, error.param)
    return error.body()


def json_error(status: int, message: str, type: str, param: str | None = None,
               code: str | None = None, headers: dict[str, str] | None = None,
               path: str = "") -> JSONResponse:
    """An error response in the shape of the API ``path`` belongs to."""
    error = APIError(status, message, param=param, type=type, code=code)
    return JSONResponse(_error_body(path, error), status_code=status, headers=headers)


class _Guard:
    """Pure ASGI middleware (so streaming and disconnects pass through untouched): the body
    size limit, the API key, and the HTTP status counter."""

    def __init__(self, app: Any, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.app, self.config, self.metrics = app, config, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = {"code": 500}

        async def counted_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self._handle(scope, receive, counted_send, path)
        finally:  # unknown paths share one label: a scan must not grow the metrics
            endpoint = path if path in _ENDPOINTS else "other"
            self.metrics.http_request(endpoint, status["code"])

    async def _handle(self, scope: dict, receive: Any, send: Any, path: str) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope["headers"]}
        key = self.config.api_key
        guarded = path.startswith("/v1") or path in ("/rerank", "/reset_prefix_cache")
        if key is not None and guarded:
            if headers.get("authorization") != f"Bearer {key}" and not (
                    is_anthropic_path(path) and headers.get("x-api-key") == key):
                also = " or 'x-api-key: KEY'" if is_anthropic_path(path) else ""
                await json_error(401, f"Incorrect or missing API key: send 'Authorization: "
                                      f"Bearer KEY'{also}", "invalid_request_error",
                                  code="invalid_api_key", path=path)(scope, receive, send)
                return
        limit = self.config.max_body_bytes
        too_large = json_error(413, f"the request body exceeds {limit} bytes",
                               "invalid_request_error", code="request_too_large", path=path)
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:  # read the body here, bounded, then hand it on
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body"):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """``awaitable``'s result, or, when the client disconnects first, cancels it (aborting its
    engine requests) and raises ClientDisconnected."""
    work = asyncio.ensure_future(awaitable)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if work.cancelled():
        raise ClientDisconnected()
    return work.result()


async def _events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's events; an error after the response started is sent as an error event."""
    try:
        async for event in events:
            yield event
    except Exception as error:  # the status line is sent: say it in the stream
        yield f"data: {json.dumps(as_api_error(error).body())}\n\n"
    finally:
        await events.aclose()


def build_app(llm: AsyncLLM, config: ServerConfig, model_name: str) -> FastAPI:
    """The FastAPI app serving ``llm`` under ``model_name``."""
    engine = llm.client.engine
    metrics = ServerMetrics(engine, model_name, config.data_parallel_rank)
    serving = OpenAIServing(llm, model_name, metrics,
                            ServingLimits(max_waiting_requests=config.max_waiting_requests),
                            chat_template=config.chat_template,
                            tool_call_parser=config.tool_call_parser,
                            reasoning_parser=config.reasoning_parser)
    reranking = RerankServing(llm, model_name, serving)
    for name, path in config.lora_modules.items():
        try:
            serving.load_lora(name, path)
        except APIError as error:  # at start-up: a bad option, not a bad request
            raise ValueError(f"--lora-modules {name}={path}: {error.message}") from None
    embedding = EmbeddingServing(llm, serving, config.pooling)
    tokenization = TokenizationServing(serving)
    responding, messaging = ResponsesServing(serving), MessagesServing(serving)
    app = FastAPI(title="fastllm", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if error.status == 503 else None
        return JSONResponse(_error_body(request.url.path, error), status_code=error.status,
                            headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        # A union (a string or a list of parts) fails once per member: the error that went
        # deepest says what is wrong, and its path names the members, which are no fields.
        first = max(error.errors(), key=lambda e: len(e.get("loc", ())))
        loc = [str(part) for part in first.get("loc", ())
               if part != "body" and not _union_member(part)]
        if first.get("type") == "json_invalid":
            return json_error(400, f"the body is not valid JSON: {first.get('msg')} "
                                   f"(at character {loc[-1] if loc else '?'})",
                               "invalid_request_error", path=request.url.path)
        param = ".".join(loc) or None
        return json_error(400, f"{param or 'body'}: {first.get('msg')}",
                          "invalid_request_error", param=param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return json_error(error.status_code, str(error.detail), "invalid_request_error",
                          path=request.url.path)

    @app.exception_handler(ClientDisconnected)
    async def gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception) -> JSONResponse:
        path = request.url.path
        if isinstance(error, ValueError):  # a request the engine refused or failed alone
            return json_error(400, str(error), "invalid_request_error", path=path)
        logger.exception("request failed")
        return json_error(500, f"{type(error).__name__}: {error}", "internal_server_error",
                          path=path)

    def respond(result: Any) -> Response:
        if isinstance(result, BaseModel):
            return JSONResponse(result.model_dump())
        return StreamingResponse(_events(result), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    async def health() -> Response:
        if llm.failed:
            return json_error(503, "the engine thread failed", "internal_server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> api.ModelList:
        adapters = [api.ModelCard(id=name, root=lora.lora_path, parent=model_name,
                                  max_model_len=serving.max_model_len)
                    for name, lora in serving.lora_modules.items()]
        return api.ModelList(data=[api.ModelCard(id=model_name,
                                                 max_model_len=serving.max_model_len),
                                   *adapters])

    @app.post("/tokenize")
    async def tokenize(body: api.TokenizeRequest) -> api.TokenizeResponse:
        return tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: api.DetokenizeRequest) -> api.DetokenizeResponse:
        return tokenization.detokenize(body)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        # Between engine steps (the client's lock), off the event loop.
        await asyncio.to_thread(llm.client.reset_prefix_cache)
        return Response(status_code=200)

    if config.allow_runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: api.LoadLoRAAdapterRequest) -> Response:
            # Reading the adapter's files may take a while: off the event loop.
            await asyncio.to_thread(serving.load_lora, body.lora_name, body.lora_path)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                     "successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: api.UnloadLoRAAdapterRequest) -> Response:
            serving.unload_lora(body.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                     "successfully.")

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, request: Request) -> Response:
        return respond(await serving.completions(
            body, lambda work: until_disconnected(request, work)))

    @app.post("/v1/chat/completions")
    async def chat(body: api.ChatCompletionRequest, request: Request) -> Response:
        return respond(await serving.chat(
            body, lambda work: until_disconnected(request, work)))

    @app.post("/v1/embeddings")
    async def embeddings(body: api.EmbeddingRequest, request: Request
                         ) -> api.EmbeddingResponse:
        return await until_disconnected(request, embedding.embed(body))

    @app.post("/v1/responses")
    async def responses(body: protocol_responses.ResponsesRequest, request: Request) -> Response:
        return respond(await responding.create(
            body, lambda work: until_disconnected(request, work)))

    @app.post("/v1/messages")
    async def messages(body: protocol_messages.MessagesRequest, request: Request) -> Response:
        return respond(await messaging.create(
            body, lambda work: until_disconnected(request, work)))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: protocol_messages.CountTokensRequest
                           ) -> protocol_messages.CountTokensResponse:
        return messaging.count_tokens(body)

    @app.post("/v1/rerank")
    @app.post("/rerank")
    async def rerank(body: api.RerankRequest, request: Request) -> api.RerankResponse:
        return await until_disconnected(request, reranking.rerank(body))

    app.add_middleware(_Guard, config=config, metrics=metrics)
    return app


def build_server(llm: AsyncLLM, config: ServerConfig, model_name: str) -> uvicorn.Server:
    """A uvicorn server for :func:`build_app` (``server.run(sockets=...)`` to pass a bound
    socket)."""
    return uvicorn.Server(uvicorn.Config(build_app(llm, config, model_name), host=config.host,
                                         port=config.port, log_level="warning",
                                         timeout_graceful_shutdown=5))


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: a free one, read it with ``getsockname()``)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock
