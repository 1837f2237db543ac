"""OpenAI's Responses API (``/v1/responses``) and Anthropic's Messages API (``/v1/messages``)
end to end: a real server driven with the official ``openai`` and ``anthropic`` SDKs, their
texts checked against the chat completions endpoint's for the same conversation (greedy,
batch-invariant: equal to the character), streamed (the events in order, joined deltas) and
not; the stop reasons, structured output, each API's error shape naming the field, the API key
as ``x-api-key`` and disconnects that abort. stories260K (given a chat template: it has none)
where the mechanics matter, the real SmolLM2 where real answers do."""

from __future__ import annotations

import json
import socket
import time

import httpx
import jsonschema
import openai
import pytest
from conftest import http
from openai_server import finished, running_server, wait_idle

from fastllm import AsyncLLM

API_KEY = "sk-test"
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
SYSTEM, USER = "Be kind.", "Tell me a story."
CONVERSATION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
GREEDY = {"temperature": 0}
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(model_path):
    llm = AsyncLLM(model_path("stories260K_hf"), max_model_len=512, batch_invariant=True)
    try:
        with running_server(llm, "stories", api_key=API_KEY, chat_template=TEMPLATE) as running:
            yield running
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def gpt(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude(server, anthropic) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0)


def chat_completion(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int):
    """The chat completions endpoint's greedy answer."""
    return client.chat.completions.create(model=model, messages=messages,
                                          max_completion_tokens=max_tokens, **GREEDY)


def post(server, path: str, body: dict, **headers: str) -> httpx.Response:
    return http.post(server.v1 + path, json=body,
                      headers=headers or {"Authorization": f"Bearer {API_KEY}"})


# ---- /v1/responses -----------------------------------------------------------------------------

def test_a_response_is_the_chat_completion_streamed_and_not(gpt):
    chat = chat_completion(gpt, "stories", CONVERSATION, 24)
    text = chat.choices[0].message.content
    got = gpt.responses.create(model="stories", instructions=SYSTEM, input=USER,
                               max_output_tokens=24, **GREEDY)
    assert got.output_text == text
    assert got.id.startswith("resp_") and got.object == "response" and got.model == "stories"
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    message, = got.output
    assert (message.type, message.role, message.status) == ("message", "assistant",
                                                            "incomplete")
    assert [part.type for part in message.content] == ["output_text"]
    assert (got.usage.input_tokens, got.usage.output_tokens, got.usage.total_tokens) == (
        chat.usage.prompt_tokens, 24, chat.usage.prompt_tokens + 24)
    # The same conversation as input items: the system message and text parts.
    items = gpt.responses.create(model="stories", max_output_tokens=24, **GREEDY, input=[
        {"role": "system", "content": SYSTEM},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": USER}]}])
    assert items.output_text == text

    events = list(gpt.responses.create(model="stories", instructions=SYSTEM, input=USER,
                                       max_output_tokens=24, stream=True, **GREEDY))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert [event.type for event in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * len(deltas),
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"]
    assert "".join(deltas) == text and events[-4].text == text
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == text
    assert final.usage.output_tokens == 24
    assert events[0].response.status == "in_progress"
    assert events[2].item.id == events[-2].item.id and events[-2].item.status == "incomplete"


def test_tokenize_renders_messages_as_the_chat_api_does(gpt, server):
    chat = chat_completion(gpt, "stories", CONVERSATION, 4)
    got = http.post(server.base_url + "/tokenize",
                     json={"model": "stories", "messages": CONVERSATION}).json()
    assert got["count"] == chat.usage.prompt_tokens == len(got["tokens"])
    without = http.post(server.base_url + "/tokenize", json={
        "messages": CONVERSATION, "add_generation_prompt": False}).json()
    assert without["count"] < got["count"]  # the template's "assistant:" left out
    refused = http.post(server.base_url + "/tokenize", json={
        "messages": CONVERSATION, "add_special_tokens": True})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "add_special_tokens"


def test_output_text_logprobs_when_included(gpt):
    """include ["message.output_text.logprobs"] with top_logprobs: each output token's
    logprob and alternatives on output_text, equal to the chat API's for the same
    conversation; streamed, the deltas' logprobs join to the same list."""
    chat = gpt.chat.completions.create(model="stories", messages=CONVERSATION,
                                       max_completion_tokens=12, logprobs=True, top_logprobs=2,
                                       **GREEDY)
    expected = [token.model_dump() for token in chat.choices[0].logprobs.content]
    asked = dict(model="stories", instructions=SYSTEM, input=USER, max_output_tokens=12,
                 include=["message.output_text.logprobs"], top_logprobs=2, **GREEDY)
    got = gpt.responses.create(**asked)
    text, = got.output[0].content
    assert [token.model_dump() for token in text.logprobs] == expected
    assert len(expected) == 12 and all(len(token["top_logprobs"]) == 2 for token in expected)
    events = list(gpt.responses.create(**asked, stream=True))
    streamed = [token.model_dump() for event in events
                if event.type == "response.output_text.delta" for token in event.logprobs]
    done = next(event for event in events if event.type == "response.output_text.done")
    assert streamed == expected == [token.model_dump() for token in done.logprobs]
    # Not included: none, as OpenAI sends them.
    plain = gpt.responses.create(**{**asked, "include": None})
    assert plain.output[0].content[0].logprobs == []


def test_a_completed_response_through_the_sdks_stream_helper(smollm2_server):
    client = openai.OpenAI(base_url=smollm2_server.v1, api_key="none", max_retries=0)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    brief = "Answer in one sentence."
    chat = chat_completion(client, "smollm2", [{"role": "system", "content": brief},
                                               *question], 40)
    kwargs = dict(model="smollm2", instructions=brief, input=question,
                  max_output_tokens=40, **GREEDY)
    got = client.responses.create(**kwargs)
    assert got.status == "completed" and got.incomplete_details is None
    assert got.output_text == chat.choices[0].message.content and "Paris" in got.output_text
    with client.responses.stream(**kwargs) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == got.output_text
    assert (final.usage.input_tokens, final.usage.output_tokens) == (got.usage.input_tokens,
                                                                      got.usage.output_tokens)

    # A second turn with the first answer fed back as it came.
    follow = [*question, got.output[0].model_dump(exclude_none=True),
              {"role": "user", "content": "And of Germany?"}]
    again = client.responses.create(model="smollm2", input=follow, max_output_tokens=40,
                                    **GREEDY)
    assert again.output_text == chat_completion(client, "smollm2", [
        *question, {"role": "assistant", "content": got.output_text},
        {"role": "user", "content": "And of Germany?"}], 40).choices[0].message.content


def test_json_schema_output_in_both_apis_validates(smollm2_server, anthropic):
    client = openai.OpenAI(base_url=smollm2_server.v1, api_key="none", max_retries=0)
    got = client.responses.create(
        model="smollm2", input="Describe a person as JSON.", max_output_tokens=60, **GREEDY,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                         "strict": True}})
    jsonschema.validate(json.loads(got.output_text), PERSON)
    assert got.text.format.type == "json_schema"
    claude = anthropic.Anthropic(base_url=smollm2_server.base_url, api_key="none",
                                 max_retries=0)
    message = claude.messages.create(
        model="smollm2", max_tokens=60, extra_body=GREEDY,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": PERSON}})
    jsonschema.validate(json.loads(message.content[0].text), PERSON)


# ---- /v1/messages ------------------------------------------------------------------------------

def test_a_message_is_the_chat_completion_streamed_and_not(gpt, claude):
    chat = chat_completion(gpt, "stories", CONVERSATION, 24)
    text = chat.choices[0].message.content
    kwargs = dict(model="stories", max_tokens=24, system=SYSTEM, extra_body=GREEDY,
                  messages=[{"role": "user", "content": USER}])
    got = claude.messages.create(**kwargs)
    assert got.id.startswith("msg_") and (got.type, got.role, got.model) == (
        "message", "assistant", "stories")
    assert [(block.type, block.text) for block in got.content] == [("text", text)]
    assert (got.stop_reason, got.stop_sequence) == ("max_tokens", None)
    assert (got.usage.input_tokens, got.usage.output_tokens) == (chat.usage.prompt_tokens, 24)
    blocks = claude.messages.create(**{**kwargs, "system": [{"type": "text", "text": SYSTEM}],
                                       "messages": [{"role": "user", "content": [
                                           {"type": "text", "text": USER}]}]})
    assert blocks.content[0].text == text
    counted = claude.messages.count_tokens(model="stories", system=SYSTEM,
                                           messages=kwargs["messages"])
    assert counted.input_tokens == chat.usage.prompt_tokens

    events = list(claude.messages.create(**kwargs, stream=True))
    deltas = [event.delta.text for event in events if event.type == "content_block_delta"]
    assert [event.type for event in events] == [
        "message_start", "content_block_start", *["content_block_delta"] * len(deltas),
        "content_block_stop", "message_delta", "message_stop"]
    assert "".join(deltas) == text
    assert events[0].message.usage.input_tokens == chat.usage.prompt_tokens
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 24
    with claude.messages.stream(**kwargs) as stream:
        assert "".join(stream.text_stream) == text
        final = stream.get_final_message()
    assert final.content[0].text == text and final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                      24)


def test_stop_sequences_end_the_message_and_are_named(claude):
    kwargs = dict(model="stories", max_tokens=40, extra_body=GREEDY,
                  messages=[{"role": "user", "content": USER}])
    free = claude.messages.create(**kwargs).content[0].text
    stop = free.split()[4]  # a word the greedy text holds
    got = claude.messages.create(**kwargs, stop_sequences=["zzzz", stop])
    assert got.content[0].text == free[:free.index(stop)]
    assert (got.stop_reason, got.stop_sequence) == ("stop_sequence", stop)
    with claude.messages.stream(**kwargs, stop_sequences=["zzzz", stop]) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == got.content[0].text
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_a_message_that_ends_its_turn(smollm2_server, anthropic):
    claude = anthropic.Anthropic(base_url=smollm2_server.base_url, api_key="none",
                                 max_retries=0)
    gpt = openai.OpenAI(base_url=smollm2_server.v1, api_key="none", max_retries=0)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    got = claude.messages.create(model="smollm2", max_tokens=40, messages=question,
                                 extra_body=GREEDY)
    assert got.stop_reason == "end_turn" and "Paris" in got.content[0].text
    chat = chat_completion(gpt, "smollm2", question, 40)
    assert got.content[0].text == chat.choices[0].message.content


# ---- errors and the API key --------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"input": "x", "store": True}, "store"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 600}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": []}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input.0.content.0.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x",
                                        "schema": {"type": "nonsense"}}}}, "text.format"),
    ({}, "input"),
])
def test_bad_responses_requests_name_the_field(server, body, param):
    response = post(server, "/responses", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"], error


@pytest.mark.parametrize("body, field", [
    ({"model": None}, "model"),
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 600}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "messages"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "tool", "name": "g"}}, "tool_choice"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
     "output_config.format"),
])
def test_bad_messages_requests_name_the_field_in_anthropics_shape(server, body, field):
    body = {"model": "stories", "max_tokens": 5,
            "messages": [{"role": "user", "content": "x"}], **body}
    body = {key: value for key, value in body.items() if value is not None}  # None: left out
    response = post(server, "/messages", body, **{"x-api-key": API_KEY})
    assert response.status_code == 400, response.text
    got = response.json()
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
    assert got["error"]["message"].startswith(f"{field}: "), got


def test_an_unknown_model_and_the_api_key_in_each_apis_shape(server, claude, anthropic):
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="claude-x", max_tokens=5,
                               messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["error"]["type"] == "not_found_error"
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model="stories", max_tokens=5,
                              messages=[{"role": "user", "content": "x"}])
    assert caught.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": caught.value.body["error"]["message"]}}
    body = {"model": "stories", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    assert post(server, "/messages", body).status_code == 200  # the Bearer header works too
    counted = post(server, "/messages/count_tokens", {"model": "stories", "messages": [
        {"role": "user", "content": "x"}]}, **{"x-api-key": API_KEY})
    assert counted.json()["input_tokens"] > 0
    refused = post(server, "/responses", {"input": "x"}, **{"x-api-key": API_KEY})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0).responses.create(
            model="gpt-x", input="x")


# ---- disconnects -------------------------------------------------------------------------------

def test_clients_that_disconnect_abort_their_requests(smollm2_server):
    """A streamed message read for its first events, a response not waited for: both requests
    are aborted. SmolLM2 (tokens take milliseconds here, not microseconds as stories260K's), so
    that neither can finish before its client leaves."""
    story = [{"role": "user", "content": "Tell me a long story."}]
    before = finished(smollm2_server)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", smollm2_server.v1 + "/messages", json={
                "model": "smollm2", "max_tokens": 400, "messages": story, "stream": True}) \
                as response:
            lines = response.iter_lines()
            while "content_block_delta" not in next(lines):
                pass
    wait_idle(smollm2_server.llm)
    assert finished(smollm2_server)["abort"] - before["abort"] == 1
    # A non-streamed response whose client leaves once the engine runs it.
    body = json.dumps({"model": "smollm2", "input": story, "max_output_tokens": 900}).encode()
    host, port = smollm2_server.base_url.removeprefix("http://").split(":")
    engine = smollm2_server.llm.client.engine
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: test\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while not engine.num_running:
            assert time.monotonic() < deadline, "the response never started"
            time.sleep(0.005)
    wait_idle(smollm2_server.llm)
    assert finished(smollm2_server)["abort"] - before["abort"] == 2
