"""What a run of ``benchmarks/run_all.py`` leaves in its results folder beside the benchmarks'
JSON: the run's record (``run.json``: command, date, each benchmark's options and seconds), the
summary table (one headline figure per benchmark, from its JSON) and the detailed results page
(``RESULTS.md``: the summary, the machine, date and command, then each benchmark's tables as it
wrote them beside its JSON, ``<name>.md``, from the same rows).

    python -m fastllm.bench.summary results                  # prints the summary table
    python -m fastllm.bench.summary results --results-md benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fastllm.bench.report import (format_cell, machine_summary, markdown_table, rows_where,
                                  write_json)

__all__ = ["BenchmarkRun", "HEADLINES", "RunRecord", "duration", "main", "results_markdown",
           "summary_table"]

Document = Mapping[str, object]
Headline = tuple[str, str]  # (what the figure is, its value)
RATIOS = ("Ratios are fastllm's figure over its peer's, so above 1 fastllm is ahead (times "
          "to first token: the peer's over fastllm's).")
RUN_RECORD = "run.json"


@dataclass(frozen=True)
class BenchmarkRun:
    """One benchmark of a run: the options it was given, what they measure, how long it took
    and whether it failed."""

    name: str
    args: list[str]
    about: str
    seconds: float
    failed: bool


@dataclass(frozen=True)
class RunRecord:
    """A run of ``run_all.py``: its command line, start date (UTC, ISO 8601), which set it ran
    ("default" or "full"), the device, each benchmark and the run's wall time."""

    command: str
    date: str
    benchmark_set: str
    device: str
    benchmarks: list[BenchmarkRun]
    wall_s: float

    def write(self, results: Path) -> None:
        """Writes ``<results>/run.json``."""
        write_json(results / RUN_RECORD, dataclasses.asdict(self))

    @classmethod
    def read(cls, results: Path) -> RunRecord | None:
        """The record in ``results``, or None where no run of ``run_all.py`` left one."""
        path = results / RUN_RECORD
        if not path.is_file():
            return None
        fields = json.loads(path.read_text())
        return cls(**dict(fields, benchmarks=[BenchmarkRun(**entry)
                                              for entry in fields["benchmarks"]]))


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``."""
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s" if minutes else f"{rest} s"


def times(value: float) -> str:
    """A ratio: ``1.46x``, ``12.6x``, ``0.00350x``."""
    return f"{format_cell(float(value))}x"


def span(values: Sequence[float]) -> str:
    """The range of some ratios: ``0.91x - 3.20x`` (one value: ``1.46x``)."""
    low, high = min(values), max(values)
    return times(low) if low == high else f"{times(low)} - {times(high)}"


# ---- one headline per benchmark: what it was built to show ------------------------------------


def gguf_headline(document: Document) -> list[Headline]:
    """Decode and TTFT against llama.cpp, per file and dtype."""
    return [(f"vs llama.cpp, {row['file']} {row['dtype']}",
             f"decode {times(row['decode_speedup'])}, TTFT {times(row['ttft_speedup'])}")
            for row in document["rows"]]


def serve_headline(document: Document) -> list[Headline]:
    """Output tokens/s against llama.cpp's server, per concurrency; output tokens/s and median
    TTFT of data parallelism, per workload (N replicas over one, prefix affinity over none)."""
    return [(f"output tok/s vs llama.cpp, concurrency {row['concurrency']}",
             times(row["output_tok_s_speedup"])) for row in rows_where(document, table="speedup")
            ] + [(f"{row['comparison']}, {row['workload'].replace('_', ' ')}",
                  f"output tok/s {times(row['output_tok_s_speedup'])}, TTFT p50 "
                  f"{times(row['ttft_p50_speedup'])}")
                 for row in rows_where(document, table="data_parallel_speedup")]


def spec_headline(document: Document) -> list[Headline]:
    """Decode speed-up per task, per method and file."""
    by_method: dict[str, list[str]] = {}
    for row in document["rows"]:
        label = f"{row['method']} on {row['file']}" + (f" (draft {row['draft']})"
                                                       if row["draft"] else "")
        by_method.setdefault(label, []).append(f"{row['task']} {times(row['speedup'])}")
    return [(f"decode speed-up, {label}", ", ".join(found)) for label, found in by_method.items()]


def rerank_headline(document: Document) -> list[Headline]:
    """fastllm.Reranker's pairs/s against the HF recipe, per dtype."""
    return [(f"pairs/s vs HF recipe ({row['dtype']}, {row['layers']} layers, {row['pairs']} "
             "pairs)", times(row["speedup_vs_hf"]))
            for row in rows_where(document, competitor="fastllm")]


def engine_headline(document: Document) -> list[Headline]:
    """Each section's ratio, per dtype: throughput against HF, the prefix cache's TTFT, the
    cost of batch invariance and of tensor parallelism, LLM(path) on its defaults."""
    found = [(f"output tok/s vs HF ({row['dtype']}, {row['num_requests']} requests)",
              times(row["throughput_speedup_vs_hf"]))
             for row in rows_where(document, section="throughput")]
    found += [(f"TTFT cold / prefix cached ({row['dtype']})", times(row["prefix_ttft_ratio"]))
              for row in rows_where(document, section="prefix")]
    found += [(f"batch_invariant=True tok/s / default ({row['dtype']})",
               times(row["invariant_throughput_ratio"]))
              for row in rows_where(document, section="batch_invariant")]
    found += [(f"tensor parallel tok/s / one process ({row['dtype']})",
               times(row["tp_throughput_ratio"]))
              for row in rows_where(document, section="tensor_parallel")]
    found += [("LLM(path) defaults: output tok/s vs HF", times(row["throughput_speedup_vs_hf"]))
              for row in rows_where(document, section="defaults")]
    return found


def mask_cache_headline(document: Document) -> list[Headline]:
    """At the length where building the mask element by element (the origin report's way)
    takes the largest share of a naive forward: that share, the vectorized mask's and the
    cached mask's."""
    masks = rows_where(document, group="mask")
    worst = max((row for row in masks if row["method"] == "mask_elementwise"),
                key=lambda row: row["share_of_naive_forward"])
    shares = {row["method"]: format_cell(100 * row["share_of_naive_forward"])
              for row in masks if row["len"] == worst["len"]}
    return [(f"mask's share of a naive forward, L={worst['len']}",
             f"element by element {shares['mask_elementwise']}%, vectorized "
             f"{shares['mask_vectorized']}%, cached {shares['mask_cached']}%")]


def attention_headline(document: Document) -> list[Headline]:
    """Prefill against SDPA per case; decode against SDPA over all cases."""
    found = [(f"prefill vs SDPA ({row['model']} {row['dtype']} L={row['len_q']})",
              times(row["speedup_vs_sdpa"])) for row in rows_where(document, phase="prefill")]
    decode = rows_where(document, phase="decode")
    if decode:
        found.append(("decode vs SDPA, all cases", span([row["speedup_vs_sdpa"]
                                                         for row in decode])))
    return found


def kv_cache_headline(document: Document) -> list[Headline]:
    """Paged decode against the contiguous cache over all cases; each KV-reuse speed-up."""
    decode = [row["paged_vs_contiguous"] for row in document["rows"]
              if "paged_vs_contiguous" in row]
    reuse = [(f"{row['case']}: {row['method']}", times(row["speedup"]))
             for row in document["rows"] if "method_ms" in row]
    return [("paged decode vs contiguous, all cases", span(decode)), *reuse]


def sampling_headline(document: Document) -> list[Headline]:
    """fastllm.ops.sample against the HF chain over all cases."""
    return [("sample vs HF chain, all cases", span([row["speedup_vs_hf"]
                                                    for row in document["rows"]]))]


def moe_headline(document: Document) -> list[Headline]:
    """fastllm.ops.moe against per-expert ops and HF eager over all cases."""
    rows = document["rows"]
    found = [("moe vs per-expert ops, all cases", span([row["speedup_vs_per_expert"]
                                                         for row in rows]))]
    hf = [row["speedup_vs_hf"] for row in rows if row.get("speedup_vs_hf") is not None]
    if hf:
        found.append(("moe vs HF eager, float formats", span(hf)))
    return found


def generate_headline(document: Document) -> list[Headline]:
    """Decode and TTFT against HF generate, per dtype."""
    return [(f"vs HF ({row['dtype']})", f"decode {times(row['decode_speedup_vs_hf'])}, "
                                        f"TTFT {times(1 / row['ttft_vs_hf'])}")
            for row in document["rows"]]


def moe_decode_headline(document: Document) -> list[Headline]:
    """Decode against HF generate and against the dense-equivalent bound, per dtype."""
    return [(f"decode vs HF ({row['dtype']})", f"{times(row['decode_speedup_vs_hf'])}, "
                                               f"{times(row['vs_dense_equivalent'])} the "
                                               "dense-equivalent bound")
            for row in document["rows"]]


def lora_headline(document: Document) -> list[Headline]:
    """Output tokens/s with the adapters against the base model alone and against HF + peft."""
    found = []
    for row in rows_where(document, section="throughput"):
        about = f"{row['adapters']} adapters, {row['num_requests']} requests"
        found += [(f"output tok/s with adapters / base model ({about})",
                   times(row["lora_vs_base"])),
                  (f"output tok/s with adapters vs HF + peft ({about})",
                   times(row["lora_vs_hf_peft"]))]
    return found


def checkpoints_headline(document: Document) -> list[Headline]:
    """W4A16 checkpoint decode against fastllm's Q4_0 GGUF and HF's best on the folder."""
    return [(f"W4A16 decode vs Q4_0 GGUF ({row['dtype']})", times(row["decode_vs_q4_0"]))
            for row in document["rows"]] + [
        (f"W4A16 decode vs HF, same folder ({row['dtype']}; HF {row['best_hf']})",
         times(row["decode_vs_hf"])) for row in document["rows"]]


HEADLINES: dict[str, Callable[[Document], list[Headline]]] = {
    "gguf": gguf_headline, "engine": engine_headline, "serve": serve_headline,
    "spec": spec_headline, "rerank": rerank_headline, "mask_cache": mask_cache_headline,
    "attention": attention_headline, "kv_cache": kv_cache_headline,
    "sampling": sampling_headline, "moe": moe_headline, "generate": generate_headline,
    "moe_decode": moe_decode_headline, "lora": lora_headline,
    "checkpoints": checkpoints_headline,
}


# ---- the summary and the results page ---------------------------------------------------------


def benchmark_names(results: Path, record: RunRecord | None) -> list[str]:
    """The run's benchmarks in the order they ran, else those with JSON in ``results``."""
    if record is not None:
        return [entry.name for entry in record.benchmarks]
    return [name for name in HEADLINES if (results / f"{name}.json").is_file()]


def summary_table(results: Path) -> str:
    """A markdown table of each benchmark's headline figures and its time, after a line on how
    to read its ratios."""
    record = RunRecord.read(results)
    seconds = {entry.name: entry for entry in record.benchmarks} if record else {}
    rows: list[dict[str, str]] = []
    for name in benchmark_names(results, record):
        entry = seconds.get(name)
        time = duration(entry.seconds) if entry else "n/a"
        source = results / f"{name}.json"
        if entry is not None and entry.failed:
            found = [("failed", "see the run's log")]
        elif not source.is_file():
            found = [("no results", f"{source.name} is missing")]
        else:
            found = HEADLINES[name](json.loads(source.read_text()))
        for index, (figure, value) in enumerate(found):
            rows.append({"benchmark": name if index == 0 else "",
                         "time": time if index == 0 else "", "figure": figure, "value": value})
    if record is not None:
        rows.append({"benchmark": "all", "time": duration(record.wall_s),
                     "figure": f"{record.benchmark_set} set on {record.device}", "value": ""})
    return RATIOS + "\n\n" + markdown_table(rows, {"benchmark": "benchmark", "time": "time",
                                                 "figure": "headline figure", "value": "value"})


def demoted(markdown: str) -> str:
    """A benchmark's report one heading level down, to sit under the results page's own."""
    return re.sub(r"^(#+) ", r"#\1 ", markdown, flags=re.MULTILINE)


def results_markdown(results: Path) -> str:
    """The results page: how the run was made, the summary, what each benchmark ran, then
    every benchmark's tables."""
    record = RunRecord.read(results)
    names = benchmark_names(results, record)
    documents = {name: json.loads((results / f"{name}.json").read_text()) for name in names
                 if (results / f"{name}.json").is_file()}
    lines = ["# Benchmark results", "",
             "Written by `benchmarks/run_all.py` from the results of its run (`run.json`, "
             "each benchmark's JSON and the tables it wrote from it); not edited by hand. "
             "`make bench` runs the default set, `make bench FULL=1` every benchmark at its "
             "own sizes.", ""]
    if record is not None:
        lines += [f"- Command: `{record.command}` ({record.benchmark_set} set, device "
                  f"{record.device})", f"- Date: {record.date}",
                  f"- Wall time: {duration(record.wall_s)}"]
    if documents:
        lines.append(f"- Machine: {machine_summary(next(iter(documents.values()))['machine'])}")
    lines += ["", "## Summary", "", summary_table(results), ""]
    if record is not None:
        lines += ["## What each benchmark ran", "", markdown_table(
            [{"benchmark": entry.name, "about": entry.about,
              "options": "`" + " ".join(entry.args) + "`" if entry.args else "its defaults"}
             for entry in record.benchmarks],
            {"benchmark": "benchmark", "about": "what", "options": "options"}), ""]
    for name in names:
        report = results / f"{name}.md"
        if report.is_file():
            lines += [demoted(report.read_text()).rstrip(), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Prints a results folder's summary table; writes its results page where asked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="folder of the benchmarks' JSON")
    parser.add_argument("--results-md", type=Path, default=None,
                        help="where to write the results page (default: not written)")
    args = parser.parse_args(argv)
    print(summary_table(args.results))
    if args.results_md is not None:
        args.results_md.write_text(results_markdown(args.results))
        print(f"wrote {args.results_md}")


if __name__ == "__main__":
    main()
