"""Paged KV cache against a contiguous one: decode attention through block tables, and memory.

Per case, interleaved in one process:

- contiguous: ``fastllm.ops.attention`` over each sequence's keys stored back to back;
- paged: ``fastllm.ops.paged_attention`` over the same keys scattered in ``block_size`` blocks
  of a shared pool, in shuffled order (as a long-running server's pool ends up).

The ratio is the paged path's speed relative to the contiguous one (goal >= 0.9x). The memory
table gives, per model shape, the KV bytes of one token and of one sequence at the decode length,
for the cache dtype.

    python benchmarks/bench_kv_cache.py --out results
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

import fastllm
from fastllm.bench.report import markdown_table, publish
from fastllm.bench.timer import TimerConfig, compare
from fastllm.bench.workloads import MODEL_SHAPES, add_shape_arguments, make_attention_inputs
from fastllm.kv_cache import KVCacheSpec

GOAL_PAGED_VS_CONTIGUOUS = 0.9


@dataclass(frozen=True)
class KVCacheBenchConfig:
    """What the KV-cache benchmark measures."""

    models: tuple[str, ...] = ("qwen3-0.6b", "llama-3-8b")
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    decode_batches: tuple[int, ...] = (1, 8, 32)
    decode_len_k: int = 4096
    block_size: int = 16
    device: str = "cpu"
    timer: TimerConfig = field(default_factory=lambda: TimerConfig(warmup=2, repeats=20,
                                                                   budget_s=0.5))


@dataclass(frozen=True)
class PagedKV:
    """The same keys and values as a shuffled paged pool with its block tables."""

    k_cache: Tensor  # [num_blocks, block_size, n_kv_heads, head_dim]
    v_cache: Tensor
    block_tables: Tensor  # int32 [batch, blocks_per_seq]
    seq_lens: Tensor  # int32 [batch]


def to_paged(k: Tensor, v: Tensor, batch: int, len_k: int, block_size: int) -> PagedKV:
    """Scatters ``batch`` sequences of ``len_k`` packed keys into shuffled blocks of a pool."""
    blocks_per_seq = -(-len_k // block_size)
    num_blocks = batch * blocks_per_seq
    order = torch.randperm(num_blocks, device=k.device)
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32)
    k_cache = k.new_zeros(num_blocks, block_size, *k.shape[1:])
    v_cache = torch.zeros_like(k_cache)
    positions = torch.arange(len_k, device=k.device)
    slots = (block_tables.long()[:, positions // block_size] * block_size
             + positions % block_size).flatten()  # [batch * len_k], packed order
    fastllm.ops.reshape_and_cache(k, v, k_cache, v_cache, slots)
    seq_lens = torch.full((batch,), len_k, dtype=torch.int32, device=k.device)
    return PagedKV(k_cache, v_cache, block_tables, seq_lens)


def decode_rows(config: KVCacheBenchConfig) -> list[dict[str, object]]:
    """Times contiguous against paged decode attention for every model, dtype and batch."""
    rows = []
    for model in config.models:
        shape = MODEL_SHAPES[model]
        for dtype_name in config.dtypes:
            dtype = getattr(torch, dtype_name)
            for batch in config.decode_batches:
                x = make_attention_inputs(shape, batch=batch, len_q=1, len_k=config.decode_len_k,
                                          dtype=dtype, device=config.device)
                paged = to_paged(x.k, x.v, batch, config.decode_len_k, config.block_size)
                timings = compare({
                    "contiguous": lambda: fastllm.ops.attention(
                        x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, 1, x.len_k),
                    "paged": lambda: fastllm.ops.paged_attention(
                        x.q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens,
                        x.cu_seqlens_q, 1),
                }, config.timer, device=config.device)
                row: dict[str, object] = {"model": model, "dtype": dtype_name, "batch": batch,
                                          "keys": config.decode_len_k,
                                          "block_size": config.block_size}
                for name, timing in timings.items():
                    row.update({f"{name}_{k}": v for k, v in timing.to_dict().items()})
                row["paged_vs_contiguous"] = (timings["contiguous"].median_s
                                              / timings["paged"].median_s)
                rows.append(row)
                print(f"kv_cache: {model} {dtype_name} batch={batch} measured", flush=True)
    return rows


def memory_rows(config: KVCacheBenchConfig) -> list[dict[str, object]]:
    """KV bytes per token and per sequence of decode length, per model shape and dtype."""
    rows = []
    for model in config.models:
        shape = MODEL_SHAPES[model]
        for dtype_name in config.dtypes:
            spec = KVCacheSpec(num_layers=shape.num_layers, n_kv_heads=shape.n_kv_heads,
                               head_dim=shape.head_dim, dtype=getattr(torch, dtype_name),
                               block_size=config.block_size)
            blocks = -(-config.decode_len_k // config.block_size)
            rows.append({"model": model, "dtype": dtype_name,
                         "bytes_per_token": spec.bytes_per_token,
                         "seq_tokens": config.decode_len_k,
                         "mib_per_seq": blocks * spec.bytes_per_block / 2**20})
    return rows


def tables(decode: list[dict[str, object]], memory: list[dict[str, object]]) -> dict[str, str]:
    """The markdown tables of the report, by title."""
    worst = min((row["paged_vs_contiguous"] for row in decode), default=float("nan"))
    verdict = "met" if worst >= GOAL_PAGED_VS_CONTIGUOUS else "NOT met"
    summary = (f"Goal: paged >= {GOAL_PAGED_VS_CONTIGUOUS}x the contiguous cache's speed: "
               f"worst case measured {worst:.2f}x ({verdict}).")
    decode_table = markdown_table(decode, {
        "model": "model", "dtype": "dtype", "batch": "batch", "keys": "keys",
        "block_size": "block size", "contiguous_median_ms": "contiguous (ms)",
        "paged_median_ms": "paged (ms)", "paged_vs_contiguous": "paged speed vs contiguous"})
    memory_table = markdown_table(memory, {
        "model": "model", "dtype": "dtype", "bytes_per_token": "KV bytes per token",
        "seq_tokens": "tokens per sequence", "mib_per_seq": "MiB per sequence"})
    return {"Decode attention: paged pool vs contiguous cache (speed > 1: paged faster)":
            summary + "\n\n" + decode_table,
            "KV memory (all layers, K and V)": memory_table}


def parse_args(argv: list[str] | None) -> tuple[KVCacheBenchConfig, Path]:
    """The config and output folder from the command line."""
    defaults = KVCacheBenchConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser, benchmark="kv_cache", models=defaults.models,
                        dtypes=defaults.dtypes)
    parser.add_argument("--decode-batches", type=int, nargs="+",
                        default=list(defaults.decode_batches), help="default %(default)s")
    parser.add_argument("--decode-len-k", type=int, default=defaults.decode_len_k,
                        help="keys per decode sequence (default %(default)s)")
    parser.add_argument("--block-size", type=int, default=defaults.block_size,
                        help="tokens per cache block (default %(default)s)")
    parser.add_argument("--device", default=defaults.device, help="default %(default)s")
    TimerConfig.add_arguments(parser, defaults.timer)
    args = parser.parse_args(argv)
    config = KVCacheBenchConfig(
        models=tuple(args.models), dtypes=tuple(args.dtypes),
        decode_batches=tuple(args.decode_batches), decode_len_k=args.decode_len_k,
        block_size=args.block_size, device=args.device, timer=TimerConfig.from_arguments(args))
    return config, args.out


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Runs the benchmark, writes ``kv_cache.json`` and ``kv_cache.md``, prints the tables;
    returns the JSON document."""
    config, out = parse_args(argv)
    with torch.inference_mode():
        decode = decode_rows(config)
    memory = memory_rows(config)
    return publish(benchmark="kv_cache", device=config.device, config=config,
                   rows=decode + memory, tables=tables(decode, memory), out=out)


if __name__ == "__main__":
    main()
