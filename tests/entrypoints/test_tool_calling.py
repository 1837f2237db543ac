"""Tool calling through ``fastllm serve``, on a tiny random-weight Qwen3 with the real Qwen3
tokenizer and chat template (Hermes' ``<tool_call>`` format): forced calls (``required``, a
named function) come back valid for the tools' schemas, streamed and not, though the model is
noise; under "auto" a reply without a call is plain text and one that calls (here a reply
held to a call's JSON by ``response_format``) is that call; tools, assistant calls with null
content and tool results render as HF renders them; ``tool_choice`` "none" calls nothing; bad
tools are 400s naming the field. Then the clients
agents are built with: langchain-openai (``bind_tools`` and a ``ToolMessage`` round trip,
``with_structured_output`` by function calling) and openai-agents (an ``Agent`` with a
``function_tool``)."""

from __future__ import annotations

import contextlib
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
import transformers
from conftest import http
from example_tools import WEATHER, WEATHER_PARAMETERS, assert_valid_call
from openai_server import running_server
from pydantic import BaseModel, ConfigDict, Field

from fastllm import LLM, AsyncLLM, SamplingParams, StructuredOutputsParams
from fastllm.entrypoints.cli import main

MODEL = "tiny-qwen3"
# Bounded arguments (no free strings, no extra keys), so that noise ends soon.
TIME_PARAMETERS = {"type": "object", "properties": {
    "zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"],
    "additionalProperties": False}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone", "parameters": TIME_PARAMETERS}}
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_TOOLS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                     "{% endfor %}<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    llm = AsyncLLM(tiny_qwen3, max_model_len=2048)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def server(llm):
    with running_server(llm, MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_qwen3):
    return transformers.AutoTokenizer.from_pretrained(tiny_qwen3)


def stream_message(stream) -> tuple[str | None, list[dict], str]:
    """A streamed reply put back together as the SDKs do: content, calls, finish reason."""
    content, calls, finish = None, [], None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for piece in delta.tool_calls or []:
                if piece.id is not None:  # the first piece: index, id, type, name
                    assert piece.index == len(calls) and piece.type == "function"
                    calls.append({"id": piece.id, "name": piece.function.name,
                                  "arguments": piece.function.arguments or ""})
                else:
                    assert piece.function.name is None
                    calls[piece.index]["arguments"] += piece.function.arguments
            finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_forced_call_is_valid(client, tool_choice):
    choice = ({"type": "function", "function": {"name": "get_time"}}
              if tool_choice == "named" else "required")
    names = ("get_time",) if tool_choice == "named" else ("get_weather", "get_time")
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], tool_choice=choice,
            parallel_tool_calls=False, max_tokens=200, seed=seed)
        choice0 = reply.choices[0]
        assert choice0.finish_reason == "tool_calls"
        assert choice0.message.content is None and len(choice0.message.tool_calls) == 1
        assert_valid_call(choice0.message.tool_calls[0], SCHEMAS, names)
        # Streamed, with the same seed: the same call, in OpenAI's deltas.
        content, calls, finish = stream_message(client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], tool_choice=choice,
            parallel_tool_calls=False, max_tokens=200, seed=seed, stream=True))
        assert content is None and finish == "tool_calls"
        whole = choice0.message.tool_calls[0].function
        assert [(c["name"], c["arguments"]) for c in calls] == [(whole.name, whole.arguments)]


def test_parallel_required_calls_are_valid(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], tool_choice="required",
        max_tokens=400, seed=0)
    calls = reply.choices[0].message.tool_calls
    assert calls and len({call.id for call in calls}) == len(calls)
    for call in calls:
        assert_valid_call(call, SCHEMAS)


def test_tools_and_results_render_as_hf(client, hf_tokenizer):
    """The prompt is HF's rendering of the same conversation: the tools shown, the assistant's
    call with null content and the tool's result rendered, and the server answers."""
    arguments = {"city": "Paris", "days": 2}
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
         "content": "Sunny, 21 C"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages,
                                           tools=[WEATHER, TIME], max_tokens=4, seed=0)
    assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls")
    hf_messages = json.loads(json.dumps(messages))
    hf_messages[1]["content"] = ""
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = arguments
    prompt = hf_tokenizer.apply_chat_template(hf_messages, tools=[WEATHER, TIME],
                                              add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in prompt
    assert '"name": "get_time"' in prompt
    assert reply.usage.prompt_tokens == len(hf_tokenizer(prompt)["input_ids"])
    # Streamed too, and without tools in the request (the history alone).
    _, _, finish = stream_message(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, seed=0, stream=True))
    assert finish == "length"


def test_tool_choice_none_calls_nothing(client, hf_tokenizer):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER],
                                           tool_choice="none", max_tokens=8, seed=0)
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    assert isinstance(choice.message.content, str)
    # The tools are not shown (vLLM's --exclude-tools-when-tool-choice-none).
    plain = hf_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True,
                                             tokenize=False)
    assert reply.usage.prompt_tokens == len(hf_tokenizer(plain)["input_ids"])


def test_auto_is_read_like_a_plain_reply(client):
    """A reply with no call (the tiny model's noise) is the plain reply, streamed or not."""
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=12, seed=3, temperature=0)
    plain = client.chat.completions.create(**kwargs).choices[0]
    auto = client.chat.completions.create(tools=[WEATHER], **kwargs).choices[0]
    content, calls, finish = stream_message(client.chat.completions.create(
        tools=[WEATHER], stream=True, **kwargs))
    assert auto.message.tool_calls is None and calls == []
    assert finish == auto.finish_reason == "length"
    # The tools change the prompt, so compare each reply with its own kind only.
    assert content == auto.message.content and isinstance(plain.message.content, str)


def test_auto_reads_a_call_the_reply_makes(llm):
    """A reply that is a call (Llama 3's JSON format, which a JSON schema can hold the noise
    to: Hermes' tags are not JSON) comes back as that call under "auto", streamed or not."""
    call_schema = {"type": "object", "properties": {
        "name": {"const": "get_weather"}, "parameters": WEATHER_PARAMETERS},
        "required": ["name", "parameters"], "additionalProperties": False}
    kwargs = dict(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], tool_choice="auto",
                  max_tokens=200, seed=0, response_format={
                      "type": "json_schema", "json_schema": {"name": "call",
                                                             "schema": call_schema}})
    with running_server(llm, MODEL, tool_call_parser="llama3_json") as server:
        client = openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0)
        reply = client.chat.completions.create(**kwargs).choices[0]
        content, calls, finish = stream_message(client.chat.completions.create(stream=True,
                                                                               **kwargs))
    assert reply.finish_reason == finish == "tool_calls"
    assert reply.message.content is None and content is None
    [call] = reply.message.tool_calls
    arguments = assert_valid_call(call, SCHEMAS, ("get_weather",))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather",
                                                                         arguments)]


def post(server, body: dict) -> httpx.Response:
    return http.post(f"{server.v1}/chat/completions", json={"model": MODEL, **body},
                      timeout=60)


@pytest.mark.parametrize("body, param, says", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools.0.function.name", "Field required"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools.0.function.name", "pattern"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type", "function"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "`nope`"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "auto"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "distinct"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}],
      "tool_choice": "required"}, "tools", "structured output"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format", "tool_choice"),
    ({"messages": QUESTION + [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages.1.tool_calls.0.function.arguments", "not JSON"),
])
def test_bad_tools_are_400s_naming_the_field(server, body, param, says):
    response = post(server, {"messages": QUESTION, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_a_template_without_tools_gets_the_generic_format(llm):
    """A template that renders no tools, whatever the parser: the tools are described in the
    system message (GenericToolFormat) and a forced call comes back valid."""
    with contextlib.ExitStack() as stack:
        unknown = stack.enter_context(running_server(llm, MODEL,
                                                     chat_template=NO_TOOLS_TEMPLATE))
        hermes = stack.enter_context(running_server(
            llm, MODEL, chat_template=NO_TOOLS_TEMPLATE, tool_call_parser="hermes"))
        for server in (unknown, hermes):
            response = post(server, {"messages": QUESTION, "tools": [WEATHER],
                                     "tool_choice": "required", "parallel_tool_calls": False,
                                     "max_tokens": 100, "seed": 0})
            assert response.status_code == 200, response.text
            message = response.json()["choices"][0]["message"]
            [call] = message["tool_calls"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_PARAMETERS)
            # The prompt: the template's rendering of a system message describing the tool.
            plain = post(server, {"messages": QUESTION, "max_tokens": 1}).json()
            described = post(server, {"messages": QUESTION, "max_tokens": 1, "tools": [WEATHER],
                                      "seed": 0}).json()
            assert described["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 50
            # "none" shows no tools.
            assert post(server, {"messages": QUESTION, "max_tokens": 1, "tools": [WEATHER],
                                 "tool_choice": "none"}).json()["usage"]["prompt_tokens"] == \
                plain["usage"]["prompt_tokens"]


def test_serve_refuses_an_unknown_parser(tiny_qwen3, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(tiny_qwen3), "--tool-call-parser", "xml"])
    assert exit_info.value.code == 2
    assert "tool_call_parser must be one of ['hermes', 'llama3_json', 'mistral']" in \
        capsys.readouterr().err


def test_special_tokens_stay_in_the_text_when_asked(tiny_qwen3):
    """What a parser with a special marker (Mistral's [TOOL_CALLS]) relies on."""
    llm = LLM(tiny_qwen3, max_model_len=64)
    marker = llm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    forced = StructuredOutputsParams(grammar=f'start: <[{marker}]> "hi"')
    texts = [llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=forced,
                                              skip_special_tokens=skip),
                          use_tqdm=False)[0].outputs[0].text for skip in (True, False)]
    assert texts == ["hi", "<|im_start|>hi"]


# ---- the clients ----------------------------------------------------------------------------

class GetWeather(BaseModel):
    """The forecast for a city."""

    model_config = ConfigDict(extra="forbid")  # bounded arguments, as above

    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=7)


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)


def test_langchain_bind_tools_round_trip(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL, base_url=server.v1, api_key="none", max_retries=0,
                      max_tokens=200, seed=0)
    bound = chat.bind_tools([GetWeather], tool_choice="GetWeather")
    question = HumanMessage("What is the weather in Oslo?")
    call_message = bound.invoke([question])
    assert len(call_message.tool_calls) == 1
    call = call_message.tool_calls[0]
    assert call["name"] == "GetWeather" and call["id"].startswith("call_")
    GetWeather.model_validate(call["args"])
    answer = chat.bind(max_tokens=4).invoke(
        [question, call_message, ToolMessage("Sunny", tool_call_id=call["id"])])
    assert isinstance(answer.content, str) and answer.response_metadata["finish_reason"]
    # Streamed, the chunks add up to the same kind of call.
    streamed = None
    for chunk in chat.bind_tools([GetWeather], tool_choice="required").stream([question]):
        streamed = chunk if streamed is None else streamed + chunk
    assert [c["name"] for c in streamed.tool_calls] == ["GetWeather"]
    GetWeather.model_validate(streamed.tool_calls[0]["args"])


def test_langchain_structured_output_by_function_calling(server):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL, base_url=server.v1, api_key="none", max_retries=0,
                      max_tokens=200, seed=1)
    person = chat.with_structured_output(Person, method="function_calling").invoke(
        "Invent a person.")
    assert isinstance(person, Person)


def test_instructor_tools_mode(server):
    """instructor's Mode.TOOLS: the model is called as a named function (here forced by the
    grammar), and its arguments validate as the pydantic model."""
    import instructor

    client = instructor.from_openai(
        openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0),
        mode=instructor.Mode.TOOLS)
    person = client.chat.completions.create(
        model=MODEL, response_model=Person, max_retries=0, max_tokens=200, seed=1,
        messages=[{"role": "user", "content": "Invent a person."}])
    assert isinstance(person, Person)


def test_openai_agents_function_tool(server):
    from agents import (
        Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
        set_tracing_disabled)

    set_tracing_disabled(True)  # no trace export to OpenAI
    ran = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"], days: int) -> str:
        """The forecast for a city.

        Args:
            city: the city.
            days: how many days ahead.
        """
        ran.append((city, days))
        return f"Sunny in {city} for {days} days"

    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=server.v1, api_key="none", max_retries=0))
    agent = Agent(name="forecaster", instructions="Answer with the forecast.",
                  tools=[get_weather], model=model, tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="required", max_tokens=200,
                                               parallel_tool_calls=False))
    result = Runner.run_sync(agent, "What is the weather in Lima?")
    assert len(ran) == 1
    city, days = ran[0]
    assert city in ("Paris", "Oslo", "Lima") and isinstance(days, int)
    assert result.final_output == f"Sunny in {city} for {days} days"
