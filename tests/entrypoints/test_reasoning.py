"""``fastllm serve --reasoning-parser qwen3`` end to end, through the openai SDK, on a tiny
random-weight Qwen3 with the real Qwen3 tokenizer: its replies are forced into a known
reasoning-then-answer shape (a chat template that opens ``<think>``, as Qwen3's thinking models'
do; a logit bias that makes ``</think>`` likely; a JSON schema or a forced tool call for the
answer, which the server applies after the reasoning), and the raw reply, rebuilt from the
tokens' bytes in ``logprobs``, is split by hand to check ``reasoning_content`` and ``content``,
non-streamed and streamed. ``chat_template_kwargs`` reach the template."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import transformers
from openai_server import running_server

from fastllm import AsyncLLM

MODEL = "tiny-qwen3"
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
TIME_PARAMETERS = {"type": "object", "properties": {
    "zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"],
    "additionalProperties": False}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone", "parameters": TIME_PARAMETERS}}
QUESTION = [{"role": "user", "content": "Is it noon in UTC?"}]
THINK, END_THINK = 151667, 151668  # the Qwen3 tokenizer's <think> and </think>
# Likely enough that the reasoning ends after a few random tokens.
BIAS = {str(END_THINK): 11}


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    llm = AsyncLLM(tiny_qwen3, max_model_len=2048)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_qwen3):
    return transformers.AutoTokenizer.from_pretrained(tiny_qwen3)


@pytest.fixture(scope="module")
def thinking_client(llm, hf_tokenizer):
    """A server whose template opens <think> (Qwen3 thinking-only models', DeepSeek-R1's)."""
    template = hf_tokenizer.chat_template.replace(
        "{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    assert template != hf_tokenizer.chat_template
    with running_server(llm, MODEL, reasoning_parser="qwen3", chat_template=template) as server:
        yield openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def client(llm):
    """A server with Qwen3's own template (the model opens <think> when it thinks)."""
    with running_server(llm, MODEL, reasoning_parser="qwen3") as server:
        yield openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0)


def raw_text(choice) -> str:
    """The reply as the model wrote it, markers and all: its tokens' bytes."""
    return b"".join(bytes(token.bytes) for token in choice.logprobs.content).decode()


def split_by_hand(raw: str) -> tuple[str | None, str]:
    """Reasoning (stripped; None if empty) and answer of a reply that reasons first."""
    assert raw.count("</think>") == 1, raw
    reasoning, answer = raw.split("</think>")
    assert answer.startswith("\n\n")  # the blank line the grammar puts after the reasoning
    return reasoning.strip() or None, answer[2:]


def streamed(stream) -> tuple[str | None, str | None, list[dict], str]:
    reasoning = content = None
    calls, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            piece = getattr(delta, "reasoning_content", None)
            if piece:
                reasoning = (reasoning or "") + piece
                assert not delta.content and not delta.tool_calls  # reasoning comes first
            if delta.content:
                content = (content or "") + delta.content
            for call in delta.tool_calls or []:
                if call.id is not None:
                    calls.append({"name": call.function.name,
                                  "arguments": call.function.arguments or ""})
                else:
                    calls[call.index]["arguments"] += call.function.arguments
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reasoning_then_a_json_answer(thinking_client, seed):
    kwargs = dict(model=MODEL, messages=QUESTION, response_format=RESPONSE_FORMAT,
                  logit_bias=BIAS, max_tokens=300, seed=seed)
    choice = thinking_client.chat.completions.create(logprobs=True, **kwargs).choices[0]
    assert choice.finish_reason == "stop"
    reasoning, answer = split_by_hand(raw_text(choice))
    assert reasoning  # these seeds reason for a few tokens
    assert choice.message.reasoning_content == reasoning
    assert choice.message.content == answer
    jsonschema.validate(json.loads(answer), ANSWER)
    # Streamed, with the same seed: the same reply, reasoning and answer in their own deltas.
    got = streamed(thinking_client.chat.completions.create(stream=True, **kwargs))
    assert got == (reasoning, answer, [], "stop")


def test_reasoning_then_a_tool_call(thinking_client):
    kwargs = dict(model=MODEL, messages=QUESTION, tools=[TIME], tool_choice="required",
                  logit_bias=BIAS, max_tokens=300, seed=0)
    choice = thinking_client.chat.completions.create(logprobs=True, **kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    reasoning, answer = split_by_hand(raw_text(choice))
    assert answer.startswith("<tool_call>\n")
    assert choice.message.reasoning_content == reasoning and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME_PARAMETERS)
    got = streamed(thinking_client.chat.completions.create(stream=True, **kwargs))
    assert got == (reasoning, None, [{"name": "get_time",
                                      "arguments": call.function.arguments}], "tool_calls")


def test_enable_thinking_false_reaches_the_template(client, hf_tokenizer):
    """Qwen3's template closes an empty reasoning block: the reply is all answer, held to the
    schema from its first token."""
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, response_format=RESPONSE_FORMAT, max_tokens=50,
        seed=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    prompt = hf_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True,
                                              tokenize=False, enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n")
    assert reply.usage.prompt_tokens == len(hf_tokenizer(prompt)["input_ids"])
    message = reply.choices[0].message
    assert message.reasoning_content is None
    jsonschema.validate(json.loads(message.content), ANSWER)


def test_a_reply_that_opens_think_reasons(client):
    """With Qwen3's own template the model decides: a reply that opens <think> (here made
    to) is reasoning until </think>, and one cut off before it is all reasoning."""
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=6, seed=0,
                  logit_bias={str(THINK): 100})
    choice = client.chat.completions.create(logprobs=True, **kwargs).choices[0]
    raw = raw_text(choice)
    assert raw.startswith("<think>") and "</think>" not in raw
    assert choice.finish_reason == "length"
    assert choice.message.reasoning_content == raw[len("<think>"):].strip()
    assert choice.message.content == ""
    got = streamed(client.chat.completions.create(stream=True, **kwargs))
    assert got == (raw[len("<think>"):].strip(), None, [], "length")
    # Without the bias, the reply does not open <think>: it is all content.
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6,
                                           seed=0, logprobs=True).choices[0]
    assert not raw_text(plain).lstrip().startswith("<think>")
    assert plain.message.reasoning_content is None
    assert plain.message.content == raw_text(plain)
