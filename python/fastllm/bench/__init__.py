"""Benchmark support shared by ``benchmarks/bench_*.py`` and ``benchmarks/run_all.py``.

``timer`` times competitors interleaved in one process, ``workloads`` builds model-shaped
inputs, ``report`` records the machine and writes JSON and markdown tables, ``rerank_recipe``
is the Qwen3-Reranker model card's HF recipe (the reranker's peer in tests and benchmarks),
``summary`` reads a results folder into the summary table and the results page, ``charts``
draws its charts.
"""
