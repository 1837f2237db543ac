"""An engine step moves its host data to the device in one copy (the model's inputs, the
sampler's per-request parameters and offsets) and reads its samples back in one, on the real
stories260K weights: with and without the CUDA-graph path's packed static inputs (on the CPU that
path runs eagerly), with sampling parameters that differ per request, and while verifying
speculative drafts. ``fastllm.ops.host_to_device.transfers`` counts the copies.
"""

from __future__ import annotations

import pytest

from fastllm import LLM, SamplingParams
from fastllm.engine.decode_graphs import DecodeGraphs
from fastllm.ops.host_to_device import transfers

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def folder(model_path):
    return model_path("stories260K_hf")


def prompts() -> list[dict]:
    return [{"prompt_token_ids": [1, *range(40 + 7 * i, 40 + 7 * i + n)]}
            for i, n in enumerate((3, 17, 8, 30))]


def mixed_params() -> list[SamplingParams]:
    """Each request samples differently: greedy, nucleus, penalties with a logit bias and
    logprobs, top-k with min-p."""
    common = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [SamplingParams(temperature=0, **common),
            SamplingParams(temperature=0.8, top_p=0.9, seed=1, **common),
            SamplingParams(temperature=1.2, seed=2, repetition_penalty=1.3, presence_penalty=0.5,
                           frequency_penalty=0.3, logit_bias={7: 2.0, 300: -1.5}, logprobs=3,
                           **common),
            SamplingParams(temperature=0.5, top_k=20, min_p=0.05, seed=3, **common)]


def counted_steps(llm: LLM, monkeypatch, prompts: list, params: list[SamplingParams]
                  ) -> tuple[list[list[int]], list[dict]]:
    """The outputs of ``prompts`` with ``params``, and each engine step's batch kind and
    copies."""
    engine = llm.engine
    steps: list[dict] = []
    runner = engine.executor.worker.runner
    execute, step = runner.execute, engine.step

    def recording_execute(batch, *args):
        steps[-1]["decode"] = batch.is_decode
        steps[-1]["drafts"] = sum(s.num_draft_tokens for s in batch.sequences)
        return execute(batch, *args)

    def counting_step():
        before = (transfers.host_to_device, transfers.device_to_host)
        steps.append({"decode": False, "drafts": 0})
        updated = step()
        steps[-1]["copies"] = (transfers.host_to_device - before[0],
                               transfers.device_to_host - before[1])
        return updated

    monkeypatch.setattr(runner, "execute", recording_execute)
    monkeypatch.setattr(engine, "step", counting_step)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs], steps


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_decode_step_makes_one_copy_each_way(folder, device, monkeypatch, graphs):
    llm = LLM(folder, device=device, max_num_seqs=4, kv_cache_memory=4 << 20,
              enforce_eager=not graphs)
    runner = llm.engine.executor.worker.runner
    if graphs and runner.decode_graphs is None:  # off CUDA: the same padded step, eagerly
        runner.decode_graphs = DecodeGraphs(llm.model, llm.kv_cache, max_batch=4,
                                            max_model_len=llm.max_model_len,
                                            use_cuda_graphs=False)
    assert (runner.decode_graphs is not None) == graphs
    replays = []
    if graphs:
        run = runner.decode_graphs.run
        monkeypatch.setattr(runner.decode_graphs, "run",
                            lambda *args: replays.append(args) or run(*args))
    tokens, steps = counted_steps(llm, monkeypatch, prompts(), mixed_params())
    assert all(len(t) == MAX_TOKENS for t in tokens)
    decode = [s for s in steps if s["decode"]]
    assert len(decode) >= MAX_TOKENS - 1
    assert len(replays) == (len(decode) if graphs else 0)
    for i, s in enumerate(steps):
        assert s["copies"] == (1, 1), f"step {i} ({'decode' if s['decode'] else 'prefill'}) " \
                                      f"made {s['copies']} host-to-device, device-to-host copies"


def test_the_graph_path_samples_the_same_tokens(folder):
    outputs = []
    for graphs in (False, True):
        llm = LLM(folder, max_num_seqs=4, kv_cache_memory=4 << 20)
        if graphs:
            llm.engine.executor.worker.runner.decode_graphs = DecodeGraphs(
                llm.model, llm.kv_cache, max_batch=4, max_model_len=llm.max_model_len,
                use_cuda_graphs=False)
        outputs.append(llm.generate(prompts(), mixed_params(), use_tqdm=False))
    for eager, graphed in zip(*outputs):
        assert graphed.outputs[0].token_ids == eager.outputs[0].token_ids
        assert graphed.outputs[0].logprobs == eager.outputs[0].logprobs


def test_a_verification_step_makes_one_copy_each_way(folder, device, monkeypatch):
    llm = LLM(folder, device=device, max_num_seqs=4, kv_cache_memory=4 << 20,
              speculative={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    repeating = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs) for kwargs in
                 (dict(temperature=0), dict(temperature=0.7, seed=5, frequency_penalty=0.4))]
    engine = llm.engine
    # Texts that repeat themselves: the n-gram proposer finds drafts in them.
    story = "Once upon a time, there was a little girl named Lily. She liked to play outside. "
    texts = [story * 2, "The cat sat on the mat. The cat sat on the"]
    tokens, steps = counted_steps(llm, monkeypatch, texts * 2, repeating + repeating[::-1])
    assert all(len(t) == MAX_TOKENS for t in tokens)
    assert any(s["drafts"] for s in steps), "no step verified drafts"
    assert engine.stats.num_draft_tokens > 0
    for i, s in enumerate(steps):
        assert s["copies"] == (1, 1), f"step {i} ({s['drafts']} drafts) made {s['copies']} " \
                                      f"host-to-device, device-to-host copies"
