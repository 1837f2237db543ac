"""``SamplingParams(prompt_logprobs=k)``: each prompt token's logprob given the tokens before it,
and the k most likely tokens, from the prefill, against HF transformers' logits in float64;
the same whatever the chunking, a cached prefix, or tokens generated after them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from fastllm import LLM, SamplingParams

PROMPT_LENGTHS = (1, 2, 23, 40)


@pytest.fixture(scope="module")
def folder(model_path):
    return model_path("stories260K_hf")


@pytest.fixture(scope="module")
def hf(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [[1, *torch.randint(3, 512, (n - 1,), generator=generator).tolist()]
            for n in PROMPT_LENGTHS]


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)  # [n, vocab]


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunks_of_7"])
def test_prompt_logprobs_are_hfs(folder, hf, chunk):
    llm = LLM(folder, max_model_len=128, max_prefill_chunk=chunk)
    params = SamplingParams(max_tokens=0, prompt_logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params,
                           use_tqdm=False)
    for ids, out in zip(prompts(), outputs):
        assert out.outputs[0].token_ids == [] and out.finished
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        expected = hf_logprobs(hf, ids)
        for position in range(1, len(ids)):
            entry, row = out.prompt_logprobs[position], expected[position - 1]
            token = ids[position]
            assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
            top = row.topk(3)
            listed = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank is not None)
            assert [t for _, t in listed] == top.indices.tolist()
            assert len(entry) in (3, 4)  # the token itself, when it is not among the top 3
            assert entry[token].decoded_token == llm.tokenizer.token_text(token)


def test_a_cached_prefix_is_computed_again_and_generation_is_unchanged(folder):
    llm = LLM(folder, max_model_len=128)
    ids = prompts()[3]
    greedy = SamplingParams(temperature=0, max_tokens=5)
    [plain] = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)
    # The prompt's blocks are cached now; prompt logprobs still need every row.
    [both] = llm.generate({"prompt_token_ids": ids},
                          SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=0),
                          use_tqdm=False)
    assert both.num_cached_tokens == 0
    assert both.outputs[0].token_ids == plain.outputs[0].token_ids
    assert all(len(entry) == 1 for entry in both.prompt_logprobs[1:])
    [again] = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)
    assert again.num_cached_tokens > 0  # the computed blocks entered the cache as usual


def test_bad_prompt_logprobs_are_refused(folder):
    llm = LLM(folder, max_model_len=64)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate("x", SamplingParams(prompt_logprobs=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs must be at most the vocabulary"):
        llm.generate("x", SamplingParams(prompt_logprobs=513), use_tqdm=False)
