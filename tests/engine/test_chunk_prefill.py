"""KV reuse at the model level, on the real stories260K weights against HF transformers.

- pre-RoPE caches give the same logits and greedy tokens as post-RoPE ones (prefill, decode);
- a prompt whose prefix blocks come from the prefix cache gives the logits of a recompute;
- chunked prompts through ``LLM.generate`` equal an independent reference of block attention
  built from HF transformers (each prefix + chunk run causally, the chunk's K/V re-rotated from
  the positions it was encoded at to those it occupies, then the suffix and the greedy
  continuation run over that cache), whether the chunks are encoded now or come from the store,
  in any order and at any offset, alone or batched with ordinary prompts, with chunked prefill
  and preemption; with a single chunk it is plain causal prefill.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache

from fastllm import LLM, ChunkedPrompt, SamplingParams
from fastllm.engine.model_runner import ModelRunner
from fastllm.kv_cache import ChunkIndex, PagedKVCache
from fastllm.models import DecoderLM, load_model

ATOL = 1e-4  # float32 logits of a 5-layer model, fastllm vs HF


@pytest.fixture(scope="module")
def stories(model_path) -> tuple[transformers.PreTrainedModel, DecoderLM]:
    path = model_path("stories260K_hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, load_model(path)


def make_cache(model: DecoderLM, *, pre_rope: bool, num_blocks: int = 96,
               block_size: int = 8) -> PagedKVCache:
    return PagedKVCache(model.kv_cache_spec(block_size), num_blocks, pre_rope=pre_rope)


def tokens(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=generator).tolist()


def greedy(model: DecoderLM, cache: PagedKVCache, seq_id: int, prompt: list[int],
           steps: int) -> tuple[list[int], torch.Tensor]:
    """Prefill then greedy decode; returns the tokens and the prefill's last logits."""
    runner = ModelRunner(model, cache)
    cached = cache.block_manager.allocate(seq_id, prompt)
    first = runner.execute_placed_sequences([seq_id], [prompt[cached:]]).logits[0]
    out, logits = [], first
    for _ in range(steps):
        out.append(int(logits.argmax()))
        cache.copy_blocks(cache.block_manager.append_tokens(seq_id, [out[-1]]))
        logits = runner.execute_placed_sequences([seq_id], [[out[-1]]]).logits[0]
    return out, first


@torch.no_grad()
def test_pre_rope_cache_equals_post_rope(stories):
    hf, model = stories
    prompt = [1, *tokens(40, 0)]
    post_tokens, post_logits = greedy(model, make_cache(model, pre_rope=False), 0, prompt, 24)
    pre_tokens, pre_logits = greedy(model, make_cache(model, pre_rope=True), 0, prompt, 24)
    assert pre_tokens == post_tokens
    torch.testing.assert_close(pre_logits, post_logits, atol=1e-5, rtol=1e-5)
    hf_logits = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(pre_logits, hf_logits, atol=ATOL, rtol=ATOL)


@torch.no_grad()
@pytest.mark.parametrize("pre_rope", [False, True])
def test_prefix_reuse_equals_recompute(stories, pre_rope):
    _, model = stories
    system = [1, *tokens(37, 1)]  # 4 full blocks of 8 and a partial one
    cache = make_cache(model, pre_rope=pre_rope)
    greedy(model, cache, 0, [*system, *tokens(5, 2)], 0)
    cache.block_manager.free(0)
    question = [*system, *tokens(11, 3)]
    reused_tokens, reused = greedy(model, cache, 1, question, 16)
    assert cache.block_manager.stats()["hits"] == 4
    fresh_tokens, fresh = greedy(model, make_cache(model, pre_rope=pre_rope), 0, question, 16)
    assert reused_tokens == fresh_tokens
    torch.testing.assert_close(reused, fresh, atol=1e-5, rtol=1e-5)


def rotate_keys(hf: transformers.PreTrainedModel, keys: torch.Tensor, shift: int) -> torch.Tensor:
    """HF post-RoPE keys ``[1, kv_heads, n, head_dim]`` moved ``shift`` positions later: RoPE
    rotations compose, so rotating by the shift's angle re-encodes them at their new positions."""
    cos, sin = hf.model.rotary_emb(keys, torch.tensor([[shift]]))  # [1, 1, head_dim]
    half = keys.shape[-1] // 2
    rotated_half = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)
    return keys * cos[:, None] + rotated_half * sin[:, None]


@torch.no_grad()
def hf_block_attention(hf: transformers.PreTrainedModel, prompt: ChunkedPrompt,
                       steps: int = 0) -> tuple[torch.Tensor, list[int]]:
    """The reference: the suffix's last logits over [prefix][chunks] K/V built chunk by chunk
    with HF transformers, and ``steps`` greedy tokens decoded after it over the same cache."""
    prefix = list(prompt.prefix)
    layers = hf.config.num_hidden_layers
    keys = [[] for _ in range(layers)]
    values = [[] for _ in range(layers)]
    offset = len(prefix)
    for i, chunk in enumerate(prompt.chunks):
        cache = hf(torch.tensor([prefix + list(chunk)]), use_cache=True).past_key_values
        for layer, (k, v, _) in enumerate(cache):
            if i == 0:  # the prefix's K/V, causal
                keys[layer].append(k[:, :, :len(prefix)])
                values[layer].append(v[:, :, :len(prefix)])
            keys[layer].append(rotate_keys(hf, k[:, :, len(prefix):], offset - len(prefix)))
            values[layer].append(v[:, :, len(prefix):])
        offset += len(chunk)
    cache = DynamicCache(ddp_cache_data=[(torch.cat(k, 2), torch.cat(v, 2))
                                         for k, v in zip(keys, values)])
    new = torch.tensor([list(prompt.suffix)])
    first = None
    out: list[int] = []
    for _ in range(steps + 1):
        positions = torch.arange(offset, offset + new.shape[1])[None]
        logits = hf(new, position_ids=positions, past_key_values=cache).logits[0, -1]
        first = logits if first is None else first
        offset += new.shape[1]
        out.append(int(logits.argmax()))
        new = torch.tensor([[out[-1]]])
    return first, out[:steps]


def chunked_llm(model_path, **kwargs) -> LLM:
    kwargs = {"block_size": 8, "chunk_store_memory": 2**24, **kwargs}
    return LLM(model_path("stories260K_hf"), **kwargs)


def first_logprobs(output, hf_logits: torch.Tensor) -> None:
    """The output's first-token logprobs (top 5) equal HF's log-softmax of ``hf_logits``."""
    expected = torch.log_softmax(hf_logits, -1)
    entry = output.outputs[0].logprobs[0]
    got = torch.tensor([lp.logprob for lp in entry.values()])
    torch.testing.assert_close(got, expected[list(entry)], atol=ATOL, rtol=ATOL)


GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=5)


def test_independent_chunks_equal_the_block_attention_reference(stories, model_path):
    hf, _ = stories
    llm = chunked_llm(model_path)
    store = llm.engine.scheduler.chunk_index
    prefix = [1, *tokens(13, 10)]
    docs = [tokens(n, 11 + n) for n in (9, 16, 5)]
    first = ChunkedPrompt(prefix, docs, tokens(6, 20))
    [got] = llm.generate([first], GREEDY, use_tqdm=False)
    hf_logits, hf_tokens = hf_block_attention(hf, first, steps=8)
    first_logprobs(got, hf_logits)
    assert got.outputs[0].token_ids == hf_tokens
    assert (store.hits, store.misses, len(store)) == (0, 3, 3)
    assert len(llm.engine.executor.worker.chunks) == 3  # the worker holds what the index lists

    # The same documents in another order, one twice, after another question: every chunk comes
    # from the store and lands at a new offset; decoding goes on like any sequence.
    second = ChunkedPrompt(prefix, [docs[2], docs[0], docs[2], docs[1]], tokens(4, 21))
    [got] = llm.generate([second], GREEDY, use_tqdm=False)
    assert (store.hits, store.misses) == (3, 3)
    hf_logits, hf_tokens = hf_block_attention(hf, second, steps=8)
    first_logprobs(got, hf_logits)
    assert got.outputs[0].token_ids == hf_tokens
    assert llm.kv_cache.block_manager.usage == 0


def test_chunked_prompts_batched_with_ordinary_ones(stories, model_path):
    """Chunked and ordinary prompts in one continuous batch, with chunked prefill and a pool
    small enough to preempt: each equals its reference (HF block attention, or the prompt run
    alone)."""
    hf, _ = stories
    prefix = [1, *tokens(11, 50)]
    docs = [tokens(n, 51 + n) for n in (12, 7, 20)]
    chunked = [ChunkedPrompt(prefix, [docs[0], docs[1]], tokens(5, 60)),
               ChunkedPrompt(prefix, [docs[2], docs[0]], tokens(3, 61)),
               ChunkedPrompt([1, *tokens(4, 62)], [docs[1]], tokens(2, 63))]
    ordinary = [[1, *tokens(n, 70 + n)] for n in (30, 3, 17)]
    prompts = [chunked[0], ordinary[0], chunked[1], ordinary[1], chunked[2], ordinary[2]]
    alone = chunked_llm(model_path)
    expected_ordinary = [alone.generate([p], GREEDY, use_tqdm=False)[0] for p in ordinary]
    llm = chunked_llm(model_path, max_num_batched_tokens=24, kv_cache_memory=24 * 8 * 1280,
                      max_model_len=128)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.stats.preemptions > 0  # the pool of 24 blocks cannot hold them all
    for prompt, output in zip(prompts, outputs):
        if isinstance(prompt, ChunkedPrompt):
            hf_logits, hf_tokens = hf_block_attention(hf, prompt, steps=8)
            first_logprobs(output, hf_logits)
            assert output.outputs[0].token_ids == hf_tokens
        else:
            assert output.outputs[0].token_ids == \
                expected_ordinary[ordinary.index(prompt)].outputs[0].token_ids
    assert llm.kv_cache.block_manager.usage == 0


def test_one_chunk_is_causal_prefill(stories, model_path):
    hf, _ = stories
    prompt = ChunkedPrompt([1, *tokens(10, 30)], [tokens(20, 31)], tokens(3, 32))
    [got] = chunked_llm(model_path).generate([prompt], GREEDY, use_tqdm=False)
    first_logprobs(got, hf(torch.tensor([prompt.token_ids])).logits[0, -1])


def test_chunk_kv_never_enters_the_prefix_cache(stories, model_path):
    # A causal request with the same tokens as a chunked one must not reuse its chunk blocks.
    hf, _ = stories
    llm = chunked_llm(model_path)
    prompt = ChunkedPrompt([1, *tokens(15, 40)], [tokens(16, 41), tokens(16, 42)], [7])
    llm.generate([prompt], GREEDY, use_tqdm=False)
    hits = llm.engine.stats.prefix_cache_hits
    [causal] = llm.generate([prompt.token_ids], GREEDY, use_tqdm=False)
    assert llm.engine.stats.prefix_cache_hits - hits == 2  # the 16 prefix tokens only
    first_logprobs(causal, hf(torch.tensor([prompt.token_ids])).logits[0, -1])


def test_the_index_bound_pins_and_drops(model_path):
    index = ChunkIndex(max_bytes=3000, bytes_per_token=128)  # 1280 bytes a 10-token chunk
    chunk = tuple(range(10))
    big = index.reserve((1,), tuple(range(30)))  # 3840 bytes: past the bound while pinned
    index.commit(big)
    assert index.nbytes == 3840 and index.take_drops() == []
    index.release(big)  # unpinned past the bound: evicted, never found
    assert index.take_drops() == [big] and index.nbytes == 0
    assert index.find((1,), tuple(range(30))) is None
    first = index.reserve((1,), chunk)
    assert index.find((1,), chunk) is None  # not saved yet
    index.commit(first)
    index.release(first)
    second = index.reserve((2,), chunk)
    index.commit(second)
    index.release(second)
    assert index.find((1,), chunk) == first  # pinned again, and now the most recent
    index.release(first)
    third = index.reserve((3,), chunk)  # 3840 > 3000: the least recent unpinned goes
    assert index.take_drops() == [second] and index.find((2,), chunk) is None
    # Encoded twice at once: making room evicts the next least recent; the second copy serves
    # its own pins only, then goes.
    duplicate = index.reserve((3,), chunk)
    assert index.take_drops() == [first]
    index.commit(third)
    index.commit(duplicate)
    index.release(duplicate)
    assert index.take_drops() == [duplicate]
    index.release(third)
    assert (index.hits, len(index), index.nbytes) == (1, 1, 1280)
    assert index.find((3,), chunk) == third
    with pytest.raises(ValueError, match="max_bytes"):
        ChunkIndex(max_bytes=-1, bytes_per_token=128)


def test_a_store_of_no_bytes_encodes_every_time(model_path):
    """chunk_store_memory=0: each chunk is encoded, used by its request, then dropped on the
    workers too (the idle step tells them)."""
    llm = chunked_llm(model_path, chunk_store_memory=0)
    prompt = ChunkedPrompt([1, *tokens(5, 80)], [tokens(7, 81), tokens(9, 82)], tokens(3, 83))
    outputs = [llm.generate([prompt], GREEDY, use_tqdm=False)[0] for _ in range(2)]
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
    index = llm.engine.scheduler.chunk_index
    assert (index.hits, index.misses, len(index)) == (0, 4, 0)
    assert len(llm.engine.executor.worker.chunks) == 0


def test_errors(model_path):
    with pytest.raises(ValueError, match="non-empty suffix"):
        ChunkedPrompt([1], [[2]], [])
    with pytest.raises(ValueError, match="chunk 1 is empty"):
        ChunkedPrompt([1], [[2], []], [3])
    plain = LLM(model_path("stories260K_hf"))
    with pytest.raises(ValueError, match="chunk_store_memory"):
        plain.generate([ChunkedPrompt([1], [[2]], [3])], use_tqdm=False)
    with pytest.raises(ValueError, match="chunk_store_memory"):
        LLM(model_path("stories260K_hf"), chunk_store_memory=-1)


def test_two_ranks_serve_chunked_prompts(model_path):
    """Every rank loads, saves and forgets its heads' chunk encodings as the steps say: two
    ranks give one process's greedy tokens, chunks encoded and then found in the store."""
    prefix = [1, *tokens(9, 90)]
    docs = [tokens(n, 91 + n) for n in (6, 13)]
    prompts = [ChunkedPrompt(prefix, docs, tokens(4, 95)),
               ChunkedPrompt(prefix, docs[::-1], tokens(3, 96)), [1, *tokens(12, 97)]]
    expected = [out.outputs[0].token_ids for out in
                chunked_llm(model_path).generate(prompts, GREEDY, use_tqdm=False)]
    llm = chunked_llm(model_path, tensor_parallel_size=2)
    index = llm.engine.scheduler.chunk_index
    try:
        for round_hits in (0, 4):  # the second time, every chunk comes from the ranks' stores
            misses = index.misses
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
            assert [out.outputs[0].token_ids for out in outputs] == expected
            assert index.hits == round_hits and (index.misses > misses) == (round_hits == 0)
    finally:
        llm.shutdown()
