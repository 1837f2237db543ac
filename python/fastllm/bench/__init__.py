"""Benchmark support shared by ``benchmarks/bench_*.py``.

``timer`` times competitors interleaved in one process, ``workloads`` builds model-shaped
inputs, ``report`` records the machine and writes JSON and markdown tables, ``rerank_recipe``
is the Qwen3-Reranker model card's HF recipe (the reranker's peer in tests and benchmarks).
"""
