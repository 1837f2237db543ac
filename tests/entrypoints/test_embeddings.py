"""Embeddings from a decoder model: ``LLM.embed`` (last-token and mean pooling, L2-normalized)
against HF transformers' final hidden states in float64, whatever the chunking, and
``POST /v1/embeddings`` with the official openai SDK (base64, its default, and float)."""

from __future__ import annotations

import openai
import pytest
import torch
from openai_server import running_server
from transformers import AutoModel

from fastllm import LLM, AsyncLLM

TEXTS = ["Once upon a time", "The little dog ran to the park and saw a big red ball", "Hi"]


@pytest.fixture(scope="module")
def folder(model_path):
    return model_path("stories260K_hf")


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder, max_model_len=128)


def hf_embedding(folder, ids: list[int], pooling: str) -> torch.Tensor:
    model = AutoModel.from_pretrained(folder, dtype=torch.float64).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
    pooled = hidden[-1] if pooling == "last" else hidden.mean(0)
    return pooled / pooled.norm()


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "chunks_of_5"])
def test_embeddings_are_hfs_pooled_hidden_states(folder, pooling, chunk):
    llm = LLM(folder, max_model_len=128, max_prefill_chunk=chunk)
    outputs = llm.embed(TEXTS, pooling=pooling, use_tqdm=False)
    for text, out in zip(TEXTS, outputs):
        assert out.prompt_token_ids == llm.tokenizer.encode(text)
        expected = hf_embedding(folder, out.prompt_token_ids, pooling)
        got = torch.tensor(out.embedding, dtype=torch.float64)
        assert got.shape == expected.shape and got.norm() == pytest.approx(1, abs=1e-5)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)


def test_mean_pooling_is_not_fooled_by_the_prefix_cache(folder, llm):
    """A cached prefix has no hidden states: a mean-pooled prompt is computed whole."""
    long = TEXTS[1] + " and then it went home"
    llm.generate(long, use_tqdm=False)  # its blocks are cached now
    [cached] = llm.embed(long, pooling="mean", use_tqdm=False)
    [fresh] = LLM(folder, max_model_len=128, enable_prefix_caching=False).embed(
        long, pooling="mean", use_tqdm=False)
    torch.testing.assert_close(torch.tensor(cached.embedding), torch.tensor(fresh.embedding))


def test_bad_pooling_is_refused(llm):
    with pytest.raises(ValueError, match="pooling"):
        llm.embed("x", pooling="max")


def test_the_embeddings_endpoint(folder, llm):
    server_llm = AsyncLLM(folder, max_model_len=128)
    try:
        with running_server(server_llm, "stories") as server:
            client = openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0)
            expected = [out.embedding for out in llm.embed(TEXTS, use_tqdm=False)]
            got = client.embeddings.create(model="stories", input=TEXTS)  # base64 by default
            assert [d.index for d in got.data] == [0, 1, 2]
            for data, want in zip(got.data, expected):
                torch.testing.assert_close(torch.tensor(data.embedding), torch.tensor(want))
            floats = client.embeddings.create(model="stories", input=TEXTS[0],
                                              encoding_format="float")
            assert floats.data[0].embedding == pytest.approx(expected[0], abs=1e-6)
            tokens = llm.tokenizer.encode(TEXTS[0])
            by_ids = client.embeddings.create(model="stories", input=[tokens],
                                              encoding_format="float")
            assert by_ids.data[0].embedding == floats.data[0].embedding
            assert got.usage.prompt_tokens == sum(len(llm.tokenizer.encode(t)) for t in TEXTS)
            for bad, param in (({"input": []}, "input"), ({"input": [[1, 99999]]}, "input"),
                               ({"input": "x", "dimensions": 3}, "dimensions")):
                with pytest.raises(openai.BadRequestError) as error:
                    client.embeddings.create(model="stories", **bad)
                assert error.value.body["param"] == param
    finally:
        server_llm.shutdown()
