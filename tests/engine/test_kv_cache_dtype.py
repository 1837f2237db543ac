"""``kv_cache_dtype``: a float32 model keeping its K/V in float16 or bfloat16 (stories260K).

A narrower cache rounds K/V once, as they are written, and attention always reads them back from
the cache, so a sequence's result still does not depend on the batch, chunking or prefix hits;
it stays close to the float32 cache's; and the pool holds twice the tokens per byte.
"""

from __future__ import annotations

import random

import pytest
import torch

from fastllm import LLM, SamplingParams
from fastllm.engine import EngineConfig

CHUNK = 7


@pytest.fixture(scope="module")
def folder(model_path):
    return model_path("stories260K_hf")


@pytest.fixture(scope="module")
def f32_cache(folder) -> LLM:
    return LLM(folder, kv_cache_memory=8 << 20)


@pytest.fixture(scope="module")
def f16_cache(folder) -> LLM:
    return LLM(folder, kv_cache_memory=8 << 20, kv_cache_dtype="float16")


def prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [1] + [rng.randrange(3, 512)
                                        for _ in range(rng.randrange(20, 90))]}
            for _ in range(n)]


def first_logprobs(outputs) -> torch.Tensor:
    """[prompts, 4]: the 4 highest logprobs at each prompt's last position (of the first
    generated token), highest first."""
    return torch.tensor([sorted((entry.logprob for entry in out.outputs[0].logprobs[0].values()),
                                reverse=True) for out in outputs])


def test_the_cache_stores_the_dtype_and_twice_the_tokens(f32_cache, f16_cache):
    assert f16_cache.model is f32_cache.model  # one pooled float32 model
    assert f16_cache.kv_cache.k_cache.dtype == torch.float16
    f16_spec, f32_spec = f16_cache.kv_cache.spec, f32_cache.kv_cache.spec
    assert f16_spec.bytes_per_token * 2 == f32_spec.bytes_per_token
    assert f16_cache.kv_cache.num_blocks // 2 == f32_cache.kv_cache.num_blocks  # same 8 MiB


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_results_do_not_depend_on_batch_chunks_or_prefix_hits(folder, kv_cache_dtype):
    # The same prompts batched, alone (from the prefix cache) and prefilled in chunks of 7: the
    # same greedy tokens, and the prompt's last logprobs within 5e-4. Keys from this step and
    # from the cache are read alike, as stored; what remains is float32 noise between batch
    # shapes flipping the rounding of a few K/V values (up to 1.3e-4 here). Attending to the
    # step's own float32 K/V instead moves them by 2e-3 (float16) to 4e-2 (bfloat16).
    batch = prompts(6, seed=1)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=4, ignore_eos=True)
    llm = LLM(folder, kv_cache_memory=8 << 20, kv_cache_dtype=kv_cache_dtype)
    batched = llm.generate(batch, params, use_tqdm=False)
    alone = [llm.generate(p, params, use_tqdm=False)[0] for p in batch[:3]]  # prefix hits
    chunked_llm = LLM(folder, kv_cache_memory=8 << 20, kv_cache_dtype=kv_cache_dtype,
                      max_prefill_chunk=CHUNK, max_num_batched_tokens=16,
                      enable_prefix_caching=False)
    chunked = chunked_llm.generate(batch, params, use_tqdm=False)
    assert llm.engine.stats.prefix_cache_hits > 0 and chunked_llm.engine.stats.steps > 6
    expected = [out.outputs[0].token_ids for out in batched]
    assert [out.outputs[0].token_ids for out in alone] == expected[:3]
    assert [out.outputs[0].token_ids for out in chunked] == expected
    reference = first_logprobs(batched)
    torch.testing.assert_close(first_logprobs(alone), reference[:3], atol=5e-4, rtol=0)
    torch.testing.assert_close(first_logprobs(chunked), reference, atol=5e-4, rtol=0)


def test_float16_cache_stays_close_to_float32(f32_cache, f16_cache):
    batch = prompts(8, seed=2)
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=4, ignore_eos=True)
    exact = f32_cache.generate(batch, params, use_tqdm=False)
    rounded = f16_cache.generate(batch, params, use_tqdm=False)
    difference = (first_logprobs(rounded) - first_logprobs(exact)).abs().max().item()
    assert 0 < difference < 2e-2, difference  # rounded, and barely
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids
               for a, b in zip(exact, rounded))
    assert same >= 6, f"only {same} of 8 greedy completions kept every token"


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype must be 'auto', 'float32', 'bfloat16' or "
                                 "'float16', got 'fp8'"),
    (dict(kv_cache_dtype=torch.int8), "kv_cache_dtype must be .* got torch.int8"),
    (dict(dtype="bfloat16", kv_cache_dtype="float32"),
     r"a KV cache dtype must be the model's dtype \(torch.bfloat16\) or, for a float32 model, "
     r"torch.bfloat16 or torch.float16; got torch.float32"),
    (dict(dtype="bfloat16", kv_cache_dtype="float16"), "got torch.float16"),
])
def test_bad_kv_cache_dtypes_raise(folder, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(folder, **kwargs)


def test_engine_config_checks_the_name_and_resolves_auto():
    with pytest.raises(ValueError, match="got 'half-ish'"):
        EngineConfig(kv_cache_dtype="half-ish")
    assert EngineConfig().cache_dtype(torch.bfloat16) == torch.bfloat16
    assert EngineConfig(kv_cache_dtype="float16").cache_dtype(torch.float32) == torch.float16
    assert EngineConfig(kv_cache_dtype=torch.bfloat16).cache_dtype(torch.float32) == \
        torch.bfloat16
