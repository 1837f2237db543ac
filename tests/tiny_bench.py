"""The benchmarks at tiny sizes, as their tests (tests/bench) and the notebooks' test
(tests/test_notebooks.py) run them: one run per session (the ``bench_run`` fixture in
conftest.py) serves a benchmark's test and the notebook that plots its JSON."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# bench_engine.py: two batches of 4 and 2 for HF; a token budget of 32 chunks the longer prompts
# for fastllm. LLM's defaults: 5 prompts of 10 to 40 tokens on a 2-layer model.
REQUESTS, OUTPUT_TOKENS, PREFIX_LEN, SUFFIX_LEN, PREFIX_REQUESTS, ROUNDS = 6, 4, 32, 4, 3, 2
MIXED_REQUESTS, MIXED_OUTPUT_TOKENS = 5, 3
TINY_ENGINE = ["--layers", "1", "--hidden-size", "64", "--intermediate-size", "192",
               "--num-requests", str(REQUESTS), "--min-prompt-len", "4", "--max-prompt-len", "24",
               "--output-tokens", str(OUTPUT_TOKENS), "--hf-batch-size", "4",
               "--max-num-batched-tokens", "32", "--prefix-len", str(PREFIX_LEN),
               "--suffix-len", str(SUFFIX_LEN), "--prefix-requests", str(PREFIX_REQUESTS),
               "--prefix-rounds", str(ROUNDS), "--mixed-requests", str(MIXED_REQUESTS),
               "--mixed-min-prompt-len", "10", "--mixed-max-prompt-len", "40",
               "--mixed-output-tokens", str(MIXED_OUTPUT_TOKENS), "--mixed-layers", "2",
               "--repeats", "1", "--warmup", "0"]

# bench_rerank.py: one layer; 2 DL19 queries x their top 3 BM25 passages (about 200 tokens a
# pair), in pairs of at most 512 tokens: the recipe's 8192 would give each Reranker a 2 GiB KV
# pool to zero.
QUERIES, TOP_K = 2, 3
TINY_RERANK = ["--layers", "1", "--hidden-size", "64", "--intermediate-size", "96",
               "--queries", str(QUERIES), "--top-k", str(TOP_K), "--max-length", "512",
               "--repeats", "1", "--warmup", "0"]


def import_benchmark(name: str) -> ModuleType:
    """The module ``benchmarks/{name}.py``."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def engine_args(models_dir: Path, device: str = "cpu") -> list[str]:
    """bench_engine.py's tiny run: float32 and bfloat16 on ``device``."""
    return ["--dtypes", "float32", "bfloat16", "--device", device, "--models-dir",
            str(models_dir), *TINY_ENGINE]


def rerank_args(models_dir: Path) -> list[str]:
    """bench_rerank.py's tiny run."""
    return [*TINY_RERANK, "--models-dir", str(models_dir)]
