"""fastllm.ops.attention against SDPA and the HF transformers path, prefill and decode.

Model-shaped heads (Qwen3-0.6B: 16 query / 8 KV heads, Llama-3-8B: 32 / 8, head_dim 128) in
float32 and bfloat16. Per case, interleaved in one process:

- fastllm: ``fastllm.ops.attention`` on the packed varlen layout;
- SDPA: ``scaled_dot_product_attention`` with ``enable_gqa=True`` (``is_causal`` for prefill;
  a decode query sees every key, so no mask);
- HF: what transformers' llama attention does: ``repeat_kv`` copies K/V to every query head,
  an additive mask is built for the call (causal ``[L, L]`` for prefill, zeros ``[1, Lk]`` for
  decode) and SDPA runs with it.

Prefill reports fastllm's GFLOP/s (causal: ``2 * H * D * L^2`` flops); decode reports its GB/s
(K and V read, q read, out written) beside a memory copy timed in the same rounds.

    python benchmarks/bench_attention.py --out results --prefill-lengths 512 2048
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
from fastllm.bench.report import markdown_table, publish
from fastllm.bench.timer import TimerConfig, Timing, compare
from fastllm.bench.workloads import (MODEL_SHAPES, AttentionInputs, add_shape_arguments,
                                     make_attention_inputs, repeat_kv)

MEMCPY = "memcpy"


@dataclass(frozen=True)
class AttentionCase:
    """One measured configuration: ``batch`` sequences of ``len_q`` queries and ``len_k`` keys."""

    model: str
    dtype: str
    phase: str  # "prefill" (len_q == len_k, causal) or "decode" (one query)
    batch: int
    len_q: int
    len_k: int


@dataclass(frozen=True)
class AttentionBenchConfig:
    """What the attention benchmark measures."""

    models: tuple[str, ...] = ("qwen3-0.6b", "llama-3-8b")
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    prefill_lengths: tuple[int, ...] = (512, 2048, 8192)
    decode_batches: tuple[int, ...] = (1, 8)
    decode_len_k: int = 4096
    memcpy_mb: int = 256
    device: str = "cpu"
    # A call at L=8192 lasts seconds: past the budget, its first call is its only one, which
    # keeps the default run within a few minutes on two cores.
    timer: TimerConfig = field(default_factory=lambda: TimerConfig(warmup=2, repeats=10,
                                                                   budget_s=1.0))

    def cases(self) -> list[AttentionCase]:
        """Every case, shortest prefill first per model and dtype, then decode."""
        cases = []
        for model in self.models:
            for dtype in self.dtypes:
                cases += [AttentionCase(model, dtype, "prefill", 1, length, length)
                          for length in self.prefill_lengths]
                cases += [AttentionCase(model, dtype, "decode", batch, 1, self.decode_len_k)
                          for batch in self.decode_batches]
        return cases


def hf_attention(inputs: AttentionInputs, group: int, *, causal: bool) -> Tensor:
    """HF transformers' path: a fresh additive mask, K/V repeated to all heads, then SDPA."""
    q = inputs.q_bhld  # [B, H, Lq, D]
    if causal:
        mask = fastllm.reference.causal_mask(inputs.len_q, inputs.len_k, dtype=q.dtype,
                                             device=q.device)  # [Lq, Lk]
    else:
        mask = torch.zeros(1, inputs.len_k, dtype=q.dtype, device=q.device)  # [1, Lk]
    return F.scaled_dot_product_attention(q, repeat_kv(inputs.k_bhld, group),
                                          repeat_kv(inputs.v_bhld, group), attn_mask=mask)


def attention_competitors(inputs: AttentionInputs, group: int, *, causal: bool
                          ) -> dict[str, Callable[[], object]]:
    """One call of fastllm, SDPA and the HF path on the same inputs."""
    return {
        "fastllm": lambda: fastllm.ops.attention(inputs.q, inputs.k, inputs.v,
                                                 inputs.cu_seqlens_q, inputs.cu_seqlens_k,
                                                 inputs.len_q, inputs.len_k, causal=causal),
        "sdpa": lambda: F.scaled_dot_product_attention(inputs.q_bhld, inputs.k_bhld,
                                                       inputs.v_bhld, is_causal=causal,
                                                       enable_gqa=True),
        "hf": lambda: hf_attention(inputs, group, causal=causal),
    }


def case_row(case: AttentionCase, inputs: AttentionInputs, timings: dict[str, Timing],
             memcpy_bytes: int) -> dict[str, object]:
    """The JSON row of one case: its fields, each method's timing, ratios and throughput."""
    row: dict[str, object] = dict(vars(case))
    for name, timing in timings.items():
        row.update({f"{name}_{key}": value for key, value in timing.to_dict().items()})
    fastllm_s = timings["fastllm"].median_s
    row["speedup_vs_sdpa"] = timings["sdpa"].median_s / fastllm_s
    row["speedup_vs_hf"] = timings["hf"].median_s / fastllm_s
    q = inputs.q
    n_heads, head_dim = q.shape[1], q.shape[2]
    if case.phase == "prefill":
        causal_flops = 2 * n_heads * head_dim * case.len_q * case.len_k  # QK^T + PV, half kept
        row["fastllm_gflops"] = causal_flops / fastllm_s / 1e9
    else:
        moved = (inputs.k.nbytes + inputs.v.nbytes  # read once
                 + 2 * q.nbytes)  # q read, out written
        row["fastllm_gbps"] = moved / fastllm_s / 1e9
        row["memcpy_gbps"] = 2 * memcpy_bytes / timings[MEMCPY].median_s / 1e9  # read + write
        row["fraction_of_memcpy"] = row["fastllm_gbps"] / row["memcpy_gbps"]
    return row


def run(config: AttentionBenchConfig) -> list[dict[str, object]]:
    """Times every case; returns the JSON rows."""
    device = torch.device(config.device)
    copy_elements = config.memcpy_mb * 2**20 // 4 if config.decode_batches else 0  # float32
    copy_src = torch.randn(copy_elements, device=device)
    copy_dst = torch.empty_like(copy_src)
    rows: list[dict[str, object]] = []
    for case in config.cases():
        torch.manual_seed(0)
        shape = MODEL_SHAPES[case.model]
        inputs = make_attention_inputs(shape, batch=case.batch, len_q=case.len_q,
                                       len_k=case.len_k, dtype=getattr(torch, case.dtype),
                                       device=device)
        competitors = attention_competitors(inputs, shape.group, causal=case.phase == "prefill")
        if case.phase == "decode":
            competitors[MEMCPY] = lambda: copy_dst.copy_(copy_src)
        timings = compare(competitors, config.timer, device=device)
        rows.append(case_row(case, inputs, timings, copy_src.nbytes))
        print(f"attention: {case.model} {case.dtype} {case.phase} batch={case.batch} "
              f"len_q={case.len_q} len_k={case.len_k} measured", flush=True)
    return rows


def tables(rows: list[dict[str, object]]) -> dict[str, str]:
    """The markdown tables of the report, by title."""
    common = {"model": "model", "dtype": "dtype"}
    times = {"fastllm_median_ms": "fastllm (ms)", "sdpa_median_ms": "SDPA (ms)",
             "hf_median_ms": "HF (ms)", "speedup_vs_sdpa": "speedup vs SDPA",
             "speedup_vs_hf": "speedup vs HF"}
    prefill_columns = common | {"len_q": "L"} | times | {"fastllm_gflops": "fastllm GFLOP/s"}
    decode_columns = common | {"batch": "batch", "len_k": "keys"} | times | {
        "fastllm_gbps": "fastllm GB/s", "memcpy_gbps": "memcpy GB/s",
        "fraction_of_memcpy": "fastllm / memcpy"}
    return {
        "Prefill, one causal sequence (speedup > 1: fastllm faster)":
            markdown_table([row for row in rows if row["phase"] == "prefill"], prefill_columns),
        "Decode, one query per sequence (speedup > 1: fastllm faster)":
            markdown_table([row for row in rows if row["phase"] == "decode"], decode_columns),
    }


def parse_args(argv: list[str] | None) -> tuple[AttentionBenchConfig, Path]:
    """The config and output folder from the command line."""
    defaults = AttentionBenchConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser, benchmark="attention", models=defaults.models,
                        dtypes=defaults.dtypes)
    parser.add_argument("--prefill-lengths", type=int, nargs="*",
                        default=list(defaults.prefill_lengths),
                        help="prefill sequence lengths; none to skip prefill (default "
                             "%(default)s)")
    parser.add_argument("--decode-batches", type=int, nargs="*",
                        default=list(defaults.decode_batches),
                        help="decode batch sizes; none to skip decode (default %(default)s)")
    parser.add_argument("--decode-len-k", type=int, default=defaults.decode_len_k,
                        help="keys per decode sequence (default %(default)s)")
    parser.add_argument("--device", default=defaults.device, help="default %(default)s")
    TimerConfig.add_arguments(parser, defaults.timer)
    args = parser.parse_args(argv)
    config = AttentionBenchConfig(
        models=tuple(args.models), dtypes=tuple(args.dtypes),
        prefill_lengths=tuple(args.prefill_lengths), decode_batches=tuple(args.decode_batches),
        decode_len_k=args.decode_len_k, device=args.device,
        timer=TimerConfig.from_arguments(args),
    )
    return config, args.out


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Runs the benchmark, writes ``attention.json`` and ``attention.md``, prints the tables;
    returns the JSON document."""
    config, out = parse_args(argv)
    with torch.inference_mode():
        rows = run(config)
    return publish(benchmark="attention", device=config.device, config=config, rows=rows,
                   tables=tables(rows), out=out)


if __name__ == "__main__":
    main()
