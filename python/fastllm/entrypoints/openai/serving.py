"""The OpenAI endpoints' work: a request's prompt and parameters turned into engine requests
(one per choice), their outputs into OpenAI's responses or server-sent event chunks.

Every choice is a request of its own in the running batch (``n`` of them for ``n`` choices;
with a seed, choice ``i`` uses ``seed + i``, so a seeded call is reproducible and its choices
differ). Whatever ends a call early (a client that disconnects, an error in another choice)
aborts its unfinished requests, whose KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastllm.engine.outputs import Logprob, RequestOutput
from fastllm.entrypoints.async_llm import AsyncLLM, StreamDelta
from fastllm.entrypoints.openai import protocol as api
from fastllm.entrypoints.openai.metrics import ServerMetrics
from fastllm.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS, ReasoningParser, ReasoningStream, ReplyStart)
from fastllm.entrypoints.openai.tool_parsers import (
    PARSERS, GenericToolFormat, ToolCall, ToolCallDelta, ToolCallStream, ToolParser,
    detect_parser, json_lark)
from fastllm.lora import LoRARequest
from fastllm.sampling import SamplingParams, StructuredOutputsParams
from fastllm.tokenizer import IncrementalDetokenizer

__all__ = ["APIError", "OpenAIServing", "ReplyFormat", "ReplyReader", "as_api_error",
           "count_usage", "merge_streams", "named_event"]

T = TypeVar("T")
logger = logging.getLogger("fastllm")


class APIError(Exception):
    """An error the server answers with OpenAI's error JSON."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status, message, param, type, code)

    def body(self) -> dict[str, Any]:
        return api.ErrorResponse(error=api.ErrorInfo(
            message=self.message, type=self.type, param=self.param, code=self.code)).model_dump()

    def renamed(self, params: Mapping[str, str]) -> APIError:
        """This error with its field named as another API (Responses, Messages) names it."""
        return APIError(self.status, self.message, param=params.get(self.param, self.param),
                        type=self.type, code=self.code)


@dataclass
class ServingLimits:
    """Admission limits.

    Attributes:
        max_waiting_requests: requests queued in the engine (not yet running) past which a new
            call is refused with a 503.
    """

    max_waiting_requests: int = 256


class OpenAIServing:
    """Serves completions, chat completions and models for one :class:`AsyncLLM`."""

    def __init__(self, llm: AsyncLLM, model_name: str, metrics: ServerMetrics,
                 limits: ServingLimits, chat_template: str | None = None,
                 tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        """``tool_call_parser``: how replies to requests with tools are read (a name in
        :data:`~fastllm.entrypoints.openai.tool_parsers.PARSERS`); None picks it from the chat
        template's text; when the template shows no known format or renders no tools, tools
        are served in :class:`~fastllm.entrypoints.openai.tool_parsers.GenericToolFormat`.
        ``reasoning_parser``: how a reply's reasoning is told from its answer (a name in
        :data:`~fastllm.entrypoints.openai.reasoning_parsers.REASONING_PARSERS`); None reads
        every reply as all answer."""
        self.llm, self.model_name, self.metrics, self.limits = llm, model_name, metrics, limits
        # The adapters served (by the name a request's ``model`` gives), with ids of their own.
        self.lora_modules: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)
        self.tokenizer = llm.client.tokenizer
        self.max_model_len = llm.client.max_model_len
        self.vocab_size = llm.client.vocab_size
        self.chat_template = chat_template
        if tool_call_parser is None:
            template = chat_template or self.tokenizer.chat_template or ""
            if isinstance(template, dict):
                template = template.get("tool_use") or template.get("default") or ""
            tool_call_parser = detect_parser(template)
        self.tool_parser: ToolParser | None = (
            None if tool_call_parser is None else PARSERS[tool_call_parser](self.tokenizer))
        self.generic_tools = GenericToolFormat(self.tokenizer)
        self.reasoning_parser: ReasoningParser | None = (
            None if reasoning_parser is None
            else REASONING_PARSERS[reasoning_parser](self.tokenizer))

    # ---- shared checks -----------------------------------------------------------------------

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names (None: the base model); a name the
        server does not serve is a 404 naming it."""
        if model is None or model == self.model_name:
            return None
        lora = self.lora_modules.get(model)
        if lora is None:
            served = ", ".join(f"`{name}`" for name in [self.model_name, *self.lora_modules])
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"{served}", param="model", code="model_not_found")
        return lora

    def response_model(self, model: str | None) -> str:
        """The ``model`` a response names: the adapter asked for, else the base model."""
        return model if model in self.lora_modules else self.model_name

    def load_lora(self, lora_name: str, lora_path: str) -> None:
        """Serves the peft adapter at ``lora_path`` (a folder or hub repo) as model
        ``lora_name``, once its files are read and checked against the base model."""
        if lora_name in self.lora_modules or lora_name == self.model_name:
            raise APIError(400, f"The lora adapter `{lora_name}` has already been loaded",
                           param="lora_name")
        if self.llm.client.lora_config is None:
            raise APIError(400, "this server runs without LoRA: start it with --enable-lora",
                           param="lora_name")
        lora = LoRARequest(lora_name, next(self._lora_ids), lora_path)
        try:
            self.llm.client.check_lora(lora)
        except (ValueError, OSError) as error:
            raise APIError(400, f"cannot load LoRA adapter `{lora_name}`: {error}",
                           param="lora_path") from None
        self.lora_modules[lora_name] = lora

    def unload_lora(self, lora_name: str) -> None:
        """Stops serving adapter ``lora_name`` (requests running with it finish)."""
        lora = self.lora_modules.pop(lora_name, None)
        if lora is None:
            raise APIError(404, f"The lora adapter `{lora_name}` cannot be found",
                           param="lora_name", code="model_not_found")
        self.llm.client.forget_lora(lora.lora_int_id)

    def check_capacity(self, new_requests: int) -> None:
        waiting = self.llm.num_waiting
        if waiting + new_requests > self.limits.max_waiting_requests:
            raise APIError(503, f"the server is at capacity: {waiting} requests are waiting "
                                f"(at most {self.limits.max_waiting_requests}); retry later",
                           type="service_unavailable", code="queue_full")

    def _max_tokens(self, requested: int | None, prompt_len: int, prompt_field: str) -> int:
        room = self.max_model_len - prompt_len
        if room <= 0:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                                f"tokens. However, your prompt has {prompt_len} tokens, which "
                                f"leaves no room for the completion", param=prompt_field,
                           code="context_length_exceeded")
        if requested is None:
            return room
        if requested > room:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                                f"tokens. However, you requested {prompt_len + requested} tokens "
                                f"({prompt_len} in the prompt, {requested} in the completion)",
                           param="max_tokens", code="context_length_exceeded")
        return requested

    def _sampling_params(self, req: api.ChatCompletionRequest | api.CompletionRequest,
                         max_tokens: int, logprobs: int | None,
                         prompt_logprobs: int | None = None,
                         reply: ReplyFormat | None = None) -> SamplingParams:
        logit_bias = {}
        for key, value in (req.logit_bias or {}).items():
            try:
                logit_bias[int(key)] = value
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}",
                               param="logit_bias") from None
        try:
            params = SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k or 0, min_p=req.min_p or 0.0,
                repetition_penalty=req.repetition_penalty or 1.0,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                logit_bias=logit_bias, seed=req.seed, max_tokens=max_tokens,
                stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
                stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                structured_outputs=_structured_outputs(req.response_format)
                if reply is None else reply.constraint,
                skip_special_tokens=req.skip_special_tokens and (
                    reply is None or reply.skip_special_tokens))
            params.check_vocab(self.vocab_size)
        except (TypeError, ValueError) as error:
            raise APIError(400, str(error), param=_field_named(str(error))) from None
        return params

    def _choices(self, params: SamplingParams, n: int) -> list[SamplingParams]:
        """One parameter set per choice; choice i of a seeded call takes seed + i."""
        if params.seed is None:
            return [params] * n
        return [dataclasses.replace(params, seed=(params.seed + i) % 2**63) for i in range(n)]

    # ---- completions -------------------------------------------------------------------------

    def completion_prompts(self, prompt: Any, field: str = "prompt"
                           ) -> list[tuple[str, list[int]]]:
        """The text and token ids of each prompt of a completion request (text, ids, or lists
        of them; ids' text is their decoding); errors name ``field``."""
        if isinstance(prompt, str):
            prompts: Sequence[Any] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = prompt
        if not prompts:
            raise APIError(400, f"{field} must not be empty", param=field)
        ids = []
        for p in prompts:
            token_ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            if not token_ids:
                raise APIError(400, f"a {field} has no tokens", param=field)
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(400, f"{field} token ids {bad[:8]} are outside the vocabulary "
                                    f"[0, {self.vocab_size})", param=field)
            ids.append((p if isinstance(p, str) else self.tokenizer.decode(token_ids),
                        token_ids))
        return ids

    async def completions(self, req: api.CompletionRequest,
                          until_disconnected: Callable[[Awaitable[T]], Awaitable[T]]
                          ) -> api.CompletionResponse | AsyncIterator[str]:
        lora = self.check_model(req.model)
        if req.echo and req.logprobs is not None and req.n > 1:
            raise APIError(400, "echo with logprobs takes n = 1", param="n")
        prompts = self.completion_prompts(req.prompt)
        jobs, echoes = [], []
        for text, ids in prompts:
            max_tokens = self._max_tokens(req.max_tokens, len(ids), "prompt")
            # echo shows the prompt's logprobs too: the prefill computes them.
            params = self._sampling_params(req, max_tokens, req.logprobs,
                                           req.logprobs if req.echo else None)
            jobs += [(ids, p) for p in self._choices(params, req.n)]
            echoes += [text if req.echo else ""] * req.n
        self.check_capacity(len(jobs))
        request_id = api.random_id("cmpl")
        if req.stream:
            streams = await until_disconnected(self.open_streams(jobs, lora=lora))
            return self._completion_events(request_id, req, echoes, streams)
        outputs = await until_disconnected(self.generate(jobs, lora=lora))
        choices = []
        for i, (echo, out) in enumerate(zip(echoes, outputs)):
            logprobs = None
            if req.logprobs is not None:
                logprobs = api.CompletionLogprobs()
                text_offsets = self._text_offsets(out, req.echo)
                if req.echo:
                    self._add_logprobs(logprobs, out.prompt_token_ids, out.prompt_logprobs,
                                       req.logprobs, text_offsets)
                self._add_logprobs(logprobs, out.outputs[0].token_ids, out.outputs[0].logprobs,
                                   req.logprobs, text_offsets)
            choices.append(api.CompletionChoice(index=i, text=echo + out.outputs[0].text,
                                                finish_reason=_finish_reason(out),
                                                logprobs=logprobs))
        return api.CompletionResponse(id=request_id, model=self.response_model(req.model),
                                      choices=choices, usage=count_usage(outputs, req.n))

    async def _completion_events(self, request_id: str, req: api.CompletionRequest,
                                 echoes: list[str], streams: list[_OpenStream]
                                 ) -> AsyncIterator[str]:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        continuous = include_usage and req.stream_options.continuous_usage_stats
        usage_field = {"usage": None} if include_usage else {}
        model = self.response_model(req.model)
        text_offsets: list[_TextOffsets | None] = [None] * len(streams)
        last: list[RequestOutput | None] = [None] * len(streams)
        async for index, delta in merge_streams(streams):
            last[index] = delta.output
            text, logprobs = delta.text, None
            if text_offsets[index] is None:  # the choice's first delta: the prompt is done
                text_offsets[index] = self._text_offsets(delta.output, req.echo)
                text = echoes[index] + text
                if req.echo and req.logprobs is not None:
                    logprobs = api.CompletionLogprobs()
                    self._add_logprobs(logprobs, delta.output.prompt_token_ids,
                                       delta.output.prompt_logprobs, req.logprobs,
                                       text_offsets[index])
            if req.logprobs is not None and delta.logprobs is not None:
                logprobs = logprobs or api.CompletionLogprobs()
                self._add_logprobs(logprobs, delta.token_ids, delta.logprobs, req.logprobs,
                                   text_offsets[index])
            if text or delta.finish_reason is not None or logprobs is not None:
                chunk = api.CompletionChunk(
                    id=request_id, model=model, choices=[api.CompletionChoice(
                        index=index, text=text, logprobs=logprobs,
                        finish_reason=_finish_reason(delta.output)
                        if delta.finish_reason is not None else None)])
                yield _event(chunk, **({"usage": count_usage(last, req.n).model_dump()}
                                       if continuous else usage_field))
        if include_usage:
            yield _event(api.CompletionChunk(id=request_id, model=model, choices=[],
                                             usage=count_usage(last, req.n)))
        yield "data: [DONE]\n\n"

    def _text_offsets(self, output: RequestOutput, echo: bool) -> _TextOffsets:
        return _TextOffsets(self.tokenizer.detokenizer(
            prompt_ids=None if echo else output.prompt_token_ids))

    def _add_logprobs(self, result: api.CompletionLogprobs, token_ids: Sequence[int],
                      entries: Sequence[dict[int, Logprob] | None] | None, top: int,
                      text_offsets: _TextOffsets) -> None:
        """Appends tokens' logprobs (an entry of None: the prompt's first token, which has
        none) and where their text starts."""
        for token_id, entry in zip(token_ids, entries or [None] * len(token_ids)):
            result.text_offset.append(text_offsets.next(token_id))
            if entry is None:
                result.tokens.append(self.tokenizer.token_text(token_id))
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            token = entry[token_id]
            result.tokens.append(token.decoded_token)
            result.token_logprobs.append(token.logprob)
            result.top_logprobs.append({
                lp.decoded_token: lp.logprob for lp in sorted(
                    entry.values(), key=lambda lp: -lp.logprob)[:top]} if top else None)

    # ---- chat --------------------------------------------------------------------------------

    def chat_prompt(self, req: api.ChatCompletionRequest, tool_use: _ToolUse | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        """The prompt's token ids: the messages (and the tools in use) through the chat
        template, with the generation prompt unless told not to; on a template without tools,
        calls and results in the messages and the tools' description are written in the
        generic format."""
        messages = []
        for i, message in enumerate(req.messages):
            fields = message.model_dump(exclude_none=True)
            # As vLLM: a null content (an assistant's message that only calls tools) is "",
            # which templates can concatenate.
            fields["content"] = ("".join(part.text for part in message.content)
                                 if isinstance(message.content, list) else message.content or "")
            for j, call in enumerate(fields.get("tool_calls", ())):
                # As vLLM and HF: templates get the arguments as an object (Llama 3's writes
                # them with tojson).
                try:
                    call["function"]["arguments"] = json.loads(call["function"]["arguments"])
                except json.JSONDecodeError as error:
                    raise APIError(400, f"a tool call's arguments are not JSON: {error}",
                                   param=f"messages.{i}.tool_calls.{j}.function.arguments"
                                   ) from None
            messages.append(self.generic_tools.history(fields) if self._generic else fields)
        kwargs = dict(req.chat_template_kwargs or {})
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        if tool_use is not None and self._generic:
            described = self.generic_tools.system_prompt(tool_use.tools,
                                                         req.parallel_tool_calls)
            if messages[0]["role"] in ("system", "developer"):
                text = messages[0]["content"]
                messages[0] = {**messages[0], "content": f"{text}\n\n{described}" if text
                               else described}
            else:
                messages.insert(0, {"role": "system", "content": described})
        elif tool_use is not None:
            kwargs["tools"] = tool_use.tools
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs)
        except (TypeError, ValueError) as error:
            raise APIError(400, f"the messages cannot be rendered with the chat template: "
                                f"{error}", param="messages") from None

    def chat_jobs(self, req: api.ChatCompletionRequest
                  ) -> tuple[list[tuple[list[int], SamplingParams]], ReplyFormat,
                             LoRARequest | None]:
        """A chat request's engine requests (one per choice), how their replies are read and
        the LoRA adapter they run with: its model, prompt and sampling parameters checked, and
        room for them in the queue. The Responses and Messages APIs build a chat request and
        come through here too."""
        lora = self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        tool_use = self.tool_use(req)
        ids = self.chat_prompt(req, tool_use)
        reply = self._reply_format(req, ids, tool_use)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        max_tokens = self._max_tokens(requested, len(ids), "messages")
        top = req.top_logprobs or 0
        params = self._sampling_params(req, max_tokens, top if req.logprobs else None,
                                       reply=reply)
        jobs = [(ids, p) for p in self._choices(params, req.n)]
        self.check_capacity(len(jobs))
        return jobs, reply, lora

    def _reply_format(self, req: api.ChatCompletionRequest, prompt: list[int],
                      tool_use: _ToolUse | None) -> ReplyFormat:
        """How the replies to a chat request whose prompt is ``prompt`` are read, and what
        holds them: a forced call's grammar, else ``response_format``; with a reasoning
        parser, that constraint starts once the reasoning ends."""
        forced = tool_use is not None and tool_use.constraint is not None
        constraint = tool_use.constraint if forced else _structured_outputs(req.response_format)
        parser, start = self.reasoning_parser, "answer"
        if parser is not None:
            # The generation prompt's last tokens say whether it opened or closed a reasoning
            # block: a few tokens hold both markers and the blank lines around them.
            start = parser.start_of(self.tokenizer.decode(prompt[-16:],
                                                          skip_special_tokens=False))
            if constraint is not None and start != "answer":
                constraint = StructuredOutputsParams(grammar=parser.grammar(
                    _answer_lark(constraint, "tools" if forced else "response_format"),
                    start))
        return ReplyFormat(tool_use, parser, start, constraint,
                           "tools" if forced else "response_format")

    async def run_chat(self, req: api.ChatCompletionRequest,
                       until_disconnected: Callable[[Awaitable[T]], Awaitable[T]],
                       params: Mapping[str, str]
                       ) -> tuple[list[RequestOutput] | list[_OpenStream], ReplyFormat]:
        """Runs a chat request another API built: its outputs, or with ``req.stream`` its open
        streams (read them with :func:`merge_streams`), and how to read the replies; errors
        name that API's fields (``params`` maps the chat request's names to them)."""
        try:
            jobs, reply, lora = self.chat_jobs(req)
            if req.stream:
                return await until_disconnected(self.open_streams(
                    jobs, reply.constraint_field, lora)), reply
            return await until_disconnected(self.generate(jobs, reply.constraint_field,
                                                          lora)), reply
        except APIError as error:
            raise error.renamed(params) from None

    async def chat(self, req: api.ChatCompletionRequest,
                   until_disconnected: Callable[[Awaitable[T]], Awaitable[T]]
                   ) -> api.ChatCompletionResponse | AsyncIterator[str]:
        jobs, reply, lora = self.chat_jobs(req)
        top = req.top_logprobs or 0
        request_id = api.random_id("chatcmpl")
        if req.stream:
            streams = await until_disconnected(self.open_streams(jobs, reply.constraint_field,
                                                                 lora))
            return self._chat_events(request_id, req, streams, reply)
        outputs = await until_disconnected(self.generate(jobs, reply.constraint_field, lora))
        choices = []
        for i, out in enumerate(outputs):
            reasoning, text, calls = reply.parse(out.outputs[0].text)
            if calls:
                text = text or None
            choices.append(api.ChatChoice(
                index=i, message=api.ChatMessage(
                    content=text, reasoning_content=reasoning,
                    tool_calls=[api.ToolCall(id=call.id, function=api.FunctionCall(
                        name=call.name, arguments=call.arguments)) for call in calls] or None),
                finish_reason=_chat_finish_reason(out, bool(calls)),
                logprobs=self.chat_logprobs(out.outputs[0].logprobs, top)
                if req.logprobs else None))
        return api.ChatCompletionResponse(id=request_id, model=self.response_model(req.model),
                                          choices=choices, usage=count_usage(outputs, req.n))

    def tool_use(self, req: api.ChatCompletionRequest) -> _ToolUse | None:
        """How the request's tools are used; None when the reply is plain text (no tools, or
        ``tool_choice`` "none": then, as vLLM's ``--exclude-tools-when-tool-choice-none``,
        the template does not show them)."""
        choice = req.tool_choice
        named = isinstance(choice, api.NamedToolChoice)
        if not req.tools:
            if named or choice == "required":
                raise APIError(400, "tool_choice needs tools", param="tool_choice")
            return None
        if choice == "none":
            return None
        names = [tool.function.name for tool in req.tools]
        if len(set(names)) < len(names):
            raise APIError(400, f"tools must have distinct names, got {names}", param="tools")
        parser = self.generic_tools.parser if self._generic else self.tool_parser
        tools = [tool.model_dump(exclude_none=True) for tool in req.tools]
        if named:
            if choice.function.name not in names:
                raise APIError(400, f"tool_choice names the function "
                                    f"`{choice.function.name}`, which is not in tools "
                                    f"{names}", param="tool_choice")
            chosen, parallel, optional = [tools[names.index(choice.function.name)]], False, False
        elif choice == "required":
            chosen, parallel, optional = tools, req.parallel_tool_calls, False
        elif req.parallel_tool_calls and not self._generic:
            return _ToolUse(tools, parser)  # a free reply, read by the model's own parser
        else:
            # "auto" held to text or calls: the generic format's calls are the server's own,
            # so only a grammar keeps them well formed; one call at most is a grammar's work too.
            chosen, parallel, optional = tools, req.parallel_tool_calls, True
        if req.response_format is not None and req.response_format.type != "text":
            raise APIError(400, "response_format cannot be combined with tools whose calls a "
                                "grammar holds (tool_choice required or a named function, "
                                "parallel_tool_calls false, or a chat template without tools)",
                           param="response_format")
        return _ToolUse(tools, parser, StructuredOutputsParams(
            grammar=parser.grammar(chosen, parallel, optional)))

    @functools.cached_property
    def _generic(self) -> bool:
        """Whether tools are served in the generic format: the template renders none, or
        shows no format a parser here knows."""
        return self.tool_parser is None or not self._template_renders_tools

    @functools.cached_property
    def _template_renders_tools(self) -> bool:
        """Whether the chat template shows a tool given to it (a probe's name appears)."""
        probe = {"type": "function", "function": {
            "name": "fastllm_probe_tool", "description": "probe",
            "parameters": {"type": "object", "properties": {}}}}
        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], tools=[probe],
                chat_template=self.chat_template)
        except Exception:  # a template that cannot render this much shows no tools either
            return False
        return "fastllm_probe_tool" in text

    async def _chat_events(self, request_id: str, req: api.ChatCompletionRequest,
                           streams: list[_OpenStream],
                           reply: ReplyFormat) -> AsyncIterator[str]:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        continuous = include_usage and req.stream_options.continuous_usage_stats
        usage_field = {"usage": None} if include_usage else {}
        top = req.top_logprobs or 0
        model = self.response_model(req.model)
        for index in range(len(streams)):  # OpenAI's first chunk: the role
            yield _event(api.ChatCompletionChunk(
                id=request_id, model=model, choices=[api.ChatChunkChoice(
                    index=index, delta=api.DeltaMessage(role="assistant", content=""))]),
                **usage_field)
        last: list[RequestOutput | None] = [None] * len(streams)
        readers = [reply.reader() for _ in streams]
        async for index, delta in merge_streams(streams):
            last[index] = delta.output
            logprobs = (self.chat_logprobs(delta.logprobs, top)
                        if req.logprobs and delta.logprobs else None)
            finished = delta.finish_reason is not None
            reader = readers[index]
            reasoning, content, pieces = reader.feed(delta.text, final=finished)
            tool_calls = [api.ToolCallDelta(
                index=piece.index, id=piece.id, type=None if piece.id is None else "function",
                function=api.FunctionCallDelta(
                    name=piece.name,
                    arguments=piece.arguments if piece.arguments or piece.id else None))
                for piece in pieces]
            if reasoning or content or tool_calls or logprobs is not None or finished:
                yield _event(api.ChatCompletionChunk(
                    id=request_id, model=model, choices=[api.ChatChunkChoice(
                        index=index, logprobs=logprobs,
                        delta=api.DeltaMessage(content=content or None,
                                               reasoning_content=reasoning or None,
                                               tool_calls=tool_calls or None),
                        finish_reason=_chat_finish_reason(delta.output, bool(reader.calls))
                        if finished else None)]),
                    **({"usage": count_usage(last, req.n).model_dump()} if continuous
                       else usage_field))
        if include_usage:
            yield _event(api.ChatCompletionChunk(id=request_id, model=model,
                                                 choices=[], usage=count_usage(last, req.n)))
        yield "data: [DONE]\n\n"

    def chat_logprobs(self, entries: list[dict[int, Logprob]] | None,
                      top: int) -> api.ChatLogprobs:
        """Sampled tokens' logprob entries as the chat API shows them: each token's logprob,
        bytes and ``top`` most likely alternatives."""
        content = []
        for entry in entries or []:
            token_id, sampled = next(iter(entry.items()))  # the sampled token comes first
            alternatives = sorted(entry.items(), key=lambda item: -item[1].logprob)[:top]
            content.append(api.TokenLogprob(
                token=sampled.decoded_token, logprob=sampled.logprob,
                bytes=self._bytes(token_id),
                top_logprobs=[api.TopLogprob(token=lp.decoded_token, logprob=lp.logprob,
                                             bytes=self._bytes(tid))
                              for tid, lp in alternatives]))
        return api.ChatLogprobs(content=content)

    def _bytes(self, token_id: int) -> list[int] | None:
        data = self.tokenizer.token_bytes(token_id) if token_id < len(self.tokenizer) else None
        return None if data is None else list(data)

    # ---- running the engine requests ---------------------------------------------------------

    async def generate(self, jobs: list[tuple[list[int], SamplingParams]],
                       constraint_field: str = "response_format",
                       lora: LoRARequest | None = None) -> list[RequestOutput]:
        """Every job's finished output (with the LoRA adapter ``lora``); the first failure
        cancels (aborts) the others. ``constraint_field``: the request field a constraint that
        fails to compile came from."""
        tasks = [asyncio.ensure_future(self.llm.generate({"prompt_token_ids": ids}, params,
                                                         lora_request=lora))
                 for ids, params in jobs]
        try:
            outputs = await asyncio.gather(*tasks)
        except BaseException as error:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.metrics.aborted(sum(task.cancelled() for task in tasks))
            raise _refused(error, constraint_field) from error
        for output in outputs:
            self.metrics.observe(output)
        return outputs

    async def open_streams(self, jobs: list[tuple[list[int], SamplingParams]],
                           constraint_field: str = "response_format",
                           lora: LoRARequest | None = None) -> list[_OpenStream]:
        """Starts every job's stream (with the LoRA adapter ``lora``) and waits for its first
        update, so that a request the engine refuses is an error before the response starts."""
        streams = [_OpenStream(self.llm.stream_outputs({"prompt_token_ids": ids}, params,
                                                       lora_request=lora), self.metrics)
                   for ids, params in jobs]
        try:
            await asyncio.gather(*(stream.start() for stream in streams))
        except BaseException as error:
            await asyncio.gather(*(stream.close() for stream in streams), return_exceptions=True)
            raise _refused(error, constraint_field) from error
        return streams


class _TextOffsets:
    """Where each token's text starts in a choice's text, token by token (the prompt's first
    when the text starts with it, then the output's). Counted by detokenizing, so a character
    split over byte tokens starts where its first byte's token does, and a SentencePiece
    text's leading space is as ``decode`` gives it."""

    def __init__(self, detokenizer: IncrementalDetokenizer) -> None:
        self._detokenizer = detokenizer
        self._offset = 0

    def next(self, token_id: int) -> int:
        start = self._offset
        self._offset += len(self._detokenizer.add(token_id))
        return start


class _OpenStream:
    """One choice's stream, its first update already taken."""

    def __init__(self, updates: AsyncIterator[StreamDelta], metrics: ServerMetrics) -> None:
        self.updates, self.metrics = updates, metrics
        self.first: StreamDelta | None = None

    async def start(self) -> None:
        self.first = await anext(self.updates)

    async def close(self) -> None:
        await self.updates.aclose()

    async def deltas(self) -> AsyncIterator[StreamDelta]:
        delta = self.first
        try:
            while True:
                yield delta
                if delta.finish_reason is not None:
                    self.metrics.observe(delta.output)
                    return
                delta = await anext(self.updates)
        finally:
            if delta.finish_reason is None:
                self.metrics.aborted()
            await self.close()


async def merge_streams(streams: list[_OpenStream]) -> AsyncIterator[tuple[int, StreamDelta]]:
    """The streams' deltas as they come, tagged with the stream's index; closing this closes
    (aborts) every stream."""
    if len(streams) == 1:
        async for delta in streams[0].deltas():
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: _OpenStream) -> None:
        try:
            async for delta in stream.deltas():
                await queue.put((index, delta, None))
        except Exception as error:
            await queue.put((index, None, error))
        await queue.put((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is None:
                running -= 1
            else:
                yield index, delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)


def _structured_outputs(response_format: api.ResponseFormat | None
                        ) -> StructuredOutputsParams | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.json_schema is None:
        raise APIError(400, 'response_format {"type": "json_schema"} needs a "json_schema" '
                            'with a "schema"', param="response_format")
    return StructuredOutputsParams(json=response_format.json_schema.json_schema)


def _refused(error: BaseException, constraint_field: str) -> BaseException:
    """A ValueError of the engine (a constraint that does not compile, a request that failed
    on its own logits) as a 400; anything else as it is."""
    if not isinstance(error, ValueError):
        return error
    param = constraint_field if "structured output" in str(error) else None
    return APIError(400, str(error), param=param)


def as_api_error(error: Exception) -> APIError:
    """What to tell a client whose streamed response failed after it started: the error itself
    when it is an APIError, a 400 for a ValueError (a request the engine refused or failed
    alone), else a 500 (logged)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValueError):
        return APIError(400, str(error))
    logger.exception("a streamed request failed")
    return APIError(500, str(error), type="internal_server_error")


def _field_named(message: str) -> str | None:
    """The field a SamplingParams error message starts with ("top_p must be ...")."""
    first = message.split(" ", 1)[0]
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    return first if first in fields else None


def _finish_reason(output: RequestOutput | None) -> str | None:
    return None if output is None else output.outputs[0].finish_reason


def _chat_finish_reason(output: RequestOutput | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended by itself after calling tools."""
    reason = _finish_reason(output)
    return "tool_calls" if called and reason == "stop" else reason


@dataclass
class _ToolUse:
    """A chat request's tools at work: shown to the template, read from the reply by
    ``parser``, and, when a call is forced, enforced by ``constraint``."""

    tools: list[dict[str, Any]]
    parser: ToolParser
    constraint: StructuredOutputsParams | None = None


@dataclass
class ReplyFormat:
    """How a chat request's replies are read and held: reasoning first (with a reasoning
    parser; ``reasoning_start`` says where a reply starts), then content and, when tools are
    in use, calls; ``constraint`` is what the engine holds each reply to, and
    ``constraint_field`` the request field it came from (named by a constraint that does not
    compile)."""

    tool_use: _ToolUse | None
    reasoning: ReasoningParser | None
    reasoning_start: ReplyStart
    constraint: StructuredOutputsParams | None
    constraint_field: str

    @property
    def skip_special_tokens(self) -> bool:
        """Whether replies may leave special tokens out (not when a marker is one)."""
        return all(parser is None or parser.skip_special_tokens for parser in (
            self.reasoning, None if self.tool_use is None else self.tool_use.parser))

    def reader(self) -> ReplyReader:
        """A reader for one streamed reply."""
        return ReplyReader(
            None if self.reasoning is None else self.reasoning.stream(self.reasoning_start),
            None if self.tool_use is None else self.tool_use.parser.stream())

    def parse(self, text: str) -> tuple[str | None, str, list[ToolCall]]:
        """A whole reply's reasoning (None when there is none), content and calls."""
        reader = self.reader()
        reasoning, content, _ = reader.feed(text, final=True)
        return reasoning or None, content, reader.calls


class ReplyReader:
    """Reads one reply as it comes: its reasoning, then its answer's content and call pieces
    (the answer goes through the tool-call reader when there is one)."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None) -> None:
        self._reasoning, self._tools = reasoning, tools

    @property
    def calls(self) -> list[ToolCall]:
        """The calls announced so far, their arguments as far as read."""
        if self._tools is None:
            return []
        return [ToolCall(name, arguments, call_id)
                for call_id, name, arguments in self._tools.calls]

    def feed(self, delta: str, final: bool = False) -> tuple[str, str, list[ToolCallDelta]]:
        """Takes ``delta`` (``final``: the reply ends with it); returns the reasoning, content
        and call pieces it releases."""
        reasoning, answer = ("", delta) if self._reasoning is None else \
            self._reasoning.feed(delta, final)
        if self._tools is None:
            return reasoning, answer, []
        content, pieces = self._tools.feed(answer, final)
        return reasoning, content, pieces


def _answer_lark(constraint: StructuredOutputsParams, field: str) -> str:
    """``constraint`` (a grammar, or JSON as ``response_format`` asks for it) as a Lark
    grammar whose top rule is ``start``, to follow a reply's reasoning; errors name
    ``field``."""
    if constraint.grammar is not None:
        return constraint.grammar
    schema = {"type": "object"} if constraint.json_object else constraint.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise APIError(400, f"the JSON schema is not valid JSON: {error}",
                           param=field) from None
    return f"start: {json_lark(schema)}\n"


def count_usage(outputs: Sequence[RequestOutput | None], n: int) -> api.Usage:
    """Prompt tokens once per prompt (a prompt's n choices share it), output tokens of all."""
    done = [o for o in outputs if o is not None]
    prompt = sum(len(o.prompt_token_ids) for o in done[::n])
    completion = sum(len(o.outputs[0].token_ids) for o in done)
    return api.Usage(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)


def _event(chunk: api.CompletionChunk | api.ChatCompletionChunk, **extra: Any) -> str:
    body = chunk.model_dump(exclude_none=True)
    body.update(extra)
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def named_event(name: str, body: dict[str, Any]) -> str:
    """A server-sent event with an ``event:`` line, as the Responses and Messages APIs send
    them (their SDKs dispatch on the name; the body repeats it as ``type``)."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **body}, ensure_ascii=False)}\n\n"
