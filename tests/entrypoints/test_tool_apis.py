"""Tools and reasoning through the APIs agents speak besides chat completions, with their
official SDKs: a tiny Qwen3 made into a bigram chain (``tiny_hf.chain_qwen3_folder``) whose
greedy reply to a prompt that opens ``<think>`` reasons "Two plus two." and closes the block,
served with the real Qwen3 template (Hermes calls) and ``--reasoning-parser qwen3``.

Anthropic's Messages API: a thinking block, then a tool_use block held valid by the grammar,
``stop_reason: "tool_use"``, streamed as thinking_delta and input_json_delta events; a tool_use
/ tool_result round trip rendered as HF renders it; ``count_tokens`` with tools; bad tools named
in Anthropic's error shape; the real SmolLM2 (a template without tools) calling a tool.

OpenAI's Responses API: a reasoning item, then a function_call item, streamed as
reasoning_text and function_call_arguments events; a function_call_output round trip rendered
as HF renders it; bad tools named; openai-agents' Responses model running a function tool."""

from __future__ import annotations

import json

from typing import Literal

import jsonschema
import openai
import pytest
import transformers
from conftest import http
from openai_server import running_server
from tiny_hf import chain_qwen3_folder

from fastllm import AsyncLLM
from fastllm.tokenizer import Tokenizer

MODEL = "chain-qwen3"
REASONING = "Two plus two."
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"type": "string",
                                                         "enum": ["UTC", "CET"]}},
               "required": ["zone"], "additionalProperties": False}
WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TIME = {"name": "get_time", "description": "The time in a zone", "input_schema": TIME_SCHEMA}
WEATHER = {"name": "get_weather", "description": "The forecast",
           "input_schema": WEATHER_SCHEMA}
QUESTION = [{"role": "user", "content": "What time is it in UTC?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory, model_path):
    tokenizer = Tokenizer.from_pretrained(model_path("qwen3_tokenizer"))
    words = ["\n", "Two", " plus", " two", "."]
    chain = [tokenizer.encode(word, add_special_tokens=False)[0] for word in words]
    chain.append(tokenizer.convert_tokens_to_ids("</think>"))
    return chain_qwen3_folder(tmp_path_factory.mktemp("chain"), model_path("qwen3_tokenizer"),
                              chain)


@pytest.fixture(scope="module")
def hf_tokenizer(folder):
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def template(hf_tokenizer) -> str:
    """Qwen3's template, its generation prompt opening <think> as its thinking models' do."""
    opened = hf_tokenizer.chat_template.replace(
        "{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    assert opened != hf_tokenizer.chat_template
    return opened


@pytest.fixture(scope="module")
def server(folder, template):
    llm = AsyncLLM(folder, max_model_len=2048)
    try:
        with running_server(llm, MODEL, reasoning_parser="qwen3",
                            chat_template=template) as running:
            yield running
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def claude(server, anthropic) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)


def test_thinking_then_a_tool_use(claude):
    kwargs = dict(model=MODEL, max_tokens=100, messages=QUESTION, tools=[TIME, WEATHER],
                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                  thinking={"type": "enabled", "budget_tokens": 1024}, extra_body=GREEDY)
    got = claude.messages.create(**kwargs)
    assert [block.type for block in got.content] == ["thinking", "tool_use"]
    thinking, call = got.content
    assert thinking.thinking == REASONING
    assert call.id.startswith("toolu_") and call.name in ("get_time", "get_weather")
    jsonschema.validate(call.input, {"get_time": TIME_SCHEMA,
                                     "get_weather": WEATHER_SCHEMA}[call.name])
    assert got.stop_reason == "tool_use"

    events = list(claude.messages.create(**kwargs, stream=True))
    kinds = [(event.type, getattr(getattr(event, "delta", None), "type", None)
              if event.type == "content_block_delta" else
              getattr(getattr(event, "content_block", None), "type", None))
             for event in events]
    thinking_deltas = kinds.count(("content_block_delta", "thinking_delta"))
    json_deltas = kinds.count(("content_block_delta", "input_json_delta"))
    assert thinking_deltas and json_deltas
    assert kinds == [("message_start", None), ("content_block_start", "thinking"),
                     *[("content_block_delta", "thinking_delta")] * thinking_deltas,
                     ("content_block_stop", None), ("content_block_start", "tool_use"),
                     *[("content_block_delta", "input_json_delta")] * json_deltas,
                     ("content_block_stop", None), ("message_delta", None),
                     ("message_stop", None)]
    assert [event.index for event in events if hasattr(event, "index")] == \
        [0] * (thinking_deltas + 2) + [1] * (json_deltas + 2)
    # The SDK's stream helper puts the blocks back together: the same message.
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "name", None),
             getattr(b, "input", None)) for b in final.content] == [
        ("thinking", REASONING, None, None), ("tool_use", None, call.name, call.input)]


def test_a_named_tool_and_none(claude):
    got = claude.messages.create(model=MODEL, max_tokens=100, messages=QUESTION,
                                 tools=[TIME, WEATHER], extra_body=GREEDY,
                                 tool_choice={"type": "tool", "name": "get_weather"})
    [call] = [block for block in got.content if block.type == "tool_use"]
    assert call.name == "get_weather" and got.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    # Thinking off: Qwen3's template closes the block, so no thinking comes back.
    none = claude.messages.create(model=MODEL, max_tokens=5, messages=QUESTION, tools=[TIME],
                                  tool_choice={"type": "none"}, extra_body=GREEDY,
                                  thinking={"type": "disabled"})
    assert [block.type for block in none.content] == ["text"]
    assert none.stop_reason == "max_tokens"


def test_a_tool_result_round_trip_renders_as_hf(claude, hf_tokenizer, template):
    first = claude.messages.create(model=MODEL, max_tokens=100, messages=QUESTION,
                                   tools=[TIME], extra_body=GREEDY,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    thinking, call = first.content
    messages = [*QUESTION, {"role": "assistant", "content": [
                    block.model_dump(exclude_none=True) for block in first.content]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": "12:00"},
                    {"type": "tool_result", "tool_use_id": "toolu_x", "is_error": True,
                     "content": [{"type": "text", "text": "no such zone"}]},
                    {"type": "text", "text": "Thanks."}]}]
    got = claude.messages.create(model=MODEL, max_tokens=5, messages=messages, tools=[TIME],
                                 extra_body=GREEDY)
    assert got.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = claude.messages.count_tokens(model=MODEL, messages=messages, tools=[TIME])
    tools = [{"type": "function", "function": {"name": "get_time",
                                                "description": TIME["description"],
                                                "parameters": TIME_SCHEMA}}]
    hf_messages = [*QUESTION,
                   {"role": "assistant", "content": "", "tool_calls": [{
                       "id": call.id, "type": "function",
                       "function": {"name": "get_time", "arguments": call.input}}]},
                   {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
                   {"role": "tool", "tool_call_id": "toolu_x",
                    "content": "Error: no such zone"},
                   {"role": "user", "content": "Thanks."}]
    prompt = hf_tokenizer.apply_chat_template(hf_messages, tools=tools, chat_template=template,
                                              add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\n12:00\n</tool_response>" in prompt and REASONING not in prompt
    assert counted.input_tokens == got.usage.input_tokens == \
        len(hf_tokenizer(prompt)["input_ids"])


@pytest.mark.parametrize("body, field", [
    ({"tools": [{"name": "has space", "input_schema": {"type": "object"}}]}, "tools.0.name"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [TIME], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": [TIME], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [TIME, TIME]}, "tools"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                   "input": {}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages.0.content.0.tool_use_id"),
])
def test_bad_tools_name_the_field(claude, body, field, anthropic):
    body = {"model": MODEL, "max_tokens": 5, "messages": QUESTION, **body}
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.post("/v1/messages", body=body, cast_to=object)
    error = caught.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{field}: "), error
    # The server is fine afterwards.
    assert claude.messages.create(model=MODEL, max_tokens=2, messages=QUESTION).content


def test_a_template_without_tools_calls_through_the_generic_format(smollm2_server, anthropic):
    claude = anthropic.Anthropic(base_url=smollm2_server.base_url, api_key="none",
                                 max_retries=0)
    kwargs = dict(model="smollm2", max_tokens=100, tools=[WEATHER], extra_body=GREEDY,
                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                  messages=[{"role": "user", "content": "Weather in Oslo, 3 days?"}])
    got = claude.messages.create(**kwargs)
    [call] = [block for block in got.content if block.type == "tool_use"]
    assert call.name == "get_weather" and got.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (call.name, call.input)]


# ---- OpenAI's Responses API --------------------------------------------------------------------

FUNCTIONS = [{"type": "function", "name": tool["name"], "description": tool["description"],
              "parameters": tool["input_schema"], "strict": True} for tool in (TIME, WEATHER)]


@pytest.fixture(scope="module")
def gpt(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0)


def test_a_response_reasons_then_calls(gpt):
    kwargs = dict(model=MODEL, input="What time is it in UTC?", tools=FUNCTIONS,
                  tool_choice="required", parallel_tool_calls=False, max_output_tokens=100,
                  **GREEDY)
    got = gpt.responses.create(**kwargs)
    assert got.status == "completed"
    assert [item.type for item in got.output] == ["reasoning", "function_call"]
    reasoning, call = got.output
    assert [part.text for part in reasoning.content] == [REASONING]
    assert reasoning.id.startswith("rs_") and call.id.startswith("fc_")
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments),
                        {"get_time": TIME_SCHEMA, "get_weather": WEATHER_SCHEMA}[call.name])
    assert got.tool_choice == "required" and got.parallel_tool_calls is False
    assert [tool.name for tool in got.tools] == ["get_time", "get_weather"]

    events = list(gpt.responses.create(stream=True, **kwargs))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    names = [event.type for event in events]
    reasoning_deltas = names.count("response.reasoning_text.delta")
    argument_deltas = names.count("response.function_call_arguments.delta")
    assert reasoning_deltas and argument_deltas
    assert names == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        *["response.reasoning_text.delta"] * reasoning_deltas, "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", *["response.function_call_arguments.delta"] *
        argument_deltas, "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    assert (text, arguments) == (REASONING, call.arguments)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(item.type, item.output_index if hasattr(item, "output_index") else None)
            for item in added] == [("reasoning", None), ("function_call", None)]
    assert [e.output_index for e in events if e.type.startswith("response.output_item")] == \
        [0, 0, 1, 1]
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert (final.output[1].name, final.output[1].arguments) == (call.name, call.arguments)


def test_a_function_call_output_round_trip(gpt, hf_tokenizer, template):
    """The call and its output fed back as input items (with the reasoning item, which is
    left out of the prompt): the prompt is HF's rendering of the same conversation."""
    first = gpt.responses.create(model=MODEL, input="What time is it in UTC?", tools=FUNCTIONS,
                                 tool_choice={"type": "function", "name": "get_time"},
                                 max_output_tokens=100, **GREEDY)
    reasoning, call = first.output
    assert call.name == "get_time"
    items = [{"role": "user", "content": "What time is it in UTC?"},
             reasoning.model_dump(exclude_none=True), call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}]
    got = gpt.responses.create(model=MODEL, input=items, tools=FUNCTIONS, tool_choice="none",
                               max_output_tokens=3, **GREEDY)
    assert [item.type for item in got.output] == ["reasoning", "message"]
    hf_messages = [{"role": "user", "content": "What time is it in UTC?"},
                   {"role": "assistant", "content": "", "tool_calls": [{
                       "id": call.call_id, "type": "function",
                       "function": {"name": "get_time",
                                    "arguments": json.loads(call.arguments)}}]},
                   {"role": "tool", "tool_call_id": call.call_id, "content": "12:00"}]
    # tool_choice "none": the tools are not shown.
    prompt = hf_tokenizer.apply_chat_template(hf_messages, chat_template=template,
                                              add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\n12:00\n</tool_response>" in prompt
    assert got.usage.input_tokens == len(hf_tokenizer(prompt)["input_ids"])


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "has space"}]}, "tools.0.name"),
    ({"tools": FUNCTIONS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]},
     "input.0.arguments"),
    ({"input": [{"type": "function_call_output", "output": "o"}]}, "input.0.call_id"),
])
def test_bad_tools_are_400s_naming_the_field(server, body, param):
    body = {"model": MODEL, "input": "x", "max_output_tokens": 2, **body}
    response = http.post(server.v1 + "/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert http.post(server.v1 + "/responses", json={
        "model": MODEL, "input": "x", "max_output_tokens": 2}).status_code == 200


def test_openai_agents_responses_model_runs_a_function_tool(server):
    """openai-agents' default model, the Responses API: the agent calls the tool, gets its
    result and stops on it."""
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)

    set_tracing_disabled(True)  # no trace export to OpenAI
    ran = []

    @function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone.

        Args:
            zone: the zone.
        """
        ran.append(zone)
        return f"12:00 in {zone}"

    model = OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=server.v1, api_key="none", max_retries=0))
    agent = Agent(name="clock", instructions="Tell the time.", tools=[get_time], model=model,
                  tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="required", max_tokens=100,
                                               parallel_tool_calls=False, temperature=0))
    result = Runner.run_sync(agent, "What time is it in UTC?")
    assert len(ran) == 1 and result.final_output == f"12:00 in {ran[0]}"
