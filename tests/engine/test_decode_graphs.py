"""Decode steps through fastllm.engine.decode_graphs equal plain ones, on the real stories260K
weights.

On CUDA the steps replay captured CUDA graphs; on the CPU the same padded static-buffer step
runs eagerly, so the padding (sequences without keys or cache slots) is checked everywhere.
"""

from __future__ import annotations

import pytest
import torch

from fastllm import LLM, SamplingParams
from fastllm.engine.decode_graphs import DecodeGraphs, padded_batch_sizes
from fastllm.kv_cache import PagedKVCache
from fastllm.engine.model_runner import ModelRunner, step_tensors
from fastllm.engine.scheduler_output import batch_of_sequences
from fastllm.models import load_model

BLOCK_SIZE = 8
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def stories_path(model_path):
    return model_path("stories260K_hf")


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [[1, *torch.randint(3, 512, (n,), generator=generator).tolist()]
            for n in (3, 17, 8, 30, 1)]


def test_padded_batch_sizes():
    assert padded_batch_sizes(1) == [1]
    assert padded_batch_sizes(5) == [1, 2, 4, 5]
    assert padded_batch_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert padded_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    with pytest.raises(ValueError, match="max_batch must be >= 1, got 0"):
        padded_batch_sizes(0)


@torch.no_grad()
def test_decode_steps_equal_plain_steps(stories_path, device):
    model = load_model(stories_path, device=device)
    caches = [PagedKVCache(model.kv_cache_spec(BLOCK_SIZE), 64, device=device) for _ in range(2)]
    graphs = DecodeGraphs(model, caches[1], max_batch=5, max_model_len=MAX_MODEL_LEN)
    assert graphs.use_cuda_graphs == (device.type == "cuda")
    runners = [ModelRunner(model, caches[0]), ModelRunner(model, caches[1], graphs)]
    seqs = prompts()
    for cache, runner in zip(caches, runners):  # prefill runs eagerly on both
        for seq_id, prompt in enumerate(seqs):
            cache.block_manager.allocate(seq_id, prompt)
        last = runner.execute_placed_sequences(list(range(len(seqs))), seqs).logits  # [5, vocab]
    # Batches of 5, 3, 1, 2 and 5 again: padded to 5, 4, 1, 2, 5 (a size replayed twice).
    for step, rows in enumerate([[0, 1, 2, 3, 4], [4, 0, 2], [3], [1, 4], [0, 1, 2, 3, 4]]):
        tokens = [int(last[row].argmax()) for row in rows]
        outputs = []
        for cache, runner in zip(caches, runners):
            for row, token in zip(rows, tokens):
                cache.copy_blocks(cache.block_manager.append_tokens(row, [token]))
            outputs.append(runner.execute_placed_sequences(rows, [[t] for t in tokens]).logits)
        plain, graphed = outputs
        torch.testing.assert_close(graphed, plain, atol=1e-5, rtol=1e-5,
                                   msg=f"step {step}, rows {rows}")
        last[rows] = plain
    for k_plain, k_graph in zip(caches[0].k_cache, caches[1].k_cache):
        torch.testing.assert_close(k_graph, k_plain, atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_steps_that_are_not_plain_decode_run_eagerly(stories_path):
    model = load_model(stories_path)
    cache = PagedKVCache(model.kv_cache_spec(BLOCK_SIZE), 64)
    graphs = DecodeGraphs(model, cache, max_batch=2, max_model_len=MAX_MODEL_LEN,
                          use_cuda_graphs=False)
    seqs = prompts()[:3]
    for seq_id, prompt in enumerate(seqs):
        cache.block_manager.allocate(seq_id, prompt)
    # A prefill (several tokens), more sequences than captured, some rows without logits:
    # all run eagerly and give what a runner gives without graphs.
    runner = ModelRunner(model, cache, graphs)
    logits = runner.execute_placed_sequences([0, 1, 2], seqs, logits=[True, False, True]).logits
    assert logits.shape == (2, model.config.vocab_size)
    for seq_id in range(3):
        cache.copy_blocks(cache.block_manager.append_tokens(seq_id, [5]))
    assert runner.execute_placed_sequences([0, 1, 2], [[5]] * 3).logits.shape[0] == 3
    batch = batch_of_sequences(cache.block_manager, [0, 1], [[5, 5], [5]], starts=[0, 3])
    with pytest.raises(ValueError, match="one new token per sequence, got 3 tokens for 2"):
        graphs.pack([5, 5, 5], step_tensors(batch))


def test_cuda_graphs_need_a_cuda_device(stories_path):
    model = load_model(stories_path)
    cache = PagedKVCache(model.kv_cache_spec(BLOCK_SIZE), 16)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, the KV cache is on cpu"):
        DecodeGraphs(model, cache, max_batch=2, max_model_len=64, use_cuda_graphs=True)


def test_llm_generates_the_same_with_and_without_graphs(stories_path, device):
    greedy = SamplingParams(max_tokens=24, temperature=0)
    outputs = []
    for enforce_eager in (True, False):
        llm = LLM(stories_path, device=device, max_num_seqs=4, enforce_eager=enforce_eager)
        assert (llm.engine.executor.worker.runner.decode_graphs is not None) == (device.type == "cuda"
                                                         and not enforce_eager)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts(), greedy)])
    assert outputs[0] == outputs[1]
