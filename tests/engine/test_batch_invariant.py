"""batch_invariant=True: a seeded request's tokens do not depend on what runs beside it, in
16 bits too: alone, in a batch in any order, with its prompt prefilled in chunks, and after a
preemption, on stories260K (float weights: linear) and the real SmolLM2 (quantized weights, the
direct attention tiles)."""

from __future__ import annotations

import random

import pytest

from fastllm import LLM, SamplingParams


@pytest.fixture(scope="module", params=[("stories260K", "bfloat16"), ("stories260K", "float16"),
                                        ("smollm2", "bfloat16")], ids=str)
def case(request, model_path, smollm2_path):
    """(model path, dtype, prompts, sampling params) for one model."""
    name, dtype = request.param
    if name == "stories260K":
        path, vocab = model_path("stories260K_hf"), 512
    else:
        path, vocab = smollm2_path, 49152
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [1] + [rng.randrange(3, vocab) for _ in range(length)]}
               for length in (3, 40, 150, 9, 77, 21)]
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=10 + i, max_tokens=16,
                             ignore_eos=True) for i in range(len(prompts))]
    return path, dtype, prompts, params


def generate(llm: LLM, prompts, params) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def test_seeded_16_bit_tokens_do_not_depend_on_the_batch(case):
    path, dtype, prompts, params = case
    llm = LLM(path, dtype=dtype, batch_invariant=True, max_model_len=512,
              kv_cache_memory=16 << 20)
    together = generate(llm, prompts, params)
    assert llm.engine.stats.steps < sum(p.max_tokens for p in params)  # it did batch
    for i in range(len(prompts)):
        assert generate(llm, prompts[i:i + 1], params[i:i + 1]) == [together[i]], i
    order = [3, 0, 5, 1, 4, 2]
    shuffled = generate(llm, [prompts[i] for i in order], [params[i] for i in order])
    assert shuffled == [together[i] for i in order]

    chunked = LLM(path, dtype=dtype, batch_invariant=True, max_model_len=512,
                  kv_cache_memory=16 << 20, max_prefill_chunk=13, max_num_batched_tokens=32,
                  enable_prefix_caching=False)
    assert generate(chunked, prompts, params) == together

    # Room for about two requests: the others are preempted and recomputed.
    small = LLM(path, dtype=dtype, batch_invariant=True, max_model_len=256,
                kv_cache_memory=16 * llm.kv_cache.spec.bytes_per_block)
    assert generate(small, prompts, params) == together
    assert small.engine.stats.preemptions > 0


def test_batch_invariant_is_checked():
    from fastllm.engine import EngineConfig

    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        EngineConfig(batch_invariant="yes")
