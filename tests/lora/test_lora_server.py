"""LoRA adapters through ``fastllm serve``, driven by the openai and anthropic clients: a request's
``model`` picks the adapter (completions, chat, Responses, Messages, embeddings) and gets peft's
tokens; ``/v1/models`` lists the adapters with their parent; adapters load and unload while the
server runs; an unknown one is a 404 naming it; the metric of running and waiting adapters."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from conftest import http
from openai_server import running_server
from peft_models import base_model, peft_greedy, save_adapter

from fastllm import AsyncLLM
from fastllm.entrypoints.cli import main

PROMPT = [1, 37, 99, 201, 5, 77]
MAX_TOKENS = 8
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
# A template that only joins the messages: the chat prompt is known text.
TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def models(tmp_path_factory, model_path) -> dict:
    root = tmp_path_factory.mktemp("lora-server")
    hf = base_model("llama", root / "base", model_path("stories260K_hf"))
    return {"hf": hf, "base": root / "base",
            "a": save_adapter(hf, root / "a", seed=1, r=8, lora_alpha=16,
                              target_modules=["q_proj", "v_proj"]),
            "b": save_adapter(hf, root / "b", seed=2, r=4, lora_alpha=8,
                              target_modules=["o_proj", "gate_proj", "down_proj"])}


@pytest.fixture(scope="module")
def server(models):
    llm = AsyncLLM(models["base"], enable_lora=True, max_loras=2, max_lora_rank=8)
    try:
        with running_server(llm, "base", lora_modules={"a": str(models["a"])},
                            allow_runtime_lora_updating=True, chat_template=TEMPLATE) as running:
            yield running
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def expected_text(models, server, adapter: str | None, prompt=PROMPT) -> str:
    """peft's greedy continuation of ``prompt``, as text after the prompt's."""
    ids = peft_greedy(models["hf"], None if adapter is None else models[adapter], [prompt],
                      MAX_TOKENS)[0]
    tokenizer = server.llm.client.tokenizer
    before, text = tokenizer.decode(prompt), tokenizer.decode(prompt + ids)
    assert text.startswith(before)
    return text[len(before):]


def test_models_lists_the_adapters_with_their_parent(server, models):
    cards = {card["id"]: card for card in http.get(server.v1 + "/models").json()["data"]}
    assert cards["base"]["parent"] is None
    assert (cards["a"]["parent"], cards["a"]["root"]) == ("base", str(models["a"]))


def test_the_model_field_picks_the_adapter(client, server, models):
    for model, adapter in (("a", "a"), ("base", None)):
        reply = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
        assert reply.model == model
        assert reply.choices[0].text == expected_text(models, server, adapter)
    assert expected_text(models, server, "a") != expected_text(models, server, None)


def test_chat_responses_and_messages_take_the_adapter(client, server, models, anthropic):
    text = "Once upon a time"
    prompt = server.llm.client.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=True, chat_template=TEMPLATE)
    completion = expected_text(models, server, "a", prompt)
    chat = client.chat.completions.create(model="a", messages=[{"role": "user",
                                                                "content": text}], **GREEDY)
    assert (chat.model, chat.choices[0].message.content) == ("a", completion)
    response = client.responses.create(model="a", input=text, max_output_tokens=MAX_TOKENS,
                                       temperature=0.0, extra_body={"ignore_eos": True})
    assert (response.model, response.output_text) == ("a", completion)
    messages = anthropic.Anthropic(base_url=server.base_url, api_key="unused",
                                   max_retries=0).messages.create(
        model="a", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": text}],
        extra_body={"temperature": 0.0, "ignore_eos": True})
    assert (messages.model, messages.content[0].text) == ("a", completion)
    base = client.chat.completions.create(model="base", messages=[{"role": "user",
                                                                   "content": text}], **GREEDY)
    assert base.choices[0].message.content != completion


def test_embeddings_take_the_adapter(client):
    with_a, base = (client.embeddings.create(model=model, input=[PROMPT]) for model in ("a",
                                                                                         "base"))
    assert with_a.model == "a" and with_a.data[0].embedding != base.data[0].embedding
    assert with_a.data[0].embedding == client.embeddings.create(
        model="a", input=[PROMPT]).data[0].embedding


def test_an_unknown_adapter_is_a_404_naming_it(client):
    with pytest.raises(openai.NotFoundError, match="`nope` does not exist"):
        client.completions.create(model="nope", prompt=PROMPT, **GREEDY)


def test_adapters_load_and_unload_at_run_time(client, server, models):
    load, unload = server.v1 + "/load_lora_adapter", server.v1 + "/unload_lora_adapter"
    reply = http.post(load, json={"lora_name": "b", "lora_path": str(models["b"])})
    assert reply.status_code == 200, reply.text
    got = client.completions.create(model="b", prompt=PROMPT, **GREEDY).choices[0].text
    assert got == expected_text(models, server, "b")
    assert "b" in {card["id"] for card in http.get(server.v1 + "/models").json()["data"]}
    again = http.post(load, json={"lora_name": "b", "lora_path": str(models["b"])})
    assert again.status_code == 400 and "already been loaded" in again.text
    bad = http.post(load, json={"lora_name": "c", "lora_path": str(models["base"] / "none")})
    assert bad.status_code == 400 and "`c`" in bad.json()["error"]["message"]
    missing = http.post(load, json={"lora_name": "c"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    assert http.post(unload, json={"lora_name": "b"}).status_code == 200
    with pytest.raises(openai.NotFoundError, match="`b`"):
        client.completions.create(model="b", prompt=PROMPT, **GREEDY)
    gone = http.post(unload, json={"lora_name": "b"})
    assert gone.status_code == 404 and "`b` cannot be found" in gone.json()["error"]["message"]
    # Loaded again (its files read again), it serves as before.
    assert http.post(load, json={"lora_name": "b", "lora_path": str(models["b"])}
                      ).status_code == 200
    assert client.completions.create(model="b", prompt=PROMPT, **GREEDY).choices[0].text == got


def test_runtime_updating_is_off_unless_asked(models):
    llm = AsyncLLM(models["base"], enable_lora=True, max_lora_rank=8)
    try:
        with running_server(llm, "base") as plain:
            reply = http.post(plain.v1 + "/load_lora_adapter",
                               json={"lora_name": "b", "lora_path": str(models["b"])})
            assert reply.status_code == 404
    finally:
        llm.shutdown()


def test_the_metric_names_running_and_waiting_adapters(client, server):
    client.completions.create(model="a", prompt=PROMPT, **GREEDY)
    lines = [line for line in http.get(server.base_url + "/metrics").text.splitlines()
             if line.startswith("fastllm_lora_requests_info{")]
    assert len(lines) == 1 and 'max_lora="2"' in lines[0]
    assert 'running_lora_adapters=""' in lines[0]  # idle between requests


@pytest.mark.parametrize("argv, message", [
    (["--lora-modules", "a=x"], "need --enable-lora"),
    (["--enable-lora", "--lora-modules", "a"], "name=path"),
    (["--enable-lora", "--lora-modules", "a=x", "a=y"], "twice"),
    (["--enable-lora", "--lora-modules", '{"name": "a"}'], "name and path"),
])
def test_serve_refuses_bad_lora_options(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["serve", "unused-model", *argv])
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_serve_refuses_an_adapter_that_does_not_load(models, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["serve", str(models["base"]), "--enable-lora", "--max-lora-rank", "4",
              "--lora-modules", f"a={models['a']}", "--port", "0"])
    assert exit.value.code == 2 and "max_lora_rank" in capsys.readouterr().err


def test_cli_parses_vllm_json_lora_modules(models, capsys):
    # a JSON entry names the adapter as name=path does; the server then refuses nothing
    from fastllm.entrypoints.cli import _lora_modules
    assert _lora_modules([f'{{"name": "a", "path": "{models["a"]}"}}', "b=/x"]) == {
        "a": str(models["a"]), "b": "/x"}
    assert Path(_lora_modules([f"a={models['a']}"])["a"]) == models["a"]
