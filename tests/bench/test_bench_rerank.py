"""The rerank benchmark end to end at tiny sizes (every fastllm rung scores as the HF recipe
does, and the rows hold what the report says), and the DL19 evaluation's nDCG@10: trec_eval's
0.5058 on the BM25 run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import find_model
from tiny_bench import QUERIES, TOP_K, import_benchmark, rerank_args

bench_generate = import_benchmark("bench_generate")
bench_rerank = import_benchmark("bench_rerank")
eval_rerank_dl19 = import_benchmark("eval_rerank_dl19")


@pytest.fixture(scope="module")
def models_dir() -> Path:
    find_model("rerank_eval/trec_dl19/qrels.dl19-passage.txt")  # skips if absent
    return find_model("qwen3_tokenizer").parent


def test_rungs_choose_the_ladders_rows() -> None:
    config, _ = bench_rerank.parse_args([])
    assert config.rungs == tuple(bench_rerank.RUNGS)
    config, _ = bench_rerank.parse_args(["--rungs", "fastllm_packed", "fastllm"])
    assert config.rungs == ("fastllm_packed", "fastllm")
    with pytest.raises(ValueError, match="rungs must be some of"):
        bench_rerank.RerankBenchConfig(rungs=())


def test_bench_rerank_writes_rows(bench_run, models_dir: Path) -> None:
    # The tiny run the notebooks' test plots too: one run per session serves both.
    document, out = bench_run("rerank", rerank_args(models_dir))
    written = json.loads((out / "rerank.json").read_text())
    assert written["rows"] == document["rows"]
    rows = written["rows"]
    assert [row["competitor"] for row in rows] == ["hf", *bench_rerank.RUNGS]
    pairs = QUERIES * TOP_K
    pair_tokens = rows[0]["pair_tokens"]
    for row in rows:
        assert (row["dtype"], row["layers"], row["queries"], row["pairs"]) == ("float32", 1,
                                                                              QUERIES, pairs)
        assert row["repeats"] == 1 and len(row["scores"]) == pairs
        assert all(0 <= score <= 1 for score in row["scores"])
        assert row["max_abs_score_diff_vs_hf"] <= bench_rerank.GOAL_SCORE_DIFF
        assert row["pairs_per_s"] == pytest.approx(pairs / (row["median_ms"] / 1e3))
        assert row["speedup_vs_hf"] == pytest.approx(rows[0]["median_ms"] / row["median_ms"])
        if row["competitor"] == "hf":
            assert row["tokens_computed"] >= pair_tokens  # padded
        elif row["shared_prefix"]:
            # A query's shared part (more than 4 blocks of 16) is computed once, not per pair.
            assert row["tokens_computed"] <= pair_tokens - QUERIES * (TOP_K - 1) * 64
        else:  # nothing shared (checked by the benchmark too)
            assert row["tokens_computed"] == pair_tokens
    for previous, row in zip(rows[1:], rows[2:]):
        assert row["gain_vs_previous"] == pytest.approx(previous["median_ms"] / row["median_ms"])
    assert rows[1]["gain_vs_previous"] is None
    # Each rung adds one technique; the last is the Reranker as is.
    rungs = list(bench_rerank.RUNGS.values())
    assert [r.head for r in rungs] == ["every", "last", "two", "two", "two"]
    assert [(r.packing, r.shared_prefix) for r in rungs][-1] == (True, True)
    markdown = (out / "rerank.md").read_text()
    assert "not measured in this run" in markdown  # scaled down from the goal's size
    assert "| float32 | HF recipe |" in markdown
    assert "| float32 | + shared prefix (fastllm.Reranker) |" in markdown


def test_goal_summary_judges_speed_and_scores() -> None:
    config = bench_rerank.RerankBenchConfig()
    assert config.at_goal_size

    def summary(speedup: float, diff: float) -> str:
        return bench_rerank.goal_summary(config, [
            {"competitor": "hf", "dtype": "float32", "speedup_vs_hf": 1.0,
             "max_abs_score_diff_vs_hf": 0.0},
            {"competitor": "fastllm", "dtype": "float32", "speedup_vs_hf": speedup,
             "max_abs_score_diff_vs_hf": diff}])

    assert summary(3.5, 1e-6).endswith("3.50x, scores within 1.00e-06 (met).")
    assert summary(2.5, 1e-6).endswith("(NOT met).")
    assert summary(3.5, 1e-4).endswith("(NOT met).")


def test_ndcg_at_10_of_the_bm25_run_is_trec_evals(models_dir: Path) -> None:
    data = eval_rerank_dl19.load_dl19(models_dir)
    qrels = eval_rerank_dl19.load_qrels(models_dir / eval_rerank_dl19.DL19_QRELS)
    assert len(data) == 43 and len(qrels) == 43
    ndcg = eval_rerank_dl19.mean_ndcg_at_k(eval_rerank_dl19.bm25_rankings(data), qrels)
    assert round(ndcg, 4) == eval_rerank_dl19.BM25_NDCG10 == 0.5058


def test_ndcg_at_k_by_hand() -> None:
    ndcg = eval_rerank_dl19.ndcg_at_k
    judged = {"a": 3, "b": 1, "c": 0, "d": 2}
    assert ndcg(["a", "d", "b", "c"], judged) == pytest.approx(1.0)
    # Linear gains, log2 discounts; "x" is unjudged (gain 0); the ideal uses every judgment.
    dcg = 1 / 1 + 0 / 1.584962500721156 + 3 / 2
    ideal = 3 / 1 + 2 / 1.584962500721156 + 1 / 2
    assert ndcg(["b", "x", "a"], judged) == pytest.approx(dcg / ideal)
    assert ndcg(["d", "a"], judged, k=1) == pytest.approx(2 / 3)
    assert ndcg(["a"], {"a": 0}) == 0.0  # no relevant passage
    with pytest.raises(ValueError, match="no query of the rankings has judgments"):
        eval_rerank_dl19.mean_ndcg_at_k({"1": ["a"]}, {"2": judged})


class ReversedScores:
    """A reranker stub preferring later passages, with a tie between the first two."""

    def score(self, query: str, documents: list[str]) -> list[float]:
        return [0.0, 0.0, *range(1, len(documents) - 1)]


def test_rerank_rankings_order_the_top_k_by_score() -> None:
    data = [{"query": "q", "hits": [{"qid": 7, "docid": f"d{i}", "content": f"text {i}"}
                                    for i in range(6)]}]
    rankings, pairs = eval_rerank_dl19.rerank_rankings(ReversedScores(), data, top_k=4)
    assert pairs == 4
    assert rankings == {"7": ["d3", "d2", "d0", "d1", "d4", "d5"]}  # ties keep BM25 order


def test_eval_script_runs_on_a_random_model(tmp_path: Path, models_dir: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    config = bench_generate.GenerateBenchConfig(layers=1, hidden_size=64, intermediate_size=96,
                                                models_dir=str(models_dir))
    bench_generate.save_random_model(config, tmp_path / "model")
    result = eval_rerank_dl19.main(["--model", str(tmp_path / "model"), "--top-k", "2",
                                    "--queries", "2", "--models-dir", str(models_dir),
                                    "--out", str(tmp_path / "eval.json")])
    assert (result["queries"], result["top_k"], result["pairs"]) == (2, 2, 4)
    assert 0 <= result["reranked_ndcg@10"] <= 1 and 0 <= result["bm25_ndcg@10"] <= 1
    assert json.loads((tmp_path / "eval.json").read_text()) == result
    assert "nDCG@10  BM25" in capsys.readouterr().out
