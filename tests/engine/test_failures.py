"""One request that fails inside an engine step fails alone, in LLM.generate, LLM.stream and
AsyncLLM: its output (or its caller) gets the error, its KV blocks are freed, and every other
request's tokens are the ones it gets without the bad request around (stories260K, seeded
sampling, which no batch changes in float32). A request whose logits overflow fails alone on
each device present."""

from __future__ import annotations

import asyncio
import random
import re
import threading

import pytest
import torch
from conftest import per_device

from fastllm import LLM, AsyncLLM, SamplingParams

# Valid parameters whose penalties overflow float32 at the second step: the bias makes token 7
# the first token, and once 7 is in the output the repetition penalty divides its logit (about
# 3e38) by 0.5, to +inf, which the sampler refuses.
OVERFLOWING = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                             logit_bias={7: 3e38}, repetition_penalty=0.5)
BAD_PROMPT = {"prompt_token_ids": [1, 40, 41, 42]}


def overflow_error(device: torch.device) -> str:
    """A regex of the error OVERFLOWING fails with: the CPU sampler raises on its row; a CUDA
    sampler, under trusted_inputs, marks the row unusable and the engine says so."""
    if device.type == "cpu":
        return r"cannot be sampled.*contains \+inf"
    return r"contain NaN or \+inf"


@pytest.fixture(scope="module")
def folder(model_path):
    return model_path("stories260K_hf")


@pytest.fixture(scope="module")
def llms(folder):
    """``llms(device)``: one LLM per device."""
    return per_device(lambda device: LLM(folder, device=device, kv_cache_memory=16 << 20))


@pytest.fixture(scope="module")
def llm(llms) -> LLM:
    return llms("cpu")


@pytest.fixture
def device_llm(llms, device) -> LLM:
    return llms(device)


def good_requests(n: int, seed: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    # Prompts of up to 30 tokens, which reach position 44 at most.
    prompts = [{"prompt_token_ids": [1] + [rng.randrange(3, 512)
                                           for _ in range(rng.randrange(2, 30))]}
               for _ in range(n)]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=seed + i, max_tokens=15,
                             ignore_eos=True) for i in range(n)]
    return prompts, params


def token_ids(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def assert_failed_alone(out, match: str) -> None:
    """``match``: a regex of the error."""
    completion = out.outputs[0]
    assert out.finished and completion.finish_reason == "error"
    assert isinstance(out.error, ValueError) and re.search(match, str(out.error)), out.error


def test_generate_fails_the_bad_request_alone(device_llm, device):
    llm = device_llm
    prompts, params = good_requests(6, seed=1)
    alone = token_ids(llm.generate(prompts, params, use_tqdm=False))
    outputs = llm.generate(prompts[:3] + [BAD_PROMPT] + prompts[3:],
                           params[:3] + [OVERFLOWING] + params[3:], use_tqdm=False)
    assert token_ids(outputs[:3] + outputs[4:]) == alone
    assert all(out.error is None and out.outputs[0].finish_reason == "length"
               for out in outputs[:3] + outputs[4:])
    bad = outputs[3]
    assert_failed_alone(bad, overflow_error(device))
    assert bad.outputs[0].token_ids == [7]  # what it had before it failed
    assert llm.kv_cache.block_manager.usage == 0


def test_a_stream_raises_its_error_while_the_batch_goes_on(device_llm, device):
    llm = device_llm
    prompts, params = good_requests(5, seed=2)
    expected = llm.generate(prompts, params, use_tqdm=False)
    results = {}
    worker = threading.Thread(target=lambda: results.update(batch=llm.generate(
        prompts[1:] + [BAD_PROMPT], params[1:] + [OVERFLOWING], use_tqdm=False)))
    worker.start()
    streamed = "".join(llm.stream(prompts[0], params[0]))  # a good stream beside the bad one
    worker.join()
    assert streamed == expected[0].outputs[0].text
    assert token_ids(results["batch"][:-1]) == token_ids(expected[1:])
    assert_failed_alone(results["batch"][-1], overflow_error(device))

    # The bad request streamed: its first token's text, then its error.
    deltas = []
    worker = threading.Thread(target=lambda: results.update(batch=llm.generate(
        prompts, params, use_tqdm=False)))
    worker.start()
    with pytest.raises(ValueError, match=overflow_error(device)):
        for delta in llm.stream(BAD_PROMPT, OVERFLOWING):
            deltas.append(delta)
    worker.join()
    assert "".join(deltas) == llm.tokenizer.decode([7])
    assert token_ids(results["batch"]) == token_ids(expected)
    assert llm.kv_cache.block_manager.usage == 0


def test_async_llm_fails_the_bad_request_alone_and_lives_on(folder, llm):
    prompts, params = good_requests(4, seed=3)
    expected = [out.outputs[0].text for out in llm.generate(prompts, params, use_tqdm=False)]

    async def collect(engine, prompt, p):
        return "".join([delta async for delta in engine.stream(prompt, p)])

    async def main():
        async with AsyncLLM(folder, kv_cache_memory=8 << 20) as engine:
            streams = [asyncio.create_task(collect(engine, p, sp))
                       for p, sp in zip(prompts, params)]
            with pytest.raises(ValueError, match="contains \\+inf"):
                await engine.generate(BAD_PROMPT, OVERFLOWING)
            with pytest.raises(ValueError, match="contains \\+inf"):
                await collect(engine, BAD_PROMPT, OVERFLOWING)
            texts = await asyncio.gather(*streams)
            after = await engine.generate(prompts[0], params[0])  # the thread still serves
            return texts, after.outputs[0].text, engine.client.kv_cache.block_manager.usage

    texts, after, usage = asyncio.run(main())
    assert texts == expected and after == expected[0] and usage == 0


def test_a_model_step_that_raises_is_rerun_request_by_request(llm, monkeypatch):
    # The model raises whenever a batch reaches position 50: only the long prompt gets there
    # (in its 6th decode step), so only it fails, keeping its first tokens.
    prompts, params = good_requests(5, seed=4)
    alone = token_ids(llm.generate(prompts, params, use_tqdm=False))
    long_prompt = {"prompt_token_ids": [1] + list(range(100, 145))}  # 46 tokens
    model = llm.model

    def forward(input_ids, step, kv_cache, lora=None):
        if int(step.positions.max()) >= 50:
            raise RuntimeError("position 50 is poisoned")
        return type(model).forward(model, input_ids, step, kv_cache, lora)

    monkeypatch.setattr(model, "forward", forward)
    params_long = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)
    outputs = llm.generate(prompts[:2] + [long_prompt] + prompts[2:],
                           params[:2] + [params_long] + params[2:], use_tqdm=False)
    monkeypatch.undo()
    assert token_ids(outputs[:2] + outputs[3:]) == alone
    failed = outputs[2]
    assert failed.outputs[0].finish_reason == "error"
    assert isinstance(failed.error, RuntimeError)
    assert "the model step failed on this request: position 50 is poisoned" in str(failed.error)
    assert len(failed.outputs[0].token_ids) == 50 - 46 + 1  # positions 46..49 fed back, + 1
    assert llm.kv_cache.block_manager.usage == 0


def test_async_llm_survives_a_failure_of_the_engine_itself(folder, monkeypatch):
    async def main():
        async with AsyncLLM(folder) as engine:
            scheduler = engine.client.engine.scheduler
            schedule = scheduler.schedule
            calls = []

            def fail_once():
                calls.append(1)
                if len(calls) == 1:
                    raise RuntimeError("scheduler bug")
                return schedule()

            monkeypatch.setattr(scheduler, "schedule", fail_once)
            params = SamplingParams(temperature=0, max_tokens=4)
            with pytest.raises(RuntimeError, match="scheduler bug"):
                await engine.generate({"prompt_token_ids": [1, 400]}, params)
            out = await engine.generate({"prompt_token_ids": [1, 400]}, params)
            return out, engine.client.kv_cache.block_manager.usage

    out, usage = asyncio.run(main())
    assert len(out.outputs[0].token_ids) == 4 and usage == 0


def test_a_row_the_gpu_sampler_marks_unusable_fails_alone(llm, monkeypatch):
    # Under trusted_inputs a CUDA sampler does not raise: it marks a row whose logits hold NaN
    # or +inf with token -1. The engine fails that request alone (here the mark is forged on
    # the CPU for the request seeded 999).
    import fastllm.engine.worker as worker_module

    prompts, params = good_requests(4, seed=5)
    alone = token_ids(llm.generate(prompts, params, use_tqdm=False))
    real_draw = worker_module.draw

    def draw(logits, tensors):
        out = real_draw(logits, tensors)
        out.tokens[tensors.seeds == 999] = -1
        return out

    monkeypatch.setattr(worker_module, "draw", draw)
    marked = SamplingParams(temperature=0.8, seed=999, max_tokens=15)
    outputs = llm.generate(prompts[:1] + [BAD_PROMPT] + prompts[1:],
                           params[:1] + [marked] + params[1:], use_tqdm=False)
    monkeypatch.undo()
    assert token_ids(outputs[:1] + outputs[2:]) == alone
    assert_failed_alone(outputs[1], r"contain NaN or \+inf")
    assert outputs[1].outputs[0].token_ids == []
    assert llm.kv_cache.block_manager.usage == 0
