"""Runs every fastllm benchmark with its defaults into one folder (what ``make bench`` runs).

    python benchmarks/run_all.py --out results
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import bench_attention
import bench_engine
import bench_generate
import bench_kv_cache
import bench_mask_cache
import bench_rerank
import bench_sampling

BENCHMARKS = {"mask_cache": bench_mask_cache.main, "attention": bench_attention.main,
              "kv_cache": bench_kv_cache.main, "sampling": bench_sampling.main,
              "generate": bench_generate.main, "engine": bench_engine.main,
              "rerank": bench_rerank.main}


def main(argv: list[str] | None = None) -> None:
    """Runs each benchmark, then prints all their markdown reports together."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"),
                        help="folder for every benchmark's JSON and markdown (default "
                             "%(default)s)")
    out = parser.parse_args(argv).out
    elapsed_s: dict[str, float] = {}
    for name, bench_main in BENCHMARKS.items():
        started = time.perf_counter()
        bench_main(["--out", str(out)])
        elapsed_s[name] = time.perf_counter() - started
    print("\n" + "=" * 80 + "\n")
    for name in BENCHMARKS:
        print((out / f"{name}.md").read_text())
    print(", ".join(f"{name}: {seconds:.0f} s" for name, seconds in elapsed_s.items()))


if __name__ == "__main__":
    main()
