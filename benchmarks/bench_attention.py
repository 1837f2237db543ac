"""fastllm.ops.attention against SDPA and the HF transformers path, prefill and decode.

Model-shaped heads (Qwen3-0.6B: 16 query / 8 KV heads, Llama-3-8B: 32 / 8, head_dim 128). Per
case, interleaved in one process:

- fastllm: ``fastllm.ops.attention`` on the packed varlen layout;
- SDPA: ``scaled_dot_product_attention`` with ``enable_gqa=True`` (``is_causal`` for prefill;
  a decode query sees every key, so no mask), on the backend torch picks or, with
  ``--sdpa-backend``, the one forced by ``torch.nn.attention.sdpa_kernel`` inside the timed call
  (a few microseconds of Python on the host, which shows only at the shortest lengths). A
  forced backend that refuses ``enable_gqa`` is given K/V repeated to every query head
  instead, built once outside the timing; each row says which (``sdpa_kv``);
- HF: what transformers' llama attention does: ``repeat_kv`` copies K/V to every query head,
  an additive mask is built for the call (causal ``[L, L]`` for prefill, zeros ``[1, Lk]`` for
  decode) and SDPA runs with it, on the backend torch picks.

Prefill reports fastllm's and SDPA's TFLOP/s (causal: ``2 * H * D * L^2`` flops per sequence);
decode reports fastllm's GB/s (K and V read, q read, out written) beside a memory copy timed in
the same rounds.

Defaults depend on ``--device``. On the CPU: float32 and bfloat16, prefill L = 512, 2048, 8192,
decode at batch 1 and 8 over 4096 keys, SDPA's own backend choice (sized for two cores). On
CUDA: bfloat16 and float16 (the flash backend takes no float32), prefill L = 512 to 16384, SDPA
forced to its flash backend, no decode cases (paged decode against the copy bandwidth is
bench_kv_cache's). Sizes given on the command line replace the device's.

    python benchmarks/bench_attention.py --out results --prefill-lengths 512 2048
    python benchmarks/bench_attention.py --out results --device cuda
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

import fastllm
from fastllm.bench.report import markdown_table, publish
from fastllm.bench.timer import TimerConfig, Timing, compare
from fastllm.bench.workloads import (MODEL_SHAPES, AttentionInputs, DeviceCopy,
                                     add_shape_arguments, make_attention_inputs, parse_device,
                                     repeat_kv)
from fastllm.ops import reference

MEMCPY = "memcpy"
# --sdpa-backend: the backend forced on the SDPA peer; "auto" forces none (torch's choice).
SDPA_BACKENDS: dict[str, SDPBackend | None] = {
    "auto": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


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
    sdpa_backend: str = "auto"  # a key of SDPA_BACKENDS
    # A call at L=8192 lasts seconds: past the budget, its first call is its only one, which
    # keeps the default run within a few minutes on two cores.
    timer: TimerConfig = field(default_factory=lambda: TimerConfig(warmup=2, repeats=10,
                                                                   budget_s=1.0))

    def __post_init__(self) -> None:
        if self.sdpa_backend not in SDPA_BACKENDS:
            raise ValueError(f"sdpa_backend must be one of {sorted(SDPA_BACKENDS)}, "
                             f"got {self.sdpa_backend!r}")

    @classmethod
    def for_device(cls, device: str) -> AttentionBenchConfig:
        """The defaults on ``device``: the class defaults (sized for two CPU cores) except on
        CUDA, where prefill runs from 512 to 16384 tokens in bfloat16 and float16 against
        SDPA's flash backend, decode is left to bench_kv_cache, and calls of milliseconds
        are repeated more."""
        if torch.device(device).type != "cuda":
            return cls(device=device)
        return cls(dtypes=("bfloat16", "float16"),
                   prefill_lengths=(512, 1024, 2048, 4096, 8192, 16384), decode_batches=(),
                   sdpa_backend="flash", device=device,
                   timer=TimerConfig(warmup=3, repeats=20, budget_s=1.0))

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
        mask = reference.causal_mask(inputs.len_q, inputs.len_k, dtype=q.dtype,
                                     device=q.device)  # [Lq, Lk]
    else:
        mask = torch.zeros(1, inputs.len_k, dtype=q.dtype, device=q.device)  # [1, Lk]
    return F.scaled_dot_product_attention(q, repeat_kv(inputs.k_bhld, group),
                                          repeat_kv(inputs.v_bhld, group), attn_mask=mask)


def sdpa_call(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, enable_gqa: bool,
              backend: SDPBackend | None) -> Callable[[], Tensor]:
    """One SDPA call on these tensors, on ``backend`` (None: torch's choice)."""
    def call() -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=enable_gqa)

    if backend is None:
        return call

    def forced() -> Tensor:
        with sdpa_kernel(backend):
            return call()

    return forced


def sdpa_competitor(inputs: AttentionInputs, group: int, *, causal: bool,
                    backend: str) -> tuple[Callable[[], Tensor], str]:
    """The SDPA peer on ``backend`` (a key of ``SDPA_BACKENDS``) and how it reads K/V: "gqa"
    (``enable_gqa=True``, the shared heads read in place) or, where a forced backend refuses
    that, "expanded" (K/V repeated to every query head, here, outside the timing)."""
    forced = SDPA_BACKENDS[backend]
    shared = sdpa_call(inputs.q_bhld, inputs.k_bhld, inputs.v_bhld, causal=causal,
                       enable_gqa=True, backend=forced)
    if forced is None:  # torch's choice always takes enable_gqa
        return shared, "gqa"
    try:
        shared()  # a backend that cannot run these inputs raises "No available kernel"
        return shared, "gqa"
    except RuntimeError:
        k_all = repeat_kv(inputs.k_bhld, group)  # [B, H, Lk, D] copies
        v_all = repeat_kv(inputs.v_bhld, group)
        return sdpa_call(inputs.q_bhld, k_all, v_all, causal=causal, enable_gqa=False,
                         backend=forced), "expanded"


def attention_competitors(inputs: AttentionInputs, group: int, *, causal: bool,
                          sdpa_backend: str) -> tuple[dict[str, Callable[[], object]], str]:
    """One call of fastllm, SDPA and the HF path on the same inputs, and how SDPA reads K/V
    (see :func:`sdpa_competitor`)."""
    sdpa, sdpa_kv = sdpa_competitor(inputs, group, causal=causal, backend=sdpa_backend)
    return {
        "fastllm": lambda: fastllm.ops.attention(inputs.q, inputs.k, inputs.v,
                                                 inputs.cu_seqlens_q, inputs.cu_seqlens_k,
                                                 inputs.len_q, inputs.len_k, causal=causal),
        "sdpa": sdpa,
        "hf": lambda: hf_attention(inputs, group, causal=causal),
    }, sdpa_kv


def case_row(case: AttentionCase, inputs: AttentionInputs, timings: dict[str, Timing],
             memcpy: DeviceCopy | None) -> dict[str, object]:
    """The JSON row of one case: its fields, each method's timing, ratios and throughput
    (decode cases need the copy timed beside them)."""
    row: dict[str, object] = dict(vars(case))
    for name, timing in timings.items():
        row.update({f"{name}_{key}": value for key, value in timing.to_dict().items()})
    fastllm_s = timings["fastllm"].median_s
    row["speedup_vs_sdpa"] = timings["sdpa"].median_s / fastllm_s
    row["speedup_vs_hf"] = timings["hf"].median_s / fastllm_s
    n_heads, head_dim = inputs.q.shape[1], inputs.q.shape[2]
    if case.phase == "prefill":
        # QK^T and PV, 2 * D flops each per (query, key) pair, half the pairs kept by the mask.
        causal_flops = 2 * case.batch * n_heads * head_dim * case.len_q * case.len_k
        for name in ("fastllm", "sdpa"):
            row[f"{name}_tflops"] = causal_flops / timings[name].median_s / 1e12
    else:
        row["fastllm_gbps"] = inputs.io_bytes / fastllm_s / 1e9
        row["memcpy_gbps"] = memcpy.gbps(timings[MEMCPY])
        row["fraction_of_memcpy"] = row["fastllm_gbps"] / row["memcpy_gbps"]
    return row


def run(config: AttentionBenchConfig) -> list[dict[str, object]]:
    """Times every case; returns the JSON rows."""
    device = torch.device(config.device)
    memcpy = DeviceCopy.of_mib(config.memcpy_mb, device) if config.decode_batches else None
    rows: list[dict[str, object]] = []
    for case in config.cases():
        torch.manual_seed(0)
        shape = MODEL_SHAPES[case.model]
        inputs = make_attention_inputs(shape, batch=case.batch, len_q=case.len_q,
                                       len_k=case.len_k, dtype=getattr(torch, case.dtype),
                                       device=device)
        competitors, sdpa_kv = attention_competitors(
            inputs, shape.group, causal=case.phase == "prefill", sdpa_backend=config.sdpa_backend)
        if case.phase == "decode":
            competitors[MEMCPY] = memcpy
        # As the engine calls the ops: index values checked where they were built, so a GPU op
        # does not copy them back to check them (a wait for the device per call).
        with fastllm.ops.trusted_inputs():
            timings = compare(competitors, config.timer, device=device)
        row = case_row(case, inputs, timings, memcpy)
        row.update(sdpa_backend=config.sdpa_backend, sdpa_kv=sdpa_kv)
        rows.append(row)
        figure = (f"fastllm {row['fastllm_tflops']:.3g} TFLOP/s" if case.phase == "prefill"
                  else f"fastllm {row['fraction_of_memcpy']:.3g} of memcpy")
        print(f"attention: {case.model} {case.dtype} {case.phase} batch={case.batch} "
              f"len_q={case.len_q} len_k={case.len_k} measured: {figure}, "
              f"{row['speedup_vs_sdpa']:.3g}x SDPA ({config.sdpa_backend}, K/V {sdpa_kv})",
              flush=True)
    return rows


def tables(rows: list[dict[str, object]]) -> dict[str, str]:
    """The markdown tables of the report, by title."""
    common = {"model": "model", "dtype": "dtype"}
    times = {"fastllm_median_ms": "fastllm (ms)", "sdpa_median_ms": "SDPA (ms)",
             "hf_median_ms": "HF (ms)", "speedup_vs_sdpa": "speedup vs SDPA",
             "speedup_vs_hf": "speedup vs HF"}
    sdpa = {"sdpa_backend": "SDPA backend", "sdpa_kv": "SDPA K/V"}
    prefill_columns = common | {"len_q": "L"} | times | {
        "fastllm_tflops": "fastllm TFLOP/s", "sdpa_tflops": "SDPA TFLOP/s"} | sdpa
    decode_columns = common | {"batch": "batch", "len_k": "keys"} | times | {
        "fastllm_gbps": "fastllm GB/s", "memcpy_gbps": "memcpy GB/s",
        "fraction_of_memcpy": "fastllm / memcpy"} | sdpa
    about = ("SDPA backend: auto is torch's choice, any other was forced with sdpa_kernel. "
             "SDPA K/V: gqa is enable_gqa=True (the shared K/V heads read in place); expanded, "
             "K/V repeated to every query head outside the timing, because the forced backend "
             "refused enable_gqa.")
    return {
        "Prefill, one causal sequence (speedup > 1: fastllm faster)":
            about + "\n\n" + markdown_table([row for row in rows if row["phase"] == "prefill"],
                                            prefill_columns),
        "Decode, one query per sequence (speedup > 1: fastllm faster)":
            markdown_table([row for row in rows if row["phase"] == "decode"], decode_columns),
    }


def parse_args(argv: list[str] | None) -> tuple[AttentionBenchConfig, Path]:
    """The config and output folder from the command line."""
    defaults = AttentionBenchConfig.for_device(parse_device(argv))
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
    parser.add_argument("--device", default=defaults.device,
                        help="cpu or cuda; the other defaults depend on it (default "
                             "%(default)s)")
    parser.add_argument("--sdpa-backend", choices=list(SDPA_BACKENDS),
                        default=defaults.sdpa_backend,
                        help="backend forced on the SDPA peer; auto: torch's choice (default "
                             "%(default)s)")
    TimerConfig.add_arguments(parser, defaults.timer)
    args = parser.parse_args(argv)
    config = AttentionBenchConfig(
        models=tuple(args.models), dtypes=tuple(args.dtypes),
        prefill_lengths=tuple(args.prefill_lengths), decode_batches=tuple(args.decode_batches),
        decode_len_k=args.decode_len_k, memcpy_mb=defaults.memcpy_mb, device=args.device,
        sdpa_backend=args.sdpa_backend, timer=TimerConfig.from_arguments(args),
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
