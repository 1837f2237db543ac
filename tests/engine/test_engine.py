"""The engine through fastllm.LLM / fastllm.AsyncLLM on stories260K: batched outputs equal each
prompt run alone, seeded sampling ignores batch composition and arrival order, chunked prefill
equals one-shot prefill, preemption loses nothing, cancellation frees blocks at once, and one bad
request fails alone. The tests of what the model computes run on each device present."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from conftest import per_device

from fastllm import LLM, AsyncLLM, SamplingParams
from fastllm.entrypoints.client import EngineClient

NUM_PROMPTS = 32


@pytest.fixture(scope="module")
def folder(model_path):
    return model_path("stories260K_hf")


@pytest.fixture(scope="module")
def llms(folder):
    """``llms(device)``: an LLM on ``device`` (one per device) with room for every test's
    requests at once: no preemption unless a test asks for it."""
    return per_device(lambda device: LLM(folder, device=device, kv_cache_memory=32 << 20))


@pytest.fixture(scope="module")
def llm(llms) -> LLM:
    return llms("cpu")


@pytest.fixture
def device_llm(llms, device) -> LLM:
    return llms(device)


def mixed_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(rng.randrange(0, 120))]
            for _ in range(n)]


def mixed_params(n: int, seed: int, **kwargs) -> list[SamplingParams]:
    rng = random.Random(seed)
    return [SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=True, **kwargs)
            for _ in range(n)]


def token_ids(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def test_a_batch_of_32_greedy_prompts_equals_each_alone(device_llm):
    llm = device_llm
    prompts = mixed_prompts(NUM_PROMPTS, seed=0)
    params = mixed_params(NUM_PROMPTS, seed=1, temperature=0)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.stats.steps < sum(p.max_tokens for p in params)  # it did batch
    for prompt, p, out in zip(prompts, params, batched):
        alone, = llm.generate({"prompt_token_ids": prompt}, p, use_tqdm=False)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == p.max_tokens
        assert out.prompt_token_ids == prompt


def test_seeded_sampling_ignores_batch_composition_and_order(device_llm):
    llm = device_llm
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(12, seed=2)]
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=30,
                             ignore_eos=True) for i in range(12)]
    together = token_ids(llm.generate(prompts, params, use_tqdm=False))
    order = list(range(12))
    random.Random(3).shuffle(order)
    shuffled = token_ids(llm.generate([prompts[i] for i in order], [params[i] for i in order],
                                      use_tqdm=False))
    assert [shuffled[order.index(i)] for i in range(12)] == together
    for i in (0, 5, 11):  # alone, and beside other neighbours
        assert token_ids(llm.generate(prompts[i], params[i], use_tqdm=False))[0] == together[i]
    subset = token_ids(llm.generate(prompts[3:7], params[3:7], use_tqdm=False))
    assert subset == together[3:7]


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_one_shot(folder, device_llm, chunk):
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(6, seed=4)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    one_shot = device_llm.generate(prompts, params, use_tqdm=False)
    chunked_llm = LLM(folder, device=device_llm.device, kv_cache_memory=8 << 20,
                      max_prefill_chunk=chunk,
                      max_num_batched_tokens=max(chunk, 16), enable_prefix_caching=False)
    chunked = chunked_llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(chunked) == token_ids(one_shot)
    for a, b in zip(chunked, one_shot):
        for entry_a, entry_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert list(entry_a) == list(entry_b)
            for token in entry_a:
                assert entry_a[token].logprob == pytest.approx(entry_b[token].logprob, abs=1e-4)
    assert chunked_llm.engine.stats.steps > len(prompts)


def test_a_small_pool_preempts_and_every_request_completes_unchanged(folder, device_llm):
    llm = device_llm
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(10, seed=5)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=60, ignore_eos=True)
              for i in range(10)]
    expected = token_ids(llm.generate(prompts, params, use_tqdm=False))
    # 16 blocks of 16 tokens: room for about 2 requests
    small = LLM(folder, device=llm.device, max_model_len=256,
                kv_cache_memory=16 * llm.kv_cache.spec.bytes_per_block)
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.stats.preemptions > 0
    assert sum(out.metrics.num_preemptions for out in outputs) == small.engine.stats.preemptions
    assert token_ids(outputs) == expected
    assert all(out.outputs[0].finish_reason == "length" for out in outputs)
    assert small.kv_cache.block_manager.usage == 0


def test_cancelling_a_request_frees_its_blocks_at_once(llm):
    manager = llm.kv_cache.block_manager
    prompt = {"prompt_token_ids": mixed_prompts(1, seed=6)[0]}
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    other, = llm.client.make_requests([prompt], params)
    doomed, = llm.client.make_requests([prompt], params)
    llm.client.add([other, doomed])
    for _ in range(5):
        llm.engine.step()
    held = manager.num_free_blocks
    llm.engine.abort_request(doomed)
    assert manager.num_free_blocks > held and doomed.finish_reason == "abort"
    llm.engine.step()
    running = llm.engine.scheduler.running
    assert other in running and doomed not in running
    llm.client.abort_unfinished([other])
    assert manager.usage == 0


def test_a_prompt_longer_than_the_context_fails_alone(folder, llm):
    too_long = {"prompt_token_ids": [1] * 600}
    with pytest.raises(ValueError, match="600 tokens, which leaves no room"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}, too_long], use_tqdm=False)

    async def main():
        async with AsyncLLM(folder) as engine:
            good = asyncio.create_task(engine.generate(
                {"prompt_token_ids": [1, 400]}, SamplingParams(temperature=0, max_tokens=5)))
            with pytest.raises(ValueError, match="600 tokens"):
                await engine.generate(too_long)
            return await good

    out = asyncio.run(main())
    assert len(out.outputs[0].token_ids) == 5


def test_async_llm_builds_its_engine_on_the_engine_thread(folder, monkeypatch):
    """All the engine's parallel CPU work on one thread: a second OpenMP team on the same
    cores (the caller's, had it loaded the model) makes every step's barriers sleep."""
    built_on = []
    original = EngineClient.__init__

    def record(self, *args, **kwargs):
        built_on.append(threading.current_thread())
        original(self, *args, **kwargs)

    monkeypatch.setattr(EngineClient, "__init__", record)

    async def main():
        async with AsyncLLM(folder) as engine:
            out = await engine.generate({"prompt_token_ids": [1, 400]},
                                        SamplingParams(temperature=0, max_tokens=3))
            return engine._thread, out

    thread, out = asyncio.run(main())
    assert built_on == [thread] and len(out.outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="max_model_len"):  # raised in the caller
        AsyncLLM(folder, max_model_len=-1)


def test_async_streams_run_together_and_equal_generate(folder, device_llm):
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(6, seed=7)]
    params = SamplingParams(temperature=0, max_tokens=25)
    expected = [out.outputs[0].text
                for out in device_llm.generate(prompts, params, use_tqdm=False)]

    async def collect(engine, prompt):
        return "".join([delta async for delta in engine.stream(prompt, params)])

    async def main():
        async with AsyncLLM(folder, device=device_llm.device, kv_cache_memory=8 << 20) as engine:
            texts = await asyncio.gather(*(collect(engine, p) for p in prompts))
            return texts, engine.client.engine.stats.steps

    texts, steps = asyncio.run(main())
    assert texts == expected
    assert steps < 6 * 25  # the six streams shared steps


def test_async_cancellation_frees_the_blocks(folder):
    async def main():
        async with AsyncLLM(folder) as engine:
            manager = engine.client.kv_cache.block_manager
            params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            task = asyncio.create_task(engine.generate({"prompt_token_ids": [1] * 100}, params))
            while manager.usage == 0:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # Freed at once, or before the next step when one was running: within a step.
            for _ in range(100):
                if manager.usage == 0:
                    break
                await asyncio.sleep(0.01)
            return manager.usage, engine.client.engine.num_running

    assert asyncio.run(main()) == (0, 0)


def test_stream_runs_while_another_thread_generates(llm):
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(8, seed=8)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = llm.generate(prompts, params, use_tqdm=False)
    results = {}
    worker = threading.Thread(target=lambda: results.update(
        batch=llm.generate(prompts[1:], params, use_tqdm=False)))
    worker.start()
    streamed = "".join(llm.stream(prompts[0], params))
    worker.join()
    assert streamed == expected[0].outputs[0].text
    assert token_ids(results["batch"]) == token_ids(expected[1:])


def test_metrics_and_prefix_cache_hits(device_llm):
    llm = device_llm
    system = [1] + list(range(10, 74))  # a shared 65-token "system prompt": 4 full blocks
    prompts = [{"prompt_token_ids": system + [100 + i, 200 + i]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=5)
    first, = llm.generate(prompts[0], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    assert first.metrics.num_cached_tokens in (0, 64)
    assert all(out.num_cached_tokens == 64 for out in rest)
    for out in rest:
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
        assert m.first_token_time <= m.last_token_time <= m.finished_time
        assert m.ttft > 0 and m.queue_time >= 0 and m.time_per_output_token > 0
        assert m.num_generated_tokens == 5 and m.num_prompt_tokens == 67
        assert 0 < m.kv_usage <= 1
    stats = llm.engine.stats
    assert 0 < stats.prefix_cache_hit_rate <= 1 and 0 < stats.peak_kv_usage <= 1
    assert 0 < llm.client.output_processor.process_s < stats.step_s


def test_progress_bar_can_be_shown(llm, capsys):
    llm.generate([[1, 2], [1, 3]], SamplingParams(max_tokens=2), use_tqdm=True)
    assert "Generating" in capsys.readouterr().err


def test_bad_engine_limits_raise(folder):
    with pytest.raises(ValueError, match="max_num_seqs must be an int >= 1, got 0"):
        LLM(folder, max_num_seqs=0)
    with pytest.raises(ValueError, match="max_prefill_chunk must be None or an int >= 1"):
        LLM(folder, max_prefill_chunk=0)
