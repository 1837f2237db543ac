"""Where one attention layer's forward spends its time, and what not rebuilding the mask saves.

Reproduces the origin report's table with Qwen3-0.6B attention shapes (hidden 1024, 16 query
heads, 8 KV heads, head_dim 128): per sequence length L, the layer's components (RoPE, QKV
projection, attention scores, causal-mask creation four ways) and full attention four ways
(naive with a fresh mask, naive with the cached mask, SDPA, fastllm). Everything measured at
one L is timed interleaved, so the ratios compare methods under the same machine load.

    python benchmarks/bench_mask_cache.py --out results --lengths 1 8 32 128 512 2048
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

import fastllm
from fastllm.bench.report import format_cell, markdown_table, publish
from fastllm.bench.timer import TimerConfig, Timing, compare
from fastllm.bench.workloads import MODEL_SHAPES, AttentionShape, make_attention_inputs, repeat_kv
from fastllm.ops import reference


@dataclass(frozen=True)
class MaskBenchConfig:
    """What the mask-cache benchmark measures."""

    lengths: tuple[int, ...] = (1, 8, 32, 128, 512, 2048)
    model: str = "qwen3-0.6b"
    dtype: str = "float32"
    device: str = "cpu"
    timer: TimerConfig = field(default_factory=lambda: TimerConfig(warmup=2, repeats=30,
                                                                   budget_s=1.0))


@dataclass(frozen=True)
class Method:
    """One measured thing: its key in the JSON rows, its label in tables, its group."""

    key: str
    label: str
    group: str  # "component", "mask" or "attention"


METHODS = (
    Method("rope", "RoPE", "component"),
    Method("qkv_projection", "QKV projection", "component"),
    Method("scores", "scores (repeat_kv + q @ k^T)", "component"),
    Method("mask_elementwise", "mask: element by element", "mask"),
    Method("mask_vectorized", "mask: vectorized (full + triu)", "mask"),
    Method("mask_cached", "mask: MaskCache.get", "mask"),
    Method("mask_fused", "mask: none (fused)", "mask"),
    Method("naive_fresh_mask", "naive, fresh mask", "attention"),
    Method("naive_cached_mask", "naive, cached mask", "attention"),
    Method("sdpa", "SDPA (is_causal)", "attention"),
    Method("fastllm", "fastllm.ops.attention", "attention"),
)
FUSED = "mask_fused"  # no mask exists to time: SDPA and fastllm compute it from indices


def elementwise_causal_mask(length: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The origin report's mask: a nested Python list of 0 / -inf turned into a tensor."""
    rows = [[0.0 if j <= i else float("-inf") for j in range(length)] for i in range(length)]
    return torch.tensor(rows, dtype=dtype, device=device)


def naive_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, group: int) -> Tensor:
    """repeat_kv, scaled q @ k^T plus the additive mask, softmax, @ v.

    q: ``[1, n_heads, L, D]``; k, v: ``[1, n_kv_heads, L, D]``; mask: ``[L, L]``.
    """
    scores = q @ repeat_kv(k, group).transpose(-1, -2) * q.shape[-1] ** -0.5  # [1, H, L, L]
    return (scores + mask).softmax(dim=-1) @ repeat_kv(v, group)  # [1, H, L, D]


def layer_competitors(shape: AttentionShape, length: int, dtype: torch.dtype,
                      device: torch.device, mask_cache: fastllm.MaskCache
                      ) -> dict[str, Callable[[], object]]:
    """One call of each timed method at sequence length ``length``, inputs built here once."""
    inputs = make_attention_inputs(shape, batch=1, len_q=length, len_k=length, dtype=dtype,
                                   device=device)
    q, k, v = inputs.q_bhld, inputs.k_bhld, inputs.v_bhld  # [1, heads, L, D] views
    rope_q, rope_k = inputs.q.clone(), inputs.k.clone()  # rotated in place, call after call
    positions = torch.arange(length, device=device)
    cos_sin = fastllm.ops.rope_cos_sin_cache(length, shape.head_dim, shape.rope_theta,
                                             dtype=dtype, device=device)
    hidden = torch.randn(length, shape.hidden_size, dtype=dtype, device=device)
    qkv_features = (shape.n_heads + 2 * shape.n_kv_heads) * shape.head_dim
    w_qkv = torch.randn(qkv_features, shape.hidden_size, dtype=dtype, device=device)

    def fresh_mask() -> Tensor:
        return reference.causal_mask(length, length, dtype=dtype, device=device)

    def cached_mask() -> Tensor:
        return mask_cache.get(length, length, dtype, device)

    return {
        "rope": lambda: fastllm.ops.rotary_embedding(positions, rope_q, rope_k, cos_sin),
        "qkv_projection": lambda: F.linear(hidden, w_qkv),
        "scores": lambda: q @ repeat_kv(k, shape.group).transpose(-1, -2),
        "mask_elementwise": lambda: elementwise_causal_mask(length, dtype, device),
        "mask_vectorized": fresh_mask,
        "mask_cached": cached_mask,
        "naive_fresh_mask": lambda: naive_attention(q, k, v, fresh_mask(), shape.group),
        "naive_cached_mask": lambda: naive_attention(q, k, v, cached_mask(), shape.group),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                       enable_gqa=True),
        "fastllm": lambda: fastllm.ops.attention(inputs.q, inputs.k, inputs.v,
                                                 inputs.cu_seqlens_q, inputs.cu_seqlens_k,
                                                 length, length),
    }


def rows_for_length(length: int, timings: dict[str, Timing]) -> list[dict[str, object]]:
    """JSON rows for one length: timings plus the ratios each group is judged by.

    Mask rows get ``share_of_naive_forward``: the mask's part of a naive forward that builds
    its mask that way. Vectorized and cached are measured against the naive forward using them;
    the element-by-element forward is not run (it only swaps the mask), so its share is
    ``mask / (mask + naive forward with the cached mask)``. Attention rows get speedups against
    the naive fresh-mask path and against SDPA (> 1: faster).
    """
    medians = {name: timing.median_s for name, timing in timings.items()}
    shares = {
        "mask_elementwise": medians["mask_elementwise"]
        / (medians["mask_elementwise"] + medians["naive_cached_mask"]),
        "mask_vectorized": medians["mask_vectorized"] / medians["naive_fresh_mask"],
        "mask_cached": medians["mask_cached"] / medians["naive_cached_mask"],
        FUSED: 0.0,
    }
    rows: list[dict[str, object]] = []
    for method in METHODS:
        row: dict[str, object] = {"len": length, "group": method.group, "method": method.key,
                                  "label": method.label}
        if method.key == FUSED:
            row.update(median_ms=0.0, note="n/a, fused")
        else:
            row.update(timings[method.key].to_dict())
        if method.group == "mask":
            row["share_of_naive_forward"] = shares[method.key]
        if method.group == "attention":
            row["speedup_vs_naive"] = medians["naive_fresh_mask"] / medians[method.key]
            row["speedup_vs_sdpa"] = medians["sdpa"] / medians[method.key]
        rows.append(row)
    return rows


def run(config: MaskBenchConfig) -> list[dict[str, object]]:
    """Times every method at every length; returns the JSON rows."""
    shape = MODEL_SHAPES[config.model]
    dtype, device = getattr(torch, config.dtype), torch.device(config.device)
    mask_cache = fastllm.MaskCache()
    mask_cache.get(max(config.lengths), max(config.lengths), dtype, device)  # sized once
    rows: list[dict[str, object]] = []
    for length in config.lengths:
        torch.manual_seed(0)
        competitors = layer_competitors(shape, length, dtype, device, mask_cache)
        rows += rows_for_length(length, compare(competitors, config.timer, device=device))
        print(f"mask_cache: L={length} measured", flush=True)
    return rows


def tables(rows: list[dict[str, object]]) -> dict[str, str]:
    """The markdown tables of the report, by title."""
    by_length: dict[int, dict[str, object]] = {}
    shares_by_length: dict[int, dict[str, object]] = {}
    for row in rows:
        length = row["len"]
        by_length.setdefault(length, {"len": length})[row["method"]] = (
            row.get("note") or row["median_ms"]
        )
        if "share_of_naive_forward" in row:
            shares_by_length.setdefault(length, {"len": length})[row["method"]] = (
                100 * row["share_of_naive_forward"]
            )
    component_columns = {"len": "L"} | {method.key: method.label
                                        for method in METHODS if method.group != "attention"}
    share_columns = {"len": "L"} | {method.key: method.label
                                    for method in METHODS if method.group == "mask"}
    attention_rows = [dict(row, spread=f"{format_cell(row['p25_ms'])} - "
                                       f"{format_cell(row['p75_ms'])}")
                      for row in rows if row["group"] == "attention"]
    attention_columns = {"len": "L", "label": "method", "median_ms": "median (ms)",
                         "spread": "p25 - p75 (ms)", "speedup_vs_naive": "speedup vs naive",
                         "speedup_vs_sdpa": "speedup vs SDPA"}
    return {
        "Components of one attention layer's forward (median ms)":
            markdown_table(list(by_length.values()), component_columns),
        "Mask creation as a share of the naive forward (%)":
            markdown_table(list(shares_by_length.values()), share_columns),
        "Full attention (speedup > 1: faster than the naive fresh-mask path / than SDPA)":
            markdown_table(attention_rows, attention_columns),
    }


def parse_args(argv: list[str] | None) -> tuple[MaskBenchConfig, Path]:
    """The config and output folder from the command line."""
    defaults = MaskBenchConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"),
                        help="folder for mask_cache.json and mask_cache.md (default %(default)s)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(defaults.lengths),
                        help="sequence lengths (default %(default)s)")
    parser.add_argument("--device", default=defaults.device, help="default %(default)s")
    TimerConfig.add_arguments(parser, defaults.timer)
    args = parser.parse_args(argv)
    config = MaskBenchConfig(lengths=tuple(args.lengths), device=args.device,
                             timer=TimerConfig.from_arguments(args))
    return config, args.out


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Runs the benchmark, writes ``mask_cache.json`` and ``mask_cache.md``, prints the
    tables; returns the JSON document."""
    config, out = parse_args(argv)
    with torch.inference_mode():
        rows = run(config)
    return publish(benchmark="mask_cache", device=config.device, config=config, rows=rows,
                   tables=tables(rows), out=out)


if __name__ == "__main__":
    main()
