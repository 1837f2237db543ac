"""fastllm.Reranker against a plain HF transformers run of the Qwen3-Reranker model card's recipe
(left padding, full logits) on the same random-weight Qwen3 with the real Qwen3 tokenizer, on
TREC DL19 and NovelEval texts; the causal mask matters; bad input fails clearly. Scores (of the
Reranker and of the server's endpoint) are checked on each device present, HF on the CPU."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from conftest import http, per_device
from openai_server import running_server
from tiny_hf import tiny_qwen3_folder

import fastllm
from fastllm import Reranker
from fastllm.bench.rerank_recipe import recipe_ids, recipe_scores
from fastllm.entrypoints.cli import main

transformers.logging.set_verbosity_error()

MAX_LENGTH = 256  # small, so DL19 passages get truncated
TOLERANCE = 1e-5  # scores in [0, 1], float32 on any device against HF's on the CPU


@pytest.fixture(scope="module")
def folder(tmp_path_factory, model_path):
    return tiny_qwen3_folder(tmp_path_factory.mktemp("reranker"),
                             model_path("qwen3_tokenizer"), seed=0, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def hf(folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, padding_side="left")
    return model, tokenizer


@pytest.fixture(scope="module")
def rerankers(folder):
    """``rerankers(device)``: one Reranker per device."""
    return per_device(lambda device: Reranker(folder, device=device, max_length=MAX_LENGTH,
                                              max_num_batched_tokens=512))


@pytest.fixture(scope="module")
def reranker(rerankers) -> Reranker:
    return rerankers("cpu")


@pytest.fixture
def device_reranker(rerankers, device) -> Reranker:
    return rerankers(device)


def dl19(model_path, queries: int, hits: int) -> list[tuple[str, list[str]]]:
    path = model_path("rerank_eval/trec_dl19/retrieve_results_dl19_bm25_top100.json")
    data = json.loads(path.read_text())
    return [(item["query"], [hit["content"] for hit in item["hits"][:hits]])
            for item in data[:queries]]


def noveleval(model_path, queries: int, passages: int) -> list[tuple[str, list[str]]]:
    folder = model_path("rerank_eval/noveleval")
    query_text = dict(line.split("\t", 1) for line in
                      (folder / "queries.tsv").read_text().splitlines())
    corpus: dict[str, list[str]] = {}
    for line in (folder / "corpus.tsv").read_text().splitlines():
        doc_id, text = line.split("\t", 1)
        corpus.setdefault(doc_id.split("-")[0], []).append(text)
    return [(query_text[q], corpus[q][:passages]) for q in sorted(corpus, key=int)[:queries]]


TRICKY = ["", "café 世界 🌍 naïve — ok", " leading space", "'s a contraction", "\n\nnew lines",
          "123 numbers", "<|im_end|> a special token written in the text",
          "word " * 400]  # truncated


def assert_close(got: list[float], expected: list[float]) -> None:
    assert len(got) == len(expected)
    assert max(abs(a - b) for a, b in zip(got, expected)) <= TOLERANCE, (got, expected)


def test_token_ids_are_the_recipes(reranker, hf):
    _, tokenizer = hf
    query = "what is a flea's life cycle?"
    assert [reranker.pair_token_ids(query, d) for d in TRICKY] == recipe_ids(
        tokenizer, query, TRICKY, max_length=MAX_LENGTH)


def test_scores_equal_the_recipe_on_dl19(device_reranker, hf, model_path):
    for query, documents in dl19(model_path, queries=3, hits=6):
        assert_close(device_reranker.score(query, documents),
                     recipe_scores(*hf, query, documents, max_length=MAX_LENGTH))


def test_scores_equal_the_recipe_on_noveleval_and_tricky_documents(reranker, hf, model_path):
    for query, documents in noveleval(model_path, queries=2, passages=5):
        documents = documents + TRICKY
        assert_close(reranker.score(query, documents),
                     recipe_scores(*hf, query, documents, max_length=MAX_LENGTH))


def test_custom_instruction_and_long_max_length(folder, hf, model_path):
    reranker = Reranker(folder, instruction="Find passages about animals", max_length=1024)
    query, documents = dl19(model_path, queries=1, hits=4)[0]
    assert_close(reranker.score(query, documents),
                 recipe_scores(*hf, query, documents, instruction="Find passages about animals",
                               max_length=1024))


def test_score_pairs_groups_queries_and_keeps_order(reranker, model_path):
    data = dl19(model_path, queries=2, hits=3)
    pairs = [(q, d) for q, docs in data for d in docs]
    interleaved = pairs[::2] + pairs[1::2]
    expected = {pair: score for pair, score in zip(pairs, reranker.score_pairs(pairs))}
    assert_close(reranker.score_pairs(interleaved), [expected[p] for p in interleaved])


def test_the_shared_part_is_computed_once_per_query(reranker, model_path):
    stats = reranker.client.engine.stats
    before = stats.scheduled_tokens
    query, documents = dl19(model_path, queries=1, hits=8)[0]
    reranker.score(query, documents)
    computed = stats.scheduled_tokens - before
    total = sum(len(reranker.pair_token_ids(query, d)) for d in documents)
    shared = len(reranker.pair_token_ids(query, "")) - len(reranker.suffix_ids) - 4
    assert computed <= total - (len(documents) - 1) * (shared // 16 * 16)


def test_removing_the_causal_mask_changes_the_scores(reranker, model_path):
    """Qwen3-Reranker is a causal LM: bidirectional attention is a different model."""
    query, documents = dl19(model_path, queries=1, hits=4)[0]
    causal = reranker.score(query, documents)

    def bidirectional(*args, causal: bool = True, **kwargs):
        return torch.ops.fastllm_composite.paged_attention.default(*args, causal=False, **kwargs)

    # The layers call the op from C++: its CPU kernel is swapped for the block, then restored.
    library = torch.library.Library("fastllm", "IMPL")
    try:
        with pytest.warns(UserWarning, match="Overriding a previously registered kernel"):
            library.impl("paged_attention", bidirectional, "CPU")
        without_mask = reranker.score(query, documents)
    finally:
        library._destroy()
    assert max(abs(a - b) for a, b in zip(causal, without_mask)) > 1e-3
    assert_close(reranker.score(query, documents), causal)


def test_rerank_orders_best_first(reranker, model_path):
    query, documents = dl19(model_path, queries=1, hits=6)[0]
    # Scored once before, so that both calls below find the same blocks in the prefix cache:
    # a pair computed after a longer cached part of it sums its attention in other blocks, which
    # moves a score in its last bits.
    reranker.score(query, documents)
    scores = reranker.score(query, documents)
    ranked = reranker.rerank(query, documents)
    assert [r.score for r in ranked] == sorted(scores, reverse=True)
    assert all(documents[r.index] == r.document and scores[r.index] == r.score for r in ranked)
    assert [r.index for r in reranker.rerank(query, documents, top_n=2)] == \
        [r.index for r in ranked[:2]]
    assert isinstance(ranked[0], fastllm.RerankResult)


def test_bad_input(reranker, folder):
    assert reranker.score("q", []) == [] and reranker.rerank("q", []) == []
    assert reranker.score_pairs([]) == []
    with pytest.raises(TypeError, match=r"documents\[1\] must be a str, got int"):
        reranker.score("q", ["fine", 3])
    with pytest.raises(TypeError, match="documents must be a list of str, got one str"):
        reranker.score("q", "a document")
    with pytest.raises(TypeError, match="the query must be a str, got NoneType"):
        reranker.score_pairs([(None, "doc")])
    with pytest.raises(TypeError, match=r"pairs\[0\] must be a \(query, document\) pair"):
        reranker.score_pairs(["just a string"])
    with pytest.raises(ValueError, match="top_n must be None or an int >= 0, got -1"):
        reranker.rerank("q", ["a"], top_n=-1)
    with pytest.raises(ValueError, match="max_length must be an int above the"):
        Reranker(folder, max_length=20)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        Reranker(folder, max_length=4096)


def test_cli_prints_the_ranking(folder, reranker, tmp_path, capsys):
    docs = tmp_path / "docs.txt"
    documents = ["Paris is the capital of France.", "Bananas are yellow.", "café"]
    docs.write_text("\n".join(documents) + "\n")
    main(["rerank", "--model", str(folder), "--query", "capital of France",
          "--docs", str(docs), "--max-length", str(MAX_LENGTH)])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = reranker.rerank("capital of France", documents)
    assert [(r["index"], r["document"]) for r in lines] == \
        [(r.index, r.document) for r in expected]
    assert_close([r["score"] for r in lines], [r.score for r in expected])


def test_kv_cache_dtype_float16(folder, reranker, tmp_path, capsys):
    # K/V kept in float16 under the float32 model: scores move by rounding only, and the CLI's
    # --kv-cache-dtype reaches the cache (its scores are the float16 reranker's, bit for bit).
    rounded = Reranker(folder, max_length=MAX_LENGTH, max_num_batched_tokens=512,
                       kv_cache_dtype="float16")
    assert rounded.client.kv_cache.k_cache.dtype == torch.float16
    documents = ["Paris is the capital of France.", "Bananas are yellow.", "café"]
    scores = rounded.score("capital of France", documents)
    exact = reranker.score("capital of France", documents)
    assert scores != exact and max(abs(a - b) for a, b in zip(scores, exact)) < 1e-3
    docs = tmp_path / "docs.txt"
    docs.write_text("\n".join(documents) + "\n")
    main(["rerank", "--model", str(folder), "--query", "capital of France", "--docs", str(docs),
          "--max-length", str(MAX_LENGTH), "--kv-cache-dtype", "float16"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted((r["index"], r["score"]) for r in lines) == sorted(enumerate(scores))


def test_the_servers_rerank_endpoint_gives_the_rerankers_scores(folder, device_reranker, device,
                                                                 model_path):
    """POST /v1/rerank (the Jina/Cohere shape) on a real server: the same scores and order as
    ``Reranker.rerank``, the shared prefix reused, top_n and return_documents honoured."""
    reranker = device_reranker
    query, documents = dl19(model_path, queries=1, hits=6)[0]
    expected = reranker.rerank(query, documents)
    llm = fastllm.AsyncLLM(folder, device=device, max_model_len=MAX_LENGTH,
                           max_num_batched_tokens=512)
    try:
        with running_server(llm, "reranker") as server:
            url = server.v1 + "/rerank"
            got = http.post(url, json={"model": "reranker", "query": query,
                                        "documents": documents}).json()
            assert [r["index"] for r in got["results"]] == [r.index for r in expected]
            for result, want in zip(got["results"], expected):
                assert result["relevance_score"] == pytest.approx(want.score, abs=TOLERANCE)
                assert result["document"] == {"text": want.document}
            assert got["usage"]["total_tokens"] == sum(
                len(reranker.pair_token_ids(query, d)) for d in documents)
            assert llm.client.engine.stats.prefix_cache_hits > 0
            top = http.post(server.base_url + "/rerank", json={
                "query": query, "documents": [{"text": d} for d in documents], "top_n": 2,
                "return_documents": False}).json()["results"]
            assert [(r["index"], r.get("document")) for r in top] == [
                (r.index, None) for r in expected[:2]]
            response = http.post(url, json={"query": query, "documents": "one string"})
            assert response.status_code == 400
            assert response.json()["error"]["param"] == "documents"
    finally:
        llm.shutdown()
