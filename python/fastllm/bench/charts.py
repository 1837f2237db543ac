"""Charts of a results folder: one PNG per benchmark, drawn from its JSON (``<name>.json``, as
``benchmarks/bench_<name>.py`` writes it) and written beside it as ``<name>.png``.

Each chart is titled with what it shows and footed with the machine, the date and the command
of the run that measured it (the JSON's ``machine``, ``date`` and ``command``). A benchmark
without its JSON in the folder gets no chart; one the run was meant to run (``expected``, or
the run record ``benchmarks/run_all.py`` writes, ``run.json``) is named as missing.

    python -m fastllm.bench.charts results                         # results/*.png
    python -m fastllm.bench.charts results --out benchmarks/charts
"""

from __future__ import annotations

import argparse
import json
import math
import textwrap
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fastllm.bench.report import format_cell, machine_summary, rows_where
from fastllm.bench.summary import RunRecord, times

__all__ = ["CHARTS", "Chart", "chart_footer", "main", "render_chart", "write_charts"]

Document = Mapping[str, object]
Row = Mapping[str, object]

FASTLLM = "#1f6feb"  # fastllm's colour in every chart; the peers' and limits' below
PEER = "#d1242f"
SECOND_PEER = "#8c959f"
LIMIT = "#24292f"
SERIES = ("#1f6feb", "#54aeff", "#0a3069", "#bf8700", "#8250df", "#1a7f37", "#cf222e")
WIDTH_IN, HEIGHT_IN, DPI = 11.0, 4.8, 80  # panels side by side
FOOTER_WIDTH = 160  # characters a footer line holds before it wraps
TITLE_CHARS_PER_IN = 13  # of a panel's title
LABEL_WIDTH = 30  # characters of a horizontal bar's label before it wraps


@dataclass(frozen=True)
class Chart:
    """One benchmark's chart: the title above its panels and what draws them from the JSON.

    ``panels`` says how many axes the chart needs for a document (some parts of a run are
    optional); ``draw`` fills them from the document.
    """

    title: str
    panels: Callable[[Document], int]
    draw: Callable[[Sequence[Axes], Document], None]


# ---- shared drawing ----------------------------------------------------------------------------


def bar_groups(ax: Axes, groups: Sequence[str], series: Mapping[str, Sequence[float | None]],
               colors: Mapping[str, str] | None = None, *,
               value_format: Callable[[float], str] = format_cell,
               horizontal: bool = False) -> list[float]:
    """Grouped bars: one group per label in ``groups``, one bar per series in each (a None
    value leaves a gap), each bar labelled with its value; returns the groups' centres."""
    count = max(len(series), 1)
    width = 0.8 / count
    centres = [float(i) for i in range(len(groups))]
    for index, (name, values) in enumerate(series.items()):
        color = (colors or {}).get(name, SERIES[index % len(SERIES)])
        offsets = [c - 0.4 + width * (index + 0.5) for c in centres]
        kept = [(x, v) for x, v in zip(offsets, values) if v is not None]
        if not kept:
            continue
        xs, vs = zip(*kept)
        bars = (ax.barh(xs, vs, height=width, color=color, label=name) if horizontal
                else ax.bar(xs, vs, width=width, color=color, label=name))
        ax.bar_label(bars, labels=[value_format(v) for v in vs], fontsize=7, padding=2)
    if horizontal:
        ax.set_yticks(centres, [textwrap.fill(group, LABEL_WIDTH) for group in groups],
                      fontsize=8)
        ax.invert_yaxis()  # the first group on top
        ax.margins(x=0.15)
    else:
        ax.set_xticks(centres, groups, fontsize=8)
        ax.margins(y=0.15)
    return centres


def parity_line(ax: Axes, *, horizontal: bool = False) -> None:
    """The line at a ratio of 1: above it fastllm is ahead."""
    line = ax.axvline if horizontal else ax.axhline
    line(1.0, color=LIMIT, linewidth=0.8, linestyle="--", label="parity (1x)")


def limit_marks(ax: Axes, centres: Sequence[float], limits: Sequence[float | None],
                label: str, linestyle: str = "-") -> None:
    """A short black line over each group at its limit (a bandwidth bound, say; None: no
    limit measured)."""
    drawn = [(centre, limit) for centre, limit in zip(centres, limits)
             if limit is not None and math.isfinite(limit)]
    for index, (centre, limit) in enumerate(drawn):
        ax.hlines(limit, centre - 0.45, centre + 0.45, color=LIMIT, linewidth=1.6,
                  linestyle=linestyle, label=None if index else label)
    if drawn:  # room above the highest for the legend
        ax.set_ylim(top=max(ax.get_ylim()[1], 1.4 * max(limit for _, limit in drawn)))


def line_series(ax: Axes, xs: Sequence[float], series: Mapping[str, Sequence[float | None]],
                colors: Mapping[str, str] | None = None) -> None:
    """One line with markers per series over ``xs`` on a log-2 axis (a None value is
    skipped)."""
    for index, (name, values) in enumerate(series.items()):
        kept = [(x, v) for x, v in zip(xs, values) if v is not None]
        if kept:
            ax.plot(*zip(*kept), marker="o", label=name,
                    color=(colors or {}).get(name, SERIES[index % len(SERIES)]))
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(xs), [f"{x:g}" for x in xs], fontsize=8)
    ax.minorticks_off()
    ax.set_ylim(bottom=0)


def finish(ax: Axes, title: str, ylabel: str, xlabel: str = "") -> None:
    """The panel's title (wrapped to the panel's width), axis labels, legend and grid."""
    panel_in = ax.get_position().width * WIDTH_IN
    ax.set_title(textwrap.fill(title, int(panel_in * TITLE_CHARS_PER_IN)), fontsize=9)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(axis="y", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, frameon=False)


# ---- the default set's benchmarks ------------------------------------------------------------


def draw_gguf(axes: Sequence[Axes], document: Document) -> None:
    """Decode tokens/s and TTFT per file: fastllm in each dtype, llama.cpp; the read-bandwidth
    limit over each file's decode bars (the copy bandwidth over the bytes a step reads)."""
    rows = document["rows"]
    files = list(dict.fromkeys(row["file"] for row in rows))
    dtypes = list(dict.fromkeys(row["dtype"] for row in rows))
    by = {(row["file"], row["dtype"]): row for row in rows}
    first = {file: next(row for row in rows if row["file"] == file) for file in files}
    for ax, metric, title, unit in (
            (axes[0], "decode_tok_s", "Decode (higher is better)", "tokens/s"),
            (axes[1], "ttft_median_ms", "Time to first token (lower is better)", "ms")):
        series = {f"fastllm {dtype}": [by.get((file, dtype), {}).get(f"fastllm_{metric}")
                                       for file in files] for dtype in dtypes}
        # llama.cpp's calls are the same for every dtype's row of a file.
        series["llama.cpp"] = [first[file][f"llama_cpp_{metric}"] for file in files]
        colors = {"llama.cpp": PEER}
        centres = bar_groups(ax, files, series, colors)
        if metric == "decode_tok_s":
            limit_marks(ax, centres, [first[f]["copy_gbps"] * 1e9 / first[f]["bytes_per_token"]
                                      for f in files],
                        "read-bandwidth limit (copy GB/s / bytes per token)")
        prompt, decoded = first[files[0]]["prompt_len"], first[files[0]]["decode_tokens"]
        finish(ax, f"{title}; {prompt}-token prompt, 1 + {decoded} tokens", unit)


def serve_panels(document: Document) -> int:
    """Two panels for the levels (where the run had them), one for data parallelism (where
    it had it)."""
    return (2 * bool(rows_where(document, table="levels"))
            + bool(rows_where(document, table="data_parallel")))


def draw_serve(axes: Sequence[Axes], document: Document) -> None:
    """Output tokens/s and median TTFT against concurrency, per server; the data-parallel
    section's output tokens/s per workload, per server."""
    levels = rows_where(document, table="levels")
    if levels:
        concurrencies = sorted({row["concurrency"] for row in levels})
        servers = list(dict.fromkeys(row["server"] for row in levels))
        by = {(row["server"], row["concurrency"]): row for row in levels}
        colors = {servers[0]: FASTLLM, **{name: PEER for name in servers[1:]}}
        for ax, metric, title, unit in (
                (axes[0], "output_tok_s", "Output throughput (higher is better)", "tokens/s"),
                (axes[1], "ttft_p50_ms", "Median time to first token (lower is better)", "ms")):
            line_series(ax, concurrencies, {
                server: [by.get((server, c), {}).get(metric) for c in concurrencies]
                for server in servers}, colors)
            finish(ax, title, unit, "requests in flight at most (concurrency)")
    data_parallel = rows_where(document, table="data_parallel")
    if data_parallel:
        ax = axes[-1]
        workloads = list(dict.fromkeys(row["workload"] for row in data_parallel))
        servers = list(dict.fromkeys(row["server"] for row in data_parallel))
        by = {(row["server"], row["workload"]): row for row in data_parallel}
        colors = {row["server"]: PEER if row["data_parallel_size"] == 1
                  else FASTLLM if row["prefix_affinity"] else SECOND_PEER
                  for row in data_parallel}
        bar_groups(ax, [workload.replace("_", " ") for workload in workloads], {
            server: [by.get((server, workload), {}).get("output_tok_s")
                     for workload in workloads] for server in servers}, colors)
        finish(ax, f"Data parallelism: output throughput, {data_parallel[0]['requests']} "
                   "requests a run (higher is better)", "tokens/s")


def draw_engine(axes: Sequence[Axes], document: Document) -> None:
    """Output tokens/s of fastllm and HF per run (each dtype's throughput section, the LLM
    defaults section); TTFT cold and with the prefix cached, where the run measured it."""
    runs = rows_where(document, section="throughput") + rows_where(document, section="defaults")
    labels = [f"{row['dtype']}, {row['layers']} layers\n{row['num_requests']} requests"
              + ("\nLLM(path) defaults" if row["section"] == "defaults" else "") for row in runs]
    bar_groups(axes[0], labels, {"fastllm": [row["fastllm_tok_s"] for row in runs],
                                 "HF generate": [row["hf_tok_s"] for row in runs]},
               {"fastllm": FASTLLM, "HF generate": PEER})
    finish(axes[0], "Output throughput, all requests at once (higher is better)", "tokens/s")
    prefix = rows_where(document, section="prefix")
    if prefix:
        bar_groups(axes[1], [row["dtype"] for row in prefix],
                   {"cold": [row["cold_ttft_ms"] for row in prefix],
                    "prefix cached": [row["cached_ttft_ms"] for row in prefix]},
                   {"cold": PEER, "prefix cached": FASTLLM})
        finish(axes[1], f"TTFT with a shared {prefix[0]['prefix_len']}-token system prompt "
                        "(lower is better)", "ms")


def draw_rerank(axes: Sequence[Axes], document: Document) -> None:
    """Pairs/s of the HF recipe and of each rung of fastllm's ladder measured (per dtype), each
    bar labelled with its speed-up over the recipe."""
    rows = document["rows"]
    several_dtypes = len({row["dtype"] for row in rows}) > 1
    ax = axes[0]
    bars = ax.barh(range(len(rows)), [row["pairs_per_s"] for row in rows],
                   color=[PEER if row["competitor"] == "hf" else FASTLLM for row in rows])
    ax.bar_label(bars, labels=[f"{format_cell(row['pairs_per_s'])} "
                               f"({times(row['speedup_vs_hf'])} the recipe)" for row in rows],
                 fontsize=7, padding=2)
    ax.set_yticks(range(len(rows)), [
        textwrap.fill(row["label"] + (f", {row['dtype']}" if several_dtypes else ""),
                      LABEL_WIDTH) for row in rows], fontsize=8)
    ax.invert_yaxis()  # the recipe on top, then the ladder
    ax.margins(x=0.25)
    first = rows[0]
    finish(ax, f"Reranking {first['pairs']} DL19 query-passage pairs, {first['layers']} layers "
               "(higher is better)", "")
    ax.set_xlabel("pairs/s", fontsize=8)


def draw_mask_cache(axes: Sequence[Axes], document: Document) -> None:
    """The share of a naive attention forward that building its causal mask takes, per way of
    building it, against the sequence length."""
    masks = [row for row in rows_where(document, group="mask") if row["method"] != "mask_fused"]
    lengths = sorted({row["len"] for row in masks})
    by = {(row["method"], row["len"]): row for row in masks}
    methods = list(dict.fromkeys(row["method"] for row in masks))
    labels = {row["method"]: row["label"] for row in masks}
    colors = {"mask_elementwise": PEER, "mask_vectorized": SERIES[3], "mask_cached": FASTLLM}
    line_series(axes[0], lengths, {
        labels[m]: [100 * by[(m, n)]["share_of_naive_forward"] if (m, n) in by else None
                    for n in lengths] for m in methods},
        {labels[m]: colors[m] for m in methods if m in colors})
    finish(axes[0], "Causal-mask creation as a share of one attention layer's naive forward "
                    "(fused kernels build none: 0%)", "% of the forward",
           "sequence length L")


def draw_spec(axes: Sequence[Axes], document: Document) -> None:
    """Decode speed-up over plain decoding per task, per method and file."""
    rows = document["rows"]
    tasks = list(dict.fromkeys(row["task"] for row in rows))
    by = {(row["method"], row["file"], row["task"]): row["speedup"] for row in rows}
    series: dict[str, list[float | None]] = {}
    colors: dict[str, str] = {}
    for row in rows:  # one series per method and file, in the rows' order
        label = f"{row['method']} on {row['file']}" + (f", drafted by {row['draft']}"
                                                       if row["draft"] else "")
        series[label] = [by.get((row["method"], row["file"], task)) for task in tasks]
        if row["method"].startswith("llama.cpp"):
            colors[label] = PEER
    bar_groups(axes[0], tasks, series, colors, value_format=times)
    parity_line(axes[0])
    decoded = rows[0]["decode_tokens"]
    finish(axes[0], f"Batch-1 greedy decode of 1 + {decoded} tokens: speculative over plain "
                    "tokens/s (higher is better)", "speed-up")


# ---- the other benchmarks (--full, and the GPU runs) -------------------------------------------


def draw_attention(axes: Sequence[Axes], document: Document) -> None:
    """Prefill TFLOP/s of fastllm and SDPA against the length; decode GB/s of fastllm against
    the memory copy, per batch."""
    prefill = rows_where(document, phase="prefill")
    decode = rows_where(document, phase="decode")
    panels = iter(axes)
    if prefill:
        ax = next(panels)
        cases = list(dict.fromkeys((row["model"], row["dtype"]) for row in prefill))
        lengths = sorted({row["len_q"] for row in prefill})
        by = {(row["model"], row["dtype"], row["len_q"]): row for row in prefill}
        series, colors = {}, {}
        for index, (model, dtype) in enumerate(cases):  # fastllm in blues, SDPA in red, grey
            for key, name, color in (("fastllm", "fastllm", SERIES[index % len(SERIES)]),
                                     ("sdpa", "SDPA", PEER if index == 0 else SECOND_PEER)):
                label = f"{name} {model} {dtype}"
                series[label] = [by.get((model, dtype, n), {}).get(f"{key}_tflops")
                                 for n in lengths]
                colors[label] = color
        line_series(ax, lengths, series, colors)
        finish(ax, "Causal prefill of one sequence (higher is better)", "TFLOP/s",
               "sequence length L")
    if decode:
        ax = next(panels)
        labels = [f"{row['model']} {row['dtype']} b{row['batch']}" for row in decode]
        centres = bar_groups(ax, labels, {"fastllm": [row["fastllm_gbps"] for row in decode]},
                             {"fastllm": FASTLLM})
        limit_marks(ax, centres, [row.get("memcpy_gbps") for row in decode], "memory copy")
        finish(ax, f"Decode over {decode[0]['len_k']} keys (higher is better)", "GB/s")


def draw_kv_cache(axes: Sequence[Axes], document: Document) -> None:
    """Decode GB/s of the paged pool and the contiguous cache per case (the memory copy over
    each, where measured); the KV-reuse speed-ups."""
    decode = [row for row in document["rows"] if "paged_vs_contiguous" in row]
    labels = [f"{row['dtype']} b{row['batch']} {row['keys']} keys" for row in decode]
    centres = bar_groups(axes[0], labels, {
        "paged": [row["paged_gbps"] for row in decode],
        "contiguous": [row["contiguous_gbps"] for row in decode]},
        {"paged": FASTLLM, "contiguous": SECOND_PEER})
    limit_marks(axes[0], centres, [row.get("copy_gbps") for row in decode], "memory copy")
    finish(axes[0], "Decode attention: paged pool against a contiguous cache (higher is "
                    "better)", "GB/s")
    reuse = [row for row in document["rows"] if "method_ms" in row]
    if reuse:
        bar_groups(axes[1], [f"{row['case']}: {row['method']}" for row in reuse],
                   {"speed-up": [row["speedup"] for row in reuse]}, {"speed-up": FASTLLM},
                   value_format=times, horizontal=True)
        parity_line(axes[1], horizontal=True)
        finish(axes[1], "KV reuse: time to first token, peer over method (higher is better)",
               "")


def draw_sampling(axes: Sequence[Axes], document: Document) -> None:
    """fastllm.ops.sample's speed-up over the HF chain per setting and batch (the largest
    vocabulary measured)."""
    vocab = max(row["vocab"] for row in document["rows"])
    rows = rows_where(document, vocab=vocab)
    settings = list(dict.fromkeys(row["setting"] for row in rows))
    batches = sorted({row["batch"] for row in rows})
    by = {(row["setting"], row["batch"]): row["speedup_vs_hf"] for row in rows}
    bar_groups(axes[0], settings, {f"batch {b}": [by.get((s, b)) for s in settings]
                                   for b in batches}, value_format=times)
    parity_line(axes[0])
    axes[0].set_yscale("log")
    finish(axes[0], f"Sampling one token per row, vocabulary {vocab}: fastllm over the HF "
                    "logits-processor chain (higher is better)", "speed-up")


def draw_moe(axes: Sequence[Axes], document: Document) -> None:
    """fastllm.ops.moe's speed-up over per-expert ops and over HF eager, per format and token
    count."""
    rows = document["rows"]
    formats = list(dict.fromkeys(row["format"] for row in rows))
    tokens = sorted({row["tokens"] for row in rows})
    by = {(row["format"], row["tokens"]): row for row in rows}
    for ax, key, peer in ((axes[0], "speedup_vs_per_expert", "per-expert ops"),
                          (axes[1], "speedup_vs_hf", "HF eager")):
        bar_groups(ax, [f"{t} token{'s' if t > 1 else ''}" for t in tokens], {
            fmt: [by.get((fmt, t), {}).get(key) for t in tokens] for fmt in formats},
            value_format=times)
        parity_line(ax)
        finish(ax, f"One MoE layer: fastllm over {peer} (higher is better)", "speed-up")


def decode_bars(ax: Axes, rows: Sequence[Row]) -> list[float]:
    """Batch-1 decode tokens/s of fastllm and HF per dtype; returns the groups' centres."""
    return bar_groups(ax, [row["dtype"] for row in rows], {
        "fastllm": [row["fastllm_decode_tok_s"] for row in rows],
        "HF generate": [row["hf_decode_tok_s"] for row in rows]},
        {"fastllm": FASTLLM, "HF generate": PEER})


def draw_generate(axes: Sequence[Axes], document: Document) -> None:
    """Batch-1 decode tokens/s of fastllm and HF per dtype with the read-bandwidth limit of
    the weights a step reads; TTFT of each."""
    rows = document["rows"]
    centres = decode_bars(axes[0], rows)
    limit_marks(axes[0], centres, [row["copy_gbps"] * 1e9 / row["weight_bytes"] for row in rows],
                "read-bandwidth limit (copy GB/s / weight bytes)")
    finish(axes[0], "Batch-1 greedy decode (higher is better)", "tokens/s")
    bar_groups(axes[1], [row["dtype"] for row in rows], {
        "fastllm": [row["fastllm_ttft_median_ms"] for row in rows],
        "HF generate": [row["hf_ttft_median_ms"] for row in rows]},
        {"fastllm": FASTLLM, "HF generate": PEER})
    finish(axes[1], "Time to first token (lower is better)", "ms")


def draw_moe_decode(axes: Sequence[Axes], document: Document) -> None:
    """Batch-1 MoE decode tokens/s of fastllm and HF per dtype, with two read-bandwidth limits:
    a step reading the chosen experts' weights, and one reading every expert's (fastllm above
    that one reads only the chosen experts)."""
    rows = document["rows"]
    centres = decode_bars(axes[0], rows)
    limit_marks(axes[0], centres, [row["copy_gbps"] / row["step_read_gb"] for row in rows],
                "read-bandwidth limit, chosen experts (copy GB/s / GB a step reads)")
    limit_marks(axes[0], centres, [row["dense_equivalent_tok_s"] for row in rows],
                "read-bandwidth limit, every expert (dense equivalent)", linestyle=":")
    finish(axes[0], f"Batch-1 greedy decode, {rows[0]['experts_per_token']} of "
                    f"{rows[0]['num_experts']} experts a token (higher is better)", "tokens/s")


def draw_lora(axes: Sequence[Axes], document: Document) -> None:
    """Output tokens/s of fastllm with the adapters, the base model alone, the LoRA engine
    without adapters and HF + peft, with the goal's share of the base's over them."""
    runs = rows_where(document, section="throughput")
    labels = [f"{row['num_requests']} requests, {row['adapters']} adapters\n"
              f"{row['weights']} weights, a {row['layers']}-layer model" for row in runs]
    series = {"fastllm, base model": "base_tok_s", "fastllm, adapters": "lora_tok_s",
              "fastllm LoRA engine, no adapter": "lora_no_adapter_tok_s",
              "HF + peft": "hf_peft_tok_s"}
    centres = bar_groups(axes[0], labels,
                         {name: [row[key] for row in runs] for name, key in series.items()},
                         {"fastllm, base model": SERIES[1], "fastllm, adapters": FASTLLM,
                          "fastllm LoRA engine, no adapter": SERIES[2], "HF + peft": PEER})
    goal = runs[0]["goal_lora_vs_base"]
    limit_marks(axes[0], centres, [goal * row["base_tok_s"] for row in runs],
                f"goal with adapters: {goal:g}x the base model's", linestyle="--")
    finish(axes[0], f"Output throughput, all requests at once, request i on adapter i % "
                    f"{runs[0]['adapters']} (higher is better)", "tokens/s")


def draw_checkpoints(axes: Sequence[Axes], document: Document) -> None:
    """Batch-1 decode tokens/s and TTFT of fastllm on the W4A16 checkpoint and on the Q4_0
    GGUF, and of HF on the same checkpoint (in each dtype it ran)."""
    rows = document["rows"]
    series = {"fastllm, W4A16": "w4a16", "fastllm, Q4_0 GGUF": "q4_0_gguf",
              "HF, same folder": "hf", "HF in float32": "hf_float32"}
    series = {label: name for label, name in series.items()
              if any(f"{name}_decode_tok_s" in row for row in rows)}
    colours = dict(zip(series, (FASTLLM, SERIES[1], PEER, SECOND_PEER)))
    labels = [f"{row['layers']} layers, {row['dtype']}" for row in rows]
    for ax, column, title, unit in (
            (axes[0], "decode_tok_s", "Batch-1 greedy decode (higher is better)", "tokens/s"),
            (axes[1], "ttft_median_ms", f"TTFT, a {rows[0]['prompt_len']}-token prompt (lower "
                                        "is better)", "ms")):
        bar_groups(ax, labels, {label: [row.get(f"{name}_{column}") for row in rows]
                                for label, name in series.items()}, colours)
        finish(ax, title, unit)


CHARTS: dict[str, Chart] = {
    "gguf": Chart("Batch-1 generation from GGUF files: fastllm against llama.cpp",
                  lambda document: 2, draw_gguf),
    "serve": Chart("Serving streamed completions: fastllm serve against llama.cpp's server",
                   serve_panels, draw_serve),
    "engine": Chart("Continuous batching: fastllm.LLM against HF generate",
                    lambda document: 1 + bool(rows_where(document, section="prefix")),
                    draw_engine),
    "rerank": Chart("Reranking: fastllm.Reranker's techniques against the HF recipe",
                    lambda document: 1, draw_rerank),
    "mask_cache": Chart("The mask cache: what building a causal mask costs a forward",
                        lambda document: 1, draw_mask_cache),
    "spec": Chart("Speculative decoding: speed-up per workload", lambda document: 1, draw_spec),
    "attention": Chart("Attention: fastllm.ops.attention against SDPA",
                       lambda document: bool(rows_where(document, phase="prefill"))
                       + bool(rows_where(document, phase="decode")), draw_attention),
    "kv_cache": Chart("KV cache: paged decode and KV reuse",
                      lambda document: 1 + any("method_ms" in row for row in document["rows"]),
                      draw_kv_cache),
    "sampling": Chart("Sampling: fastllm.ops.sample against HF's logits processors",
                      lambda document: 1, draw_sampling),
    "moe": Chart("Mixture of experts: fastllm.ops.moe", lambda document: 2, draw_moe),
    "generate": Chart("Batch-1 generation: fastllm.LLM against HF generate",
                      lambda document: 2, draw_generate),
    "moe_decode": Chart("Mixture-of-experts decode at batch 1: fastllm.LLM against HF generate",
                        lambda document: 1, draw_moe_decode),
    "lora": Chart("Multi-LoRA serving: fastllm.LLM with adapters against the base model and "
                  "HF + peft", lambda document: 1, draw_lora),
    "checkpoints": Chart("A W4A16 compressed-tensors checkpoint on the CPU: fastllm against "
                         "its Q4_0 GGUF and HF transformers", lambda document: 2,
                         draw_checkpoints),
}


def chart_footer(document: Document) -> str:
    """The machine, the date and the command of the run that measured ``document``."""
    command = (f"{document.get('date', 'date not recorded')}: "
               f"{document.get('command', 'command not recorded')}")
    return "\n".join([machine_summary(document["machine"]),
                      *textwrap.wrap(command, FOOTER_WIDTH, break_on_hyphens=False)])


def render_chart(chart: Chart, document: Document, path: Path) -> None:
    """Draws ``chart`` from ``document`` into the PNG ``path``."""
    figure = Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, chart.panels(document), squeeze=False)[0]
    chart.draw(axes, document)
    figure.suptitle(chart.title, fontsize=11, fontweight="bold")
    figure.supxlabel(chart_footer(document), fontsize=7, color=SECOND_PEER)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")


def write_charts(results: Path, out: Path | None = None,
                 expected: Collection[str] = ()) -> list[Path]:
    """Writes ``<out>/<name>.png`` for each benchmark whose ``<name>.json`` is in ``results``
    (``out`` defaults to ``results``); a name in ``expected`` without its JSON is reported.
    Returns the paths written."""
    out = results if out is None else out
    written = []
    for name, chart in CHARTS.items():
        source = results / f"{name}.json"
        if not source.is_file():
            if name in expected:
                print(f"charts: no {name} chart, {source} is missing")
            continue
        path = out / f"{name}.png"
        render_chart(chart, json.loads(source.read_text()), path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    """Writes the charts of a results folder; returns their paths."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="folder of the benchmarks' JSON")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the PNG files (default: the results folder)")
    args = parser.parse_args(argv)
    record = RunRecord.read(args.results)
    expected = [entry.name for entry in record.benchmarks] if record else []
    written = write_charts(args.results, args.out, expected)
    for path in written:
        print(f"charts: wrote {path}")
    return written


if __name__ == "__main__":
    main()
