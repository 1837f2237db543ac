"""Tools for a model whose chat template renders none (llama.cpp's generic mode): the real
SmolLM2-135M-Instruct GGUF served with no tool flags, through the openai SDK. The tools are
described in the system message, the reply is held by a grammar to a valid call (``required``,
a named function) or to text or calls (``auto``), calls and results in the history are written
in the same markup, and ``parallel_tool_calls: false`` allows one call."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from example_tools import WEATHER, WEATHER_PARAMETERS, assert_valid_call

from fastllm.entrypoints.openai.tool_parsers import GenericToolFormat

TIME_PARAMETERS = {"type": "object", "properties": {
    "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone", "parameters": TIME_PARAMETERS}}
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris for the next 2 days?"}]


@pytest.fixture(scope="module")
def client(smollm2_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_server.v1, api_key="none", max_retries=0)


def streamed(stream) -> tuple[str | None, list[tuple[str, str]], str]:
    content, calls, finish = None, [], None
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for piece in choice.delta.tool_calls or []:
                if piece.id is not None:
                    calls.append([piece.function.name, piece.function.arguments or ""])
                else:
                    calls[piece.index][1] += piece.function.arguments
            finish = choice.finish_reason or finish
    return content, [tuple(call) for call in calls], finish


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_forced_call_without_a_parser(client, tool_choice):
    choice = ({"type": "function", "function": {"name": "get_time"}}
              if tool_choice == "named" else "required")
    names = ("get_time",) if tool_choice == "named" else ("get_weather", "get_time")
    kwargs = dict(model="smollm2", messages=QUESTION, tools=[WEATHER, TIME],
                  tool_choice=choice, parallel_tool_calls=False, max_tokens=100, seed=0)
    reply = client.chat.completions.create(**kwargs).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    [call] = reply.message.tool_calls
    assert_valid_call(call, SCHEMAS, names)
    content, calls, finish = streamed(client.chat.completions.create(stream=True, **kwargs))
    assert (content, calls, finish) == (
        None, [(call.function.name, call.function.arguments)], "tool_calls")


def test_tools_are_described_in_the_system_message(client, smollm2_llm):
    """The prompt is the template's rendering of the system message GenericToolFormat writes
    (the template's own default system message gives way to it)."""
    tokenizer = smollm2_llm.tokenizer
    system = "Answer briefly."
    messages = [{"role": "system", "content": system}, *QUESTION]
    reply = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER],
                                           tool_choice="required", max_tokens=60, seed=0)
    prompt = GenericToolFormat.system_prompt([WEATHER], parallel=True)
    assert '"name": "get_weather"' in prompt and "<tool_call>" in prompt
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": f"{system}\n\n{prompt}"}, *QUESTION],
        add_generation_prompt=True, tokenize=True)
    assert reply.usage.prompt_tokens == len(expected)
    # Without a system message, the tools' description is the system message.
    reply = client.chat.completions.create(model="smollm2", messages=QUESTION, tools=[WEATHER],
                                           tool_choice="required", max_tokens=60, seed=0)
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": prompt}, *QUESTION], add_generation_prompt=True,
        tokenize=True)
    assert reply.usage.prompt_tokens == len(expected)


def test_a_round_trip_under_auto(client, smollm2_llm):
    """A forced call, its result sent back as a tool message, and the model's next turn under
    "auto": the history is rendered in the markup the system message describes, and the reply
    is text or valid calls, the same streamed."""
    first = client.chat.completions.create(
        model="smollm2", messages=QUESTION, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_tokens=60, seed=0).choices[0].message
    [call] = first.tool_calls
    assert first.content is None
    arguments = assert_valid_call(call, SCHEMAS)
    messages = [*QUESTION, first.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    kwargs = dict(model="smollm2", messages=messages, tools=[WEATHER], max_tokens=40, seed=0)
    reply = client.chat.completions.create(**kwargs)
    history = [{"role": "system",
                "content": GenericToolFormat.system_prompt([WEATHER], parallel=True)},
               *QUESTION,
               {"role": "assistant", "content": "<tool_call>\n" + json.dumps(
                   {"name": "get_weather", "arguments": arguments}) + "\n</tool_call>"},
               {"role": "user", "content": "<tool_response>\nSunny, 21 C\n</tool_response>"}]
    expected = smollm2_llm.tokenizer.apply_chat_template(history, add_generation_prompt=True,
                                                         tokenize=True)
    assert reply.usage.prompt_tokens == len(expected)
    choice = reply.choices[0]
    for tool_call in choice.message.tool_calls or []:
        assert_valid_call(tool_call, SCHEMAS, ("get_weather",))
    if not choice.message.tool_calls:
        assert choice.message.content and "<tool_call>" not in choice.message.content
    content, calls, finish = streamed(client.chat.completions.create(stream=True, **kwargs))
    assert finish == choice.finish_reason and content == choice.message.content
    assert calls == [(c.function.name, c.function.arguments)
                     for c in choice.message.tool_calls or []]


def test_parallel_tool_calls_false_allows_one_call(client):
    """Asked for two forecasts, the model may call twice; with parallel_tool_calls false the
    grammar ends the reply after the first call, under "required" and "auto". The requests go
    at once: the session's server is batch-invariant, so each seed's reply is its own."""
    ask = [{"role": "user", "content": "Weather in Paris and in Oslo, 2 days each?"}]

    def calls(tool_choice: str, parallel: bool, seed: int) -> list:
        extra = {} if parallel else {"parallel_tool_calls": False}
        return client.chat.completions.create(
            model="smollm2", messages=ask, tools=[WEATHER, TIME], tool_choice=tool_choice,
            max_tokens=200 if parallel else 120, seed=seed, **extra
        ).choices[0].message.tool_calls or []

    cases = [(tool_choice, False, seed) for tool_choice in ("required", "auto")
             for seed in range(3)] + [("required", True, seed) for seed in range(3)]
    with ThreadPoolExecutor(len(cases)) as pool:
        replies = list(pool.map(lambda case: calls(*case), cases))
    for (_, parallel, _), tool_calls in zip(cases, replies):
        if not parallel:
            assert len(tool_calls) <= 1
        for call in tool_calls:
            assert_valid_call(call, SCHEMAS)
    several = [len(tool_calls) for (_, parallel, _), tool_calls in zip(cases, replies)
               if parallel]
    assert max(several) > 1  # the limit above is the grammar's, not the model's habit
