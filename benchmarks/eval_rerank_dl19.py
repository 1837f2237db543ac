"""nDCG@10 on TREC DL19 passage of a Qwen3-Reranker checkpoint reranking BM25's top passages.

For each of DL19's 43 queries, ``fastllm.Reranker`` scores the query's ``--top-k`` (100) BM25
hits (``rerank_eval/trec_dl19/retrieve_results_dl19_bm25_top100.json`` under
``--models-dir``), and the hits are ordered by score, best first (ties keep the BM25 order),
followed by the BM25 hits past ``--top-k`` in their BM25 order. The ranking is judged against
NIST's graded judgments (``qrels.dl19-passage.txt``) with trec_eval's ``ndcg_cut.10``: gain =
the judged grade (0 to 3; unjudged passages count 0), discount ``log2(rank + 1)``, divided by
the ideal DCG of the query's judged passages sorted by grade, averaged over the queries. The
BM25 order itself scores 0.5058, the "BM25" row of the RankGPT and RankLLM papers: a
working reranker lands well above it.

This needs a real checkpoint (a folder with config.json, *.safetensors and the tokenizer
files, e.g. Qwen/Qwen3-Reranker-0.6B): random weights score about what a random order does.

    python benchmarks/eval_rerank_dl19.py --model PATH [--top-k 100] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import fastllm

DEFAULT_MODELS_DIR = Path(__file__).resolve().parents[2] / "shared" / "models"
DL19_RUN = "rerank_eval/trec_dl19/retrieve_results_dl19_bm25_top100.json"
DL19_QRELS = "rerank_eval/trec_dl19/qrels.dl19-passage.txt"
BM25_NDCG10 = 0.5058  # the stored BM25 order, as trec_eval reports it


def load_dl19(models_dir: str | Path) -> list[dict[str, object]]:
    """The BM25 run: one ``{"query", "hits": [{"content", "qid", "docid", "rank",
    "score"}]}`` per query, hits in BM25 rank order."""
    data = json.loads((Path(models_dir) / DL19_RUN).read_text())
    for item in data:
        item["hits"] = sorted(item["hits"], key=lambda hit: hit["rank"])
    return data


def load_qrels(path: str | Path) -> dict[str, dict[str, int]]:
    """TREC qrels (``qid Q0 docid grade`` per line) as ``{qid: {docid: grade}}``."""
    qrels: dict[str, dict[str, int]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            qid, _, docid, grade = line.split()
            qrels.setdefault(qid, {})[docid] = int(grade)
    return qrels


def ndcg_at_k(ranking: Sequence[str], judged: Mapping[str, int], k: int = 10) -> float:
    """trec_eval's ``ndcg_cut.k`` of one query: DCG of ``ranking``'s first ``k`` docids (gain =
    grade, discount log2(rank + 1)) over the DCG of the best ``k`` judged grades; 0 when the
    query has no relevant passage."""
    def dcg(gains: Sequence[int]) -> float:
        return sum(gain / math.log2(rank + 2) for rank, gain in enumerate(gains[:k]))

    ideal = dcg(sorted((grade for grade in judged.values() if grade > 0), reverse=True))
    if ideal == 0:
        return 0.0
    return dcg([max(judged.get(docid, 0), 0) for docid in ranking]) / ideal


def mean_ndcg_at_k(rankings: Mapping[str, Sequence[str]],
                   qrels: Mapping[str, Mapping[str, int]], k: int = 10) -> float:
    """The mean of :func:`ndcg_at_k` over the queries of ``rankings`` ({qid: docids best
    first}) that have judgments, as trec_eval averages."""
    values = [ndcg_at_k(ranking, qrels[qid], k) for qid, ranking in rankings.items()
              if qid in qrels]
    if not values:
        raise ValueError("no query of the rankings has judgments")
    return sum(values) / len(values)


def bm25_rankings(data: Sequence[Mapping[str, object]]) -> dict[str, list[str]]:
    """{qid: docids in BM25 order}."""
    return {str(item["hits"][0]["qid"]): [hit["docid"] for hit in item["hits"]]
            for item in data}


def rerank_rankings(reranker: fastllm.Reranker, data: Sequence[Mapping[str, object]],
                    top_k: int) -> tuple[dict[str, list[str]], int]:
    """{qid: docids}: each query's first ``top_k`` hits ordered by ``reranker``'s scores (ties
    keep the BM25 order), then the rest in BM25 order; and how many pairs were scored."""
    rankings = {}
    pairs = 0
    for item in data:
        hits = item["hits"]
        head = hits[:top_k]
        scores = reranker.score(item["query"], [hit["content"] for hit in head])
        order = sorted(range(len(head)), key=lambda i: -scores[i])  # stable: BM25 order on ties
        rankings[str(hits[0]["qid"])] = ([head[i]["docid"] for i in order]
                                         + [hit["docid"] for hit in hits[top_k:]])
        pairs += len(head)
    return rankings, pairs


def evaluate(model: str | Path, *, top_k: int = 100, models_dir: str | Path = DEFAULT_MODELS_DIR,
             dtype: str = "float32", device: str = "cpu", max_length: int = 8192,
             queries: int | None = None) -> dict[str, object]:
    """Reranks DL19's BM25 top ``top_k`` with the checkpoint ``model``; returns nDCG@10 of the
    BM25 order and of the reranked one over the (first ``queries``) queries, and the timing."""
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    data = load_dl19(models_dir)[:queries]
    qrels = load_qrels(Path(models_dir) / DL19_QRELS)
    reranker = fastllm.Reranker(model, dtype=dtype, device=device, max_length=max_length)
    started = time.perf_counter()
    rankings, pairs = rerank_rankings(reranker, data, top_k)
    seconds = time.perf_counter() - started
    return {"queries": len(data), "top_k": top_k, "pairs": pairs, "seconds": seconds,
            "pairs_per_s": pairs / seconds,
            "bm25_ndcg@10": mean_ndcg_at_k(bm25_rankings(data), qrels),
            "reranked_ndcg@10": mean_ndcg_at_k(rankings, qrels)}


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Runs the evaluation and prints its figures (and writes them as JSON with ``--out``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Qwen3-Reranker checkpoint folder")
    parser.add_argument("--top-k", type=int, default=100,
                        help="BM25 hits reranked per query (default %(default)s)")
    parser.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR,
                        help=f"folder holding {Path(DL19_RUN).parent} (default %(default)s)")
    parser.add_argument("--dtype", default="float32", help="default %(default)s")
    parser.add_argument("--device", default="cpu", help="default %(default)s")
    parser.add_argument("--max-length", type=int, default=8192,
                        help="tokens of a wrapped pair at most (default %(default)s)")
    parser.add_argument("--queries", type=int, default=None,
                        help="only the first N queries (default: all 43)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    result = evaluate(args.model, top_k=args.top_k, models_dir=args.models_dir,
                      dtype=args.dtype, device=args.device, max_length=args.max_length,
                      queries=args.queries)
    result["model"] = str(args.model)
    print(f"TREC DL19 passage, {result['queries']} queries, BM25 top {args.top_k} reranked "
          f"by {args.model} ({args.dtype}, {args.device})")
    print(f"nDCG@10  BM25 {result['bm25_ndcg@10']:.4f}  reranked "
          f"{result['reranked_ndcg@10']:.4f}")
    print(f"{result['pairs']} pairs in {result['seconds']:.1f} s "
          f"({result['pairs_per_s']:.2f} pairs/s)")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
