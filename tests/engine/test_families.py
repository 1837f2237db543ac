"""Every model family through the engine: tiny random checkpoints of Gemma 2 and 3, Phi-3,
OLMo-2, Qwen3-MoE and Mixtral (tests/tiny_hf.py's FAMILY_CASES) under the Qwen3 tokenizer,
run by ``fastllm.LLM`` with chunked prefill, prefix caching, speculative decoding and
structured output, against HF transformers' greedy tokens on the same weights, and served.
"""

from __future__ import annotations

import re

import openai
import pytest
import torch
from conftest import per_device
from openai_server import running_server
from tiny_hf import FAMILY_CASES, random_hf_model, save_hf_model

from fastllm import LLM, AsyncLLM, SamplingParams, StructuredOutputsParams

NEW_TOKENS = 16
# Long enough that every family's greedy text, from one prompt or another, repeats a token (an
# n-gram lookup then finds a draft): some families' does not within 50 tokens of any prompt.
LOOKUP_TOKENS = 80
# A llama-shaped base under the Qwen3 tokenizer's vocabulary; 3 layers, so a sliding pattern
# has both kinds.
BASE = dict(vocab_size=151936, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
# The longest is longer than every case's sliding window (8) and than a prefill chunk.
PROMPT_LENGTHS = [5, 12, 40]
ENGINE = dict(max_model_len=128, block_size=4, max_num_batched_tokens=24,
              enable_prefix_caching=True)


@pytest.fixture(scope="module", params=list(FAMILY_CASES))
def family(request, tmp_path_factory, model_path):
    """(prompts, HF's greedy tokens after each, ``llm(device)`` shared per device,
    ``llm(device, speculative)`` made anew, the checkpoint's folder) of one family."""
    model_type, overrides = FAMILY_CASES[request.param]
    hf = random_hf_model(model_type, seed=len(request.param), **{**BASE, **overrides})
    folder = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 20000, (n,), generator=generator).tolist()
               for n in PROMPT_LENGTHS]
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        expected.append(out[0, len(prompt):].tolist())
    tokenizer = model_path("qwen3_tokenizer")

    def make(device, speculative=None, engine=LLM):
        return engine(folder, tokenizer=tokenizer, device=device, speculative=speculative,
                      **ENGINE)

    plain = per_device(make)
    return prompts, expected, plain, make, folder


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_greedy_tokens_match_hf_with_chunks_and_prefix_hits(family, device):
    prompts, expected, plain, _, _ = family
    llm = plain(device)
    batch = [{"prompt_token_ids": p} for p in prompts]
    got = llm.generate(batch, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    hits = llm.engine.stats.prefix_cache_hits
    again = llm.generate(batch, greedy(), use_tqdm=False)  # the prompts' blocks reused
    assert [o.outputs[0].token_ids for o in again] == expected
    assert llm.engine.stats.prefix_cache_hits > hits


def test_speculation_by_draft_model_keeps_the_tokens(family, device):
    """Verified drafts change no token: the model drafting for itself in bfloat16 drafts every
    step, and most drafts are accepted."""
    prompts, expected, _, make, folder = family
    llm = make(device, speculative={"method": "draft", "num_speculative_tokens": 3,
                                    "adaptive": False, "model": str(folder),
                                    "draft_dtype": "bfloat16"})
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    stats = llm.engine.stats
    assert stats.num_draft_tokens >= len(prompts) * 3
    assert stats.num_accepted_tokens > stats.num_draft_tokens // 2


def test_speculation_by_ngram_lookup_keeps_the_tokens(family, device):
    """Verified n-gram drafts change no token: over LOOKUP_TOKENS greedy tokens (the first
    NEW_TOKENS HF's), where each family's text repeats itself, so lookups find drafts."""
    prompts, expected, plain, make, _ = family
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=LOOKUP_TOKENS, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain(device).generate(batch, params,
                                                                   use_tqdm=False)]
    assert [tokens[:NEW_TOKENS] for tokens in want] == expected
    # A step after output token i can look up a draft when that token occurred earlier.
    lookups = sum(tokens[i] in (prompt + tokens)[:len(prompt) + i]
                  for prompt, tokens in zip(prompts, want) for i in range(len(tokens) - 1))
    assert lookups > 0, "no prompt's text repeats a token: no n-gram draft to verify"
    llm = make(device, speculative={"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_min": 1, "adaptive": False})
    got = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert llm.engine.stats.num_draft_tokens > 0


def test_structured_output(family, device):
    prompts, _, plain, _, _ = family
    pattern = r"(yes|no), [0-9]{2,4}\."
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    [out] = plain(device).generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text


def test_served_completions_are_the_engines_text(family, device):
    prompts, _, plain, make, _ = family
    expected = plain(device).generate([{"prompt_token_ids": p} for p in prompts], greedy(),
                                      use_tqdm=False)
    llm = make(device, engine=AsyncLLM)
    try:
        with running_server(llm, "family") as server:
            client = openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0)
            got = client.completions.create(model="family", prompt=prompts,
                                            max_tokens=NEW_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True})
    finally:
        llm.shutdown()
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [
        o.outputs[0].text for o in expected]
