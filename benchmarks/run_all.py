"""Runs fastllm's benchmarks into one folder (what ``make bench`` runs), then writes the
summary, the results page and the charts from their JSON.

Two sets. The default set (``make bench``) measures what the project is judged by in minutes
on two cores: the embedded SmolLM2 GGUF against llama.cpp in float32 and bfloat16, engine
throughput against HF, serving at concurrency 1 and 32, speculative decoding, reranking and
the mask cache, each at the sizes of its preset (:data:`DEFAULT_SET`: the benchmark's own
options, printed as it starts). ``--full`` (``make bench FULL=1``) runs every benchmark at its
own defaults, a much longer run.

``--device`` (default cpu) is passed to every benchmark. On a device other than the CPU every
benchmark runs at that device's defaults (each one's docstring says which), and the GGUF,
serving and speculative decoding ones (fastllm against llama.cpp, built for the CPU; batch-1
speculation) are left out. ``--benchmarks`` runs some of them only. The benchmarks that need
model files (the Qwen3 tokenizer, stories260K, the DL19 run) read them from
``$FASTLLM_MODELS_DIR``, else from ``shared/models`` beside the checkout. A benchmark that
fails is reported and the others still run; the exit status is then 1.

Every line a benchmark prints is prefixed with ``[i/n name m:ss]``: which benchmark, and how
long it has been running; a benchmark silent for a minute gets a line saying it still runs.
At the end: ``run.json`` (the run's record), one chart per benchmark (``<name>.png``, beside
its JSON: :mod:`fastllm.bench.charts`), the results page (``--results-md``, default
``benchmarks/RESULTS.md``) and the summary table, printed (:mod:`fastllm.bench.summary`).

    python benchmarks/run_all.py --out results
    python benchmarks/run_all.py --out results --full
    python benchmarks/run_all.py --device cuda --out gpu --results-md gpu/RESULTS.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import shlex
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import bench_attention
import bench_checkpoints
import bench_engine
import bench_generate
import bench_gguf
import bench_kv_cache
import bench_lora
import bench_mask_cache
import bench_moe
import bench_moe_decode
import bench_rerank
import bench_sampling
import bench_serve
import bench_spec
from fastllm.bench.charts import write_charts
from fastllm.bench.summary import BenchmarkRun, RunRecord, duration, results_markdown, \
    summary_table

BENCHMARKS = {"mask_cache": bench_mask_cache.main, "attention": bench_attention.main,
              "kv_cache": bench_kv_cache.main, "sampling": bench_sampling.main,
              "moe": bench_moe.main, "moe_decode": bench_moe_decode.main,
              "generate": bench_generate.main, "engine": bench_engine.main,
              "rerank": bench_rerank.main, "gguf": bench_gguf.main, "serve": bench_serve.main,
              "spec": bench_spec.main, "lora": bench_lora.main,
              "checkpoints": bench_checkpoints.main}
CPU_ONLY = {"gguf", "serve", "spec"}  # their peer runs on the CPU only; batch-1 speculation
RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"
QUIET_S = 60.0  # a benchmark silent this long gets a line saying it still runs


@dataclass(frozen=True)
class Preset:
    """A benchmark's sizes in the default set: its own command-line options, and what they
    measure in a few words."""

    about: str
    args: tuple[str, ...]


# The default set, in the order it runs: each figure still a median over alternating calls
# (fewer of them), on the model the benchmark is about; what is cut is workload and repeats.
DEFAULT_SET: dict[str, Preset] = {
    "gguf": Preset("the embedded SmolLM2 Q4_1 GGUF against llama.cpp, float32 and bfloat16, a "
                   "512-token prompt and 1 + 128 tokens, 3 timed calls, 1 load each",
                   ("--files", "smollm2:Q4_1", "--load-repeats", "1", "--repeats", "3")),
    "engine": Preset("Qwen3-0.6B shape (28 layers) in float32: 16 requests of 32-128 tokens, "
                     "32 output tokens each, against HF in batches of 8; the prefix cache's "
                     "TTFT",
                     ("--sections", "throughput", "prefix", "--dtypes", "float32",
                      "--num-requests", "16", "--max-prompt-len", "128", "--output-tokens", "32",
                      "--hf-batch-size", "8", "--prefix-requests", "4", "--prefix-rounds", "2")),
    "serve": Preset("fastllm serve against llama.cpp's server on SmolLM2 Q4_1, 32 output tokens "
                    "a request: concurrency 1 (4 requests at 1/s) and 32 (32 requests at 16/s)",
                    ("--concurrencies", "1", "32", "--request-rates", "1", "16",
                     "--requests", "4", "32", "--output-tokens", "32")),
    "spec": Preset("n-gram and Q4_0-drafted speculation on SmolLM2 F16, three tasks, 1 + 64 "
                   "tokens, beside llama.cpp's prompt lookup",
                   ("--files", "F16", "--decode-tokens", "64", "--repeats", "2")),
    "rerank": Preset("fastllm.Reranker against the HF recipe on the Qwen3-0.6B shape (28 "
                     "layers), 1 DL19 query x its top 16 passages",
                     ("--queries", "1", "--top-k", "16", "--rungs", "fastllm", "--repeats", "2")),
    "mask_cache": Preset("Qwen3-0.6B attention, L = 1 to 2048, 20 timed calls or 0.5 s each",
                         ("--repeats", "20", "--budget", "0.5")),
}


class ProgressOutput(io.TextIOBase):
    """Stdout while a benchmark runs: each line prefixed with ``[i/n name m:ss]``, and a line
    saying it still runs when it has printed nothing for ``quiet_s`` seconds."""

    def __init__(self, stream: TextIO, label: str, quiet_s: float = QUIET_S) -> None:
        self.stream, self.label, self.quiet_s = stream, label, quiet_s
        self.started = self.last_line = time.monotonic()
        self.pending = ""
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.watcher = threading.Thread(target=self._watch, daemon=True)

    def prefix(self) -> str:
        return f"[{self.label} {duration_clock(time.monotonic() - self.started)}]"

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self.lock:
            self.pending += text
            *lines, self.pending = self.pending.split("\n")
            for line in lines:  # blank lines stay blank
                self.stream.write(f"{self.prefix()} {line}\n" if line.strip() else "\n")
                self.last_line = time.monotonic()
            self.stream.flush()
        return len(text)

    def _watch(self) -> None:
        while not self.stopped.wait(min(1.0, self.quiet_s)):
            if time.monotonic() - self.last_line >= self.quiet_s:
                self.write("... still running\n")

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Stdout goes through this while the block runs."""
        self.watcher.start()
        try:
            with contextlib.redirect_stdout(self):
                yield
        finally:
            self.stopped.set()
            self.watcher.join()
            if self.pending:
                self.write("\n")


def duration_clock(seconds: float) -> str:
    """``m:ss``."""
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}:{rest:02d}"


def plan(args: argparse.Namespace) -> list[tuple[str, Preset | None]]:
    """The benchmarks to run, in order, each with its preset (None: its own defaults)."""
    full = args.full or args.device != "cpu"
    names = args.benchmarks or list(BENCHMARKS if full else DEFAULT_SET)
    if args.device != "cpu":
        left_out = [name for name in names if name in CPU_ONLY]
        if left_out:
            print(f"left out on {args.device}: {', '.join(left_out)} (CPU only)")
        names = [name for name in names if name not in CPU_ONLY]
    return [(name, None if full else DEFAULT_SET.get(name)) for name in names]


def main(argv: list[str] | None = None) -> None:
    """Runs each benchmark, then writes the run's record, charts and results page, and prints
    the summary table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"),
                        help="folder for every benchmark's JSON, markdown and chart (default "
                             "%(default)s)")
    parser.add_argument("--full", action="store_true",
                        help="every benchmark at its own defaults (about an hour on two "
                             "cores), not the default set's presets")
    parser.add_argument("--device", default="cpu",
                        help="where every benchmark runs, cpu or cuda; off the CPU each runs at "
                             "that device's defaults (default %(default)s)")
    parser.add_argument("--benchmarks", nargs="+", choices=list(BENCHMARKS), metavar="NAME",
                        help=f"which to run, of {', '.join(BENCHMARKS)} (default: the default "
                             f"set, {', '.join(DEFAULT_SET)}; with --full, all)")
    parser.add_argument("--results-md", type=Path, default=RESULTS_MD,
                        help="where to write the results page (default %(default)s)")
    arguments = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(arguments)
    chosen = plan(args)
    command = shlex.join([Path(sys.executable).name, "benchmarks/run_all.py", *arguments])
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    run_started = time.perf_counter()
    runs: list[BenchmarkRun] = []
    for index, (name, preset) in enumerate(chosen, 1):
        label = f"{index}/{len(chosen)} {name}"
        extra = list(preset.args) if preset else []
        print(f"[{label}] {preset.about if preset else 'its own defaults'}"
              + (f" ({' '.join(extra)})" if extra else ""), flush=True)
        started = time.perf_counter()
        failed = False
        with ProgressOutput(sys.stdout, label).active():
            try:
                BENCHMARKS[name](["--out", str(args.out), "--device", args.device, *extra])
            except Exception:  # reported; the other benchmarks still run
                traceback.print_exc()
                failed = True
        seconds = time.perf_counter() - started
        runs.append(BenchmarkRun(name, extra, preset.about if preset else "its own defaults",
                                 seconds, failed))
        print(f"[{label}] {'FAILED' if failed else 'done'} in {duration(seconds)}; the run so "
              f"far {duration(time.perf_counter() - run_started)}", flush=True)
    record = RunRecord(command=command, date=date,
                       benchmark_set="full" if args.full or args.device != "cpu" else "default",
                       device=args.device, benchmarks=runs,
                       wall_s=time.perf_counter() - run_started)
    record.write(args.out)
    failed = [run.name for run in runs if run.failed]
    try:
        for path in write_charts(args.out, expected=[run.name for run in runs if not run.failed]):
            print(f"chart: {path}")
    except Exception:  # reported; the results page and summary still come
        traceback.print_exc()
        failed.append("charts")
    args.results_md.parent.mkdir(parents=True, exist_ok=True)
    args.results_md.write_text(results_markdown(args.out))
    print(f"results page: {args.results_md}\n\n{summary_table(args.out)}")
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
