"""``fastllm serve`` end to end: a real uvicorn server on 127.0.0.1 talked to with the real
``openai`` client (completions and chat, streamed and not, stop strings, logprobs, seeds,
structured output) and raw HTTP (malformed bodies and OpenAI's error shapes, the API key, the
body and queue limits, disconnects). stories260K where the point is the mechanics, the real
SmolLM2 where the point is real output. Greedy completions and structured output also run on
each device present."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
from conftest import free_port, http, per_device
from hub_server import LocalHub
from openai_server import finished, running_server, wait_idle

from fastllm import LLM, AsyncLLM, SamplingParams

API_KEY = "sk-test"
PROMPT = "Once upon a time"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "happy": {"type": "boolean"}},
          "required": ["name", "age", "happy"], "additionalProperties": False}


@pytest.fixture(scope="module")
def folder(model_path):
    return model_path("stories260K_hf")


# Batch-invariant on the CPU: a request's tokens do not depend on the batch it lands in, so
# texts can be compared across calls and with the reference exactly. CUDA has no such mode: the
# tests that run there compare float32 greedy texts, which a batch changes only by rounding, as
# it does a plain float32 CPU engine's (tests/engine/test_engine.py).
def batch_invariant(device: torch.device) -> bool:
    return device.type == "cpu"


@pytest.fixture(scope="module")
def servers(folder):
    """``servers(device)``: a server of stories260K on ``device``, one per device, stopped at
    the end of the module."""
    with contextlib.ExitStack() as stack:
        def start(device):
            llm = AsyncLLM(folder, device=device, max_model_len=256,
                           batch_invariant=batch_invariant(device))
            stack.callback(llm.shutdown)
            return stack.enter_context(running_server(llm, "stories", api_key=API_KEY,
                                                      max_body_bytes=64 << 10))

        yield per_device(start)


@pytest.fixture(scope="module")
def server(servers):
    return servers("cpu")


@pytest.fixture
def device_server(servers, device):
    return servers(device)


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def references(folder):
    """``references(device)``: an LLM like the server's on ``device``, one per device."""
    return per_device(lambda device: LLM(folder, device=device, max_model_len=256,
                                         batch_invariant=batch_invariant(device)))


@pytest.fixture(scope="module")
def reference(references) -> LLM:
    return references("cpu")


@pytest.fixture
def device_reference(references, device) -> LLM:
    return references(device)


def post(server, path: str, body: object, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}", **kwargs.pop("headers", {})}
    if isinstance(body, (bytes, str)):
        return http.post(server.base_url + path, content=body,
                          headers={"Content-Type": "application/json", **headers}, **kwargs)
    return http.post(server.base_url + path, json=body, headers=headers, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


# ---- completions -------------------------------------------------------------------------------

def test_completion_is_the_engines_greedy_text(device_server, device_reference):
    params = SamplingParams(temperature=0, max_tokens=40, stop=["park"])
    expected, = device_reference.generate(PROMPT, params, use_tqdm=False)
    client = openai_client(device_server)
    got = client.completions.create(model="stories", prompt=PROMPT, max_tokens=40,
                                    temperature=0, stop="park")
    choice, = got.choices
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert got.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_streamed_completion_joins_to_the_same_text_and_reports_usage(client):
    kwargs = dict(model="stories", prompt=PROMPT, max_tokens=30, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage


def test_stop_strings_end_the_text_and_are_never_sent(client):
    free = client.completions.create(model="stories", prompt=PROMPT, max_tokens=40,
                                     temperature=0).choices[0].text
    stop = free.split()[4]  # a word the greedy text holds
    for stream in (False, True):
        got = client.completions.create(model="stories", prompt=PROMPT, max_tokens=40,
                                        temperature=0, stop=[stop, "zzzz"], stream=stream)
        text = "".join(c.choices[0].text for c in got) if stream else got.choices[0].text
        assert text == free[:free.index(stop)]


def test_completion_logprobs(client, reference):
    got = client.completions.create(model="stories", prompt=PROMPT, max_tokens=12,
                                    temperature=0, logprobs=3)
    logprobs = got.choices[0].logprobs
    expected, = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12,
                                                          logprobs=3), use_tqdm=False)
    entries = expected.outputs[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(entries) == 12
    for token_logprob, top, entry, token_id in zip(logprobs.token_logprobs,
                                                    logprobs.top_logprobs, entries,
                                                    expected.outputs[0].token_ids):
        assert token_logprob == pytest.approx(entry[token_id].logprob, abs=1e-5)
        assert len(top) <= 3 and max(top.values()) == pytest.approx(token_logprob, abs=1e-5)
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_seeded_sampling_is_reproducible_and_choice_i_takes_seed_plus_i(client):
    kwargs = dict(model="stories", prompt=PROMPT, max_tokens=24, temperature=1.0, top_p=0.95)
    first = client.completions.create(**kwargs, seed=7, n=3)
    again = client.completions.create(**kwargs, seed=7, n=3)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    eighth = client.completions.create(**kwargs, seed=8)
    assert eighth.choices[0].text == first.choices[1].text
    streamed = client.completions.create(**kwargs, seed=7, n=3, stream=True)
    texts = ["", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in first.choices]


def test_penalties_and_logit_bias_reach_the_sampler(client, reference, server):
    token = server.llm.client.tokenizer.encode(" dog", add_special_tokens=False)[-1]
    got = client.completions.create(model="stories", prompt=PROMPT, max_tokens=8,
                                    temperature=0, logit_bias={str(token): 100},
                                    frequency_penalty=0.5)
    expected, = reference.generate(PROMPT, SamplingParams(
        temperature=0, max_tokens=8, logit_bias={token: 100}, frequency_penalty=0.5),
        use_tqdm=False)
    assert got.choices[0].text == expected.outputs[0].text


def test_token_id_prompts_and_several_prompts(client, server):
    ids = server.llm.client.tokenizer.encode(PROMPT)
    by_text = client.completions.create(model="stories", prompt=PROMPT, max_tokens=10,
                                        temperature=0)
    by_ids = client.completions.create(model="stories", prompt=[ids, ids], max_tokens=10,
                                       temperature=0)
    assert [c.text for c in by_ids.choices] == [by_text.choices[0].text] * 2


# ---- structured output -------------------------------------------------------------------------

def test_json_schema_output_validates_batched_with_free_requests(device_server,
                                                                  device_reference):
    """Constrained and unconstrained requests run in one batch: the constrained ones parse and
    validate, the free ones get exactly their text alone."""
    client = openai_client(device_server)
    free_expected, = device_reference.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)

    def constrained(seed: int) -> str:
        return client.completions.create(
            model="stories", prompt=PROMPT, max_tokens=60, temperature=1.0, seed=seed,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON}}}).choices[0].text

    def free(_: int) -> str:
        return client.completions.create(model="stories", prompt=PROMPT, max_tokens=40,
                                         temperature=0).choices[0].text

    with ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(constrained, seed) for seed in range(3)]
        jobs += [pool.submit(free, i) for i in range(3)]
        texts = [job.result() for job in jobs]
    for text in texts[:3]:
        jsonschema.validate(json.loads(text), PERSON)
    assert texts[3:] == [free_expected.outputs[0].text] * 3


def test_structured_outputs_in_sampling_params(device_reference):
    from fastllm import StructuredOutputsParams

    reference = device_reference
    out, = reference.generate(PROMPT, SamplingParams(
        temperature=0.8, seed=3, max_tokens=40,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"])), use_tqdm=False)
    assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"
    out, = reference.generate(PROMPT, SamplingParams(
        temperature=0, max_tokens=20,
        structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}")), use_tqdm=False)
    assert len(out.outputs[0].text) == 6 and out.outputs[0].text[3] == "-"
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="structured output"):
        reference.generate(PROMPT, SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="(unclosed")), use_tqdm=False)


# ---- models, health, metrics -------------------------------------------------------------------

def test_models_health_and_metrics(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["stories"]
    assert http.get(server.base_url + "/health").status_code == 200
    client.completions.create(model="stories", prompt=PROMPT, max_tokens=4)
    text = http.get(server.base_url + "/metrics").text
    for name in ("fastllm_request_success_total", "fastllm_time_to_first_token_seconds_bucket",
                 "fastllm_time_per_output_token_seconds_bucket", "fastllm_num_requests_running",
                 "fastllm_num_requests_waiting", "fastllm_kv_cache_usage_perc",
                 "fastllm_prefix_cache_hit_rate", "fastllm_generation_tokens_total"):
        assert name in text, name


def test_router_gauges_move_under_load(client, server):
    """The gauges a router's endpoint picker reads, under vLLM's names: requests running
    while a burst runs, none after."""

    def gauge(name: str) -> float:
        text = http.get(server.base_url + "/metrics").text
        line, = [line for line in text.splitlines() if line.startswith(name + "{")]
        return float(line.rsplit(" ", 1)[1])

    seen = 0.0
    with ThreadPoolExecutor(8) as pool:
        burst = [pool.submit(client.completions.create, model="stories", prompt=PROMPT,
                             max_tokens=64, extra_body={"ignore_eos": True}) for _ in range(8)]
        while not all(f.done() for f in burst):
            seen = max(seen, gauge("vllm:num_requests_running"))
        for future in burst:
            future.result()
    assert seen >= 1
    wait_idle(server.llm)
    assert (gauge("vllm:num_requests_running"), gauge("vllm:num_requests_waiting"),
            gauge("vllm:kv_cache_usage_perc")) == (0, 0, 0)


def test_tokenize_and_detokenize(server):
    tokenizer = server.llm.client.tokenizer
    got = http.post(server.base_url + "/tokenize", json={
        "model": "stories", "prompt": PROMPT, "return_token_strs": True}).json()
    ids = tokenizer.encode(PROMPT)
    assert got == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                   "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    bare = http.post(server.base_url + "/tokenize",
                      json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
    assert bare["token_strs"] is None
    text = http.post(server.base_url + "/detokenize", json={"tokens": ids}).json()
    assert text == {"prompt": tokenizer.decode(ids)}
    for path, body, status, param in (
            ("/tokenize", {"prompt": PROMPT, "messages": [{"role": "user", "content": "x"}]},
             400, None),
            ("/tokenize", {}, 400, None),
            ("/tokenize", {"model": "other", "prompt": PROMPT}, 404, "model"),
            ("/detokenize", {"tokens": [1, 99999]}, 400, "tokens"),
            ("/detokenize", {"tokens": [-1]}, 400, "tokens.0")):
        assert_error(http.post(server.base_url + path, json=body), status, param)


def test_reset_prefix_cache_forgets_cached_prompts(client, server):
    manager = server.llm.client.kv_cache.block_manager
    prompt = PROMPT + " there was a little girl who liked to play in the park" * 3
    client.completions.create(model="stories", prompt=prompt, max_tokens=2)
    wait_idle(server.llm)
    assert manager.stats()["cached_blocks"] > 0
    assert post(server, "/reset_prefix_cache", {}).status_code == 200
    assert (manager.stats()["cached_blocks"], manager.stats()["evictable_blocks"]) == (0, 0)
    assert_error(http.post(server.base_url + "/reset_prefix_cache"), 401)
    hits = manager.stats()["hits"]
    client.completions.create(model="stories", prompt=prompt, max_tokens=2)
    assert manager.stats()["hits"] == hits  # computed again: nothing was left to hit


# ---- bad requests ------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ({"prompt": PROMPT, "temperature": 2.5}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "n": 0}, "n"),
    ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
    ({"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ({"prompt": PROMPT, "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": PROMPT, "logit_bias": {"dog": 1}}, "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": PROMPT, "seed": -1}, "seed"),
    ({"prompt": PROMPT, "max_tokens": 300}, "max_tokens"),
    ({"prompt": "dog " * 300}, "prompt"),
    ({"prompt": [[1, 99999]]}, "prompt"),
    ({"prompt": PROMPT, "echo": True, "logprobs": 1, "n": 2}, "n"),
    ({}, "prompt"),
])
def test_bad_completion_requests_name_the_field(server, body, param):
    assert_error(post(server, "/v1/completions", body), 400, param)


def test_unknown_fields_are_ignored_with_a_log_line(server, client, caplog):
    """As vLLM: a field of another server's API passes, named in the log; vLLM's
    continuous_usage_stats gives the usage so far in every chunk."""
    with caplog.at_level("WARNING", logger="fastllm"):
        got = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3,
                                               "frobnicate": True})
    assert got.status_code == 200, got.text
    assert any("frobnicate" in record.getMessage() for record in caplog.records)
    chunks = list(client.completions.create(
        model="stories", prompt=PROMPT, max_tokens=4, stream=True, extra_body={
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts and counts == sorted(counts) and chunks[-1].usage.completion_tokens == 4


def test_echo_gives_the_prompts_logprobs(server, client, folder):
    """lm-eval's loglikelihood request: echo, max_tokens 0, logprobs; the prompt's logprobs are
    LLM's prompt_logprobs, the first token's None, and the text is the prompt's."""
    local = LLM(folder, max_model_len=256, batch_invariant=True)
    ids = local.tokenizer.encode(PROMPT)
    [expected] = local.generate({"prompt_token_ids": ids},
                                SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)
    got = client.completions.create(model="stories", prompt=PROMPT, max_tokens=0, echo=True,
                                    logprobs=2, temperature=0).choices[0]
    assert got.text == PROMPT and got.finish_reason == "length"
    assert len(got.logprobs.tokens) == len(ids)
    assert got.logprobs.token_logprobs[0] is None and got.logprobs.top_logprobs[0] is None
    for token_id, entry, logprob, top in zip(ids[1:], expected.prompt_logprobs[1:],
                                             got.logprobs.token_logprobs[1:],
                                             got.logprobs.top_logprobs[1:]):
        assert logprob == pytest.approx(entry[token_id].logprob, abs=1e-5)
        assert len(top) <= 2
    # Each token's text starts where text_offset says, in the returned text (the first word's
    # "▁" is no space at the start of a text, as decode gives it; the first token is BOS).
    tokens, offsets = got.logprobs.tokens, got.logprobs.text_offset
    assert offsets[1] == 0 and got.text.startswith(tokens[1].lstrip())
    for token, offset in zip(tokens[2:], offsets[2:]):
        assert got.text[offset:offset + len(token)] == token
    # With tokens to generate, the echoed prompt leads the text, streamed or not.
    full = client.completions.create(model="stories", prompt=PROMPT, max_tokens=6, echo=True,
                                     logprobs=1, temperature=0).choices[0]
    plain = client.completions.create(model="stories", prompt=PROMPT, max_tokens=6,
                                      temperature=0).choices[0]
    assert full.text == PROMPT + plain.text
    assert len(full.logprobs.tokens) == len(ids) + 6
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="stories", prompt=PROMPT, max_tokens=6, echo=True, temperature=0, stream=True)
        if c.choices)
    assert streamed == full.text


def test_sentencepiece_logprob_tokens_join_to_the_text(client):
    """stories260K's tokenizer is SentencePiece: a token's "▁" is a space, so the tokens join
    to the completion's text and each text_offset points at its token."""
    got = client.completions.create(model="stories", prompt=PROMPT, max_tokens=12,
                                    temperature=0, logprobs=0).choices[0]
    assert "".join(got.logprobs.tokens) == got.text
    for token, offset in zip(got.logprobs.tokens, got.logprobs.text_offset):
        assert got.text[offset:offset + len(token)] == token


def test_error_shapes(server):
    error = assert_error(post(server, "/v1/completions", b'{"prompt": "x",'), 400)
    assert "JSON" in error["message"]
    assert_error(post(server, "/v1/completions", b"[1, 2]"), 400)
    error = assert_error(post(server, "/v1/completions", {"prompt": "x", "model": "gpt-4"}), 404,
                         "model")
    assert error["code"] == "model_not_found"
    assert_error(post(server, "/v1/chat/completions", {"messages": []}), 400, "messages")
    assert_error(post(server, "/v1/chat/completions",  # stories260K has no chat template
                      {"messages": [{"role": "user", "content": "hi"}]}), 400, "messages")
    assert_error(post(server, "/v1/completions", {"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}),
        400, "response_format")
    assert_error(post(server, "/v1/completions", {"prompt": "x", "response_format": {
        "type": "json_schema"}}), 400, "response_format")
    assert_error(post(server, "/v1/rerank", {"query": "q", "documents": ["d"]}), 400, "model")
    assert_error(http.get(server.base_url + "/v1/nothing-here",
                           headers={"Authorization": f"Bearer {API_KEY}"}), 404)


def test_the_api_key_and_the_body_limit(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = http.post(server.v1 + "/completions", json={"prompt": "x"}, headers=headers)
        assert assert_error(response, 401)["code"] == "invalid_api_key"
    assert http.get(server.base_url + "/health").status_code == 200  # no key needed
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0).models.list()
    assert_error(post(server, "/v1/completions", {"prompt": "x" * (70 << 10)}), 413)


def test_a_full_queue_answers_503(folder, monkeypatch):
    llm = AsyncLLM(folder, max_model_len=256, max_num_seqs=1)
    # stories260K's 200 tokens take a few milliseconds, less than two HTTP requests on a loaded
    # machine: slowed steps keep the first request in its slot for seconds.
    engine_step = llm.client.engine.step

    def slow_step():
        time.sleep(0.01)
        return engine_step()

    monkeypatch.setattr(llm.client.engine, "step", slow_step)
    try:
        with running_server(llm, "stories", max_waiting_requests=1) as running:
            # The first request holds the one sequence slot while a second waits; should the
            # first still finish before the second arrives, or before the third does, try again.
            for _ in range(5):
                if fills_the_queue(running, llm):
                    break
            else:
                pytest.fail("the second request never waited behind the first in 5 tries")
            wait_idle(llm)
    finally:
        llm.shutdown()


def fills_the_queue(running, llm: AsyncLLM) -> bool:
    """One running and one waiting request, then a third: a 503 (False when the first request
    finished before the second was queued, or before the third came)."""
    body = {"prompt": PROMPT, "max_tokens": 1}
    with httpx.Client(timeout=30) as http, \
            http.stream("POST", running.v1 + "/completions",
                        json={**body, "max_tokens": 200, "ignore_eos": True,
                              "stream": True}) as first:
        lines = first.iter_lines()
        next(lines)  # running: it holds the one sequence slot
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(http.post, running.v1 + "/completions", json=body, timeout=30)
            while llm.client.engine.num_waiting < 1:
                if queued.done():
                    assert queued.result().status_code == 200
                    return False
                time.sleep(0.002)
            response = http.post(running.v1 + "/completions", json=body)
            if response.status_code == 200:  # it ran after the first two: they had left
                assert queued.result().status_code == 200
                return False
            assert assert_error(response, 503)["code"] == "queue_full"
            assert response.headers["retry-after"] == "1"
            assert queued.result().status_code == 200
    return True


# ---- disconnects -------------------------------------------------------------------------------

def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    llm = server.llm
    body = {"prompt": PROMPT, "max_tokens": 240, "ignore_eos": True, "stream": True, "n": 4}
    before = finished(server)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.v1 + "/completions", json=body,
                         headers={"Authorization": f"Bearer {API_KEY}"}) as response:
            lines = response.iter_lines()
            for _ in range(6):
                next(lines)
            assert llm.client.engine.num_running == 4 and llm.client.engine.kv_usage > 0
    wait_idle(llm, seconds=2)
    assert finished(server)["abort"] - before["abort"] == 4


def test_a_non_streaming_client_that_disconnects_aborts_its_request(server, monkeypatch):
    llm = server.llm
    # stories260K's 16 x 240 tokens can take less than the read timeout below: slowed steps make
    # them outlast it by seconds, so the client leaves mid-request and no choice finishes.
    engine_step = llm.client.engine.step

    def slow_step():
        time.sleep(0.02)
        return engine_step()

    monkeypatch.setattr(llm.client.engine, "step", slow_step)
    body = {"prompt": PROMPT, "max_tokens": 240, "ignore_eos": True, "n": 16}
    computed = llm.client.engine.stats.scheduled_tokens
    before = finished(server)
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", body, timeout=httpx.Timeout(30, read=0.3))
    # Generous on a loaded machine: the token count below tells an abort from a finish.
    wait_idle(llm, seconds=30)
    assert llm.client.engine.stats.scheduled_tokens - computed < 16 * 240
    # The handler counts its aborted choices once it has cancelled them all, which on a loaded
    # machine may come after the engine went idle.
    deadline = time.monotonic() + 30
    while finished(server)["abort"] - before["abort"] < 16 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert finished(server)["abort"] - before["abort"] == 16


# ---- chat with the real SmolLM2 ----------------------------------------------------------------

def test_chat_answers_streamed_and_not(smollm2_server):
    client = openai.OpenAI(base_url=smollm2_server.v1, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    got = client.chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                         max_completion_tokens=24, logprobs=True,
                                         top_logprobs=2)
    choice = got.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    content = choice.logprobs.content
    assert "".join(entry.token for entry in content).startswith(choice.message.content)
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)
    assert bytes(content[0].bytes).decode() == content[0].token
    chunks = list(client.chat.completions.create(model="smollm2", messages=messages,
                                                 temperature=0, max_tokens=24, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_json_schema_output_parses_and_validates(smollm2_server):
    client = openai.OpenAI(base_url=smollm2_server.v1, api_key="none", max_retries=0)
    got = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    person = json.loads(got.choices[0].message.content)
    jsonschema.validate(person, PERSON)
    got = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=60, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Return a JSON object with the keys "city" and '
                                              '"country" for the capital of France.'}])
    answer = json.loads(got.choices[0].message.content)
    assert answer["city"] == "Paris"


# ---- the command ---------------------------------------------------------------------------------

@contextlib.contextmanager
def serve_command(model, *args: str, env: dict[str, str] | None = None):
    """``fastllm serve model *args`` on a free port of 127.0.0.1 (in ``env``, default this
    process's environment), stopped (SIGTERM) at the end; yields (port, process) once it answers
    /health."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "fastllm", "serve", str(model), "--port", str(port), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if http.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert process.poll() is None, process.stdout.read()
                assert time.monotonic() < deadline
                time.sleep(0.1)
        yield port, process
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_fastllm_serve_command_binds_localhost(folder):
    with serve_command(folder, "--served-model-name", "tiny", "--max-model-len", "128") \
            as (port, _):
        got = http.post(f"http://127.0.0.1:{port}/v1/completions",
                         json={"model": "tiny", "prompt": PROMPT, "max_tokens": 5}).json()
        assert got["model"] == "tiny" and got["usage"]["completion_tokens"] == 5


def test_fastllm_serve_a_hub_model_under_its_name(folder, tmp_path):
    """``fastllm serve org/name``: downloaded through huggingface_hub (from a local endpoint),
    served under the name as given."""
    with LocalHub() as hub:
        hub.add("org/name", {p.name: p for p in folder.iterdir() if p.is_file()})
        env = hub.environ(tmp_path / "cache")
        with serve_command("org/name", env=env) as (port, _):
            models = http.get(f"http://127.0.0.1:{port}/v1/models").json()
            assert [model["id"] for model in models["data"]] == ["org/name"]
            got = http.post(f"http://127.0.0.1:{port}/v1/completions",
                             json={"model": "org/name", "prompt": PROMPT, "max_tokens": 8,
                                   "temperature": 0}).json()
    expected, = LLM(folder).generate(PROMPT, SamplingParams(temperature=0, max_tokens=8),
                                     use_tqdm=False)
    assert got["model"] == "org/name"
    assert got["choices"][0]["text"] == expected.outputs[0].text


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie no longer does)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_fastllm_serve_on_two_ranks_gives_the_same_completions(folder, client):
    """``--tensor-parallel-size 2``: the module's completions, greedy (batch-invariant on both
    servers), several prompts at once and streamed; the rank process ends with the server."""
    prompts = [PROMPT, "The little dog", "Lily and Tom went to the park. They"]
    with serve_command(folder, "--served-model-name", "stories", "--api-key", API_KEY,
                       "--max-model-len", "256", "--batch-invariant",
                       "--tensor-parallel-size", "2") as (port, process):
        ranks = [int(pid) for task in Path(f"/proc/{process.pid}/task").iterdir()
                 for pid in (task / "children").read_text().split()]  # any thread's
        assert ranks
        sharded = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY,
                                max_retries=0)
        for api in (client, sharded):
            got = api.completions.create(model="stories", prompt=prompts, max_tokens=24,
                                         temperature=0)
            texts = [choice.text for choice in sorted(got.choices, key=lambda c: c.index)]
            streamed = "".join(
                chunk.choices[0].text for chunk in api.completions.create(
                    model="stories", prompt=prompts[2], max_tokens=24, temperature=0,
                    stream=True) if chunk.choices)
            if api is client:
                expected = (texts, streamed)
        assert (texts, streamed) == expected
        assert streamed == texts[2]
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in ranks):
        assert time.monotonic() < deadline, "a rank outlived its server"
        time.sleep(0.05)


# ---- load ----------------------------------------------------------------------------------------

def test_64_streaming_clients_a_quarter_disconnecting(server, client):
    """64 concurrent streams: 16 disconnect at random points of long generations, the other 48
    get exactly the text of the same request non-streamed; afterwards no KV block is held and
    exactly the 48 finished."""
    import asyncio
    import random

    llm = server.llm
    starts = ["Once upon a time", "The dog", "Lily and Ben", "One day, a little bird",
              "Tom had a red ball", "The sun was", "Mom said", "There was a big tree"]
    rng = random.Random(0)
    quitters = set(rng.sample(range(64), 16))

    def request(i: int) -> dict:
        long = i in quitters  # long enough that it cannot finish before its client leaves
        return dict(model="stories", prompt=starts[i % 8], temperature=0.8, seed=i,
                    max_tokens=200 if long else 16, extra_body={"ignore_eos": long})

    expected = {i: client.completions.create(**request(i)).choices[0].text
                for i in range(64) if i not in quitters}

    before = finished(server)

    async def one(http: openai.AsyncOpenAI, i: int) -> str | None:
        stream = await http.completions.create(**request(i), stream=True)
        text, chunks = "", 0
        async for chunk in stream:
            text += chunk.choices[0].text
            chunks += 1
            if i in quitters and chunks == 1 + i % 5:
                await stream.close()  # the client goes away mid-stream
                return None
        return text

    async def all_clients() -> list[str | None]:
        async with openai.AsyncOpenAI(base_url=server.v1, api_key=API_KEY,
                                      max_retries=0) as http:
            return await asyncio.wait_for(
                asyncio.gather(*(one(http, i) for i in range(64))), timeout=60)

    texts = asyncio.run(all_clients())
    assert {i: texts[i] for i in expected} == expected
    wait_idle(llm, seconds=5)
    assert llm.client.kv_cache.block_manager.usage == 0
    after = finished(server)
    # A quitter is aborted or, when the server outran its client, finished first.
    assert after["length"] - before["length"] >= 48
    assert (after["length"] + after["abort"]) - (before["length"] + before["abort"]) == 64


def test_chat_choices_stream_interleaved_with_usage(smollm2_server):
    client = openai.OpenAI(base_url=smollm2_server.v1, api_key="none", max_retries=0)
    kwargs = dict(model="smollm2", messages=[{"role": "user", "content": "Name a color."}],
                  temperature=0.8, seed=11, n=2, max_tokens=12)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    texts, reasons = ["", ""], [None, None]
    for chunk in chunks[:-1]:
        choice, = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [c.message.content for c in whole.choices]
    assert reasons == [c.finish_reason for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert whole.usage.prompt_tokens == len(smollm2_server.llm.client.tokenizer.apply_chat_template(
        kwargs["messages"], add_generation_prompt=True, tokenize=True))
