"""Runs every fastllm benchmark with its defaults into one folder (what ``make bench`` runs).

``--device`` (default cpu) is passed to every benchmark, and each one's defaults depend on it:
on ``cuda`` they measure the sizes set for a GPU (each benchmark's docstring says which), on
the CPU the sizes of ``make bench`` on two cores. The GGUF and serving benchmarks (fastllm
against llama.cpp, which ``make bench`` builds for the CPU) and the speculative decoding one
(batch 1 on the CPU) run on the CPU only, and are left out on other devices.
``--benchmarks`` runs some of them only. The benchmarks that need model files (the Qwen3
tokenizer, stories260K, the DL19 run) read them from ``$FASTLLM_MODELS_DIR``, else from
``shared/models`` beside the checkout. A benchmark that fails is reported and the others still
run; the exit status is then 1.

    python benchmarks/run_all.py --out results
    python benchmarks/run_all.py --device cuda --out results-cuda
"""

from __future__ import annotations

import argparse
import time
import traceback
from pathlib import Path

import bench_attention
import bench_engine
import bench_generate
import bench_gguf
import bench_kv_cache
import bench_mask_cache
import bench_moe
import bench_moe_decode
import bench_rerank
import bench_sampling
import bench_serve
import bench_spec

BENCHMARKS = {"mask_cache": bench_mask_cache.main, "attention": bench_attention.main,
              "kv_cache": bench_kv_cache.main, "sampling": bench_sampling.main,
              "moe": bench_moe.main, "moe_decode": bench_moe_decode.main,
              "generate": bench_generate.main, "engine": bench_engine.main,
              "rerank": bench_rerank.main, "gguf": bench_gguf.main, "serve": bench_serve.main,
              "spec": bench_spec.main}
CPU_ONLY = {"gguf", "serve", "spec"}  # their peer runs on the CPU only; batch-1 speculation


def main(argv: list[str] | None = None) -> None:
    """Runs each benchmark, then prints all their markdown reports together."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"),
                        help="folder for every benchmark's JSON and markdown (default "
                             "%(default)s)")
    parser.add_argument("--device", default="cpu",
                        help="where every benchmark runs, cpu or cuda; their default sizes "
                             "depend on it (default %(default)s)")
    parser.add_argument("--benchmarks", nargs="+", choices=list(BENCHMARKS), metavar="NAME",
                        default=list(BENCHMARKS),
                        help=f"which to run, of {', '.join(BENCHMARKS)} (default: all)")
    args = parser.parse_args(argv)
    names = args.benchmarks
    if args.device != "cpu":
        left_out = [name for name in names if name in CPU_ONLY]
        if left_out:
            print(f"left out on {args.device}: {', '.join(left_out)} (CPU only)")
        names = [name for name in names if name not in CPU_ONLY]
    elapsed_s: dict[str, float] = {}
    failed: list[str] = []
    for name in names:
        started = time.perf_counter()
        try:
            BENCHMARKS[name](["--out", str(args.out), "--device", args.device])
        except Exception:  # reported; the other benchmarks still run
            traceback.print_exc()
            failed.append(name)
        elapsed_s[name] = time.perf_counter() - started
    print("\n" + "=" * 80 + "\n")
    for name in names:
        if name not in failed:
            print((args.out / f"{name}.md").read_text())
    print(", ".join(f"{name}: {seconds:.0f} s" for name, seconds in elapsed_s.items()))
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
