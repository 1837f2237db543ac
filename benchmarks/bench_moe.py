"""fastllm.ops.moe against HF transformers' eager experts and against one fastllm op call per
expert, on a Qwen3-30B-A3B-shaped MoE layer.

The experts of Qwen3-30B-A3B (hidden 2048, expert intermediate 768, top 8 of 128 experts,
renormalized) with random weights, per expert format (bfloat16; Q4_K and Q8_0 blocks, the
formats of its GGUF files) and token count (1 and 4: decode; 16 and 64: a verification step, a
chunk of prefill). The router logits are random and given: the router's linear layer is the
caller's. Per case, interleaved in one process:

- fastllm: ``fastllm.ops.moe``;
- per-expert ops: the same arithmetic as fastllm calls op by op, expert by expert
  (``ops.linear`` or ``ops.quantized_linear``, ``ops.silu_and_mul``, the weighted
  ``index_add_``), what a model without the op runs;
- HF eager: transformers' ``Qwen3MoeExperts`` (its loop over the experts that have tokens) on
  the same weights, after HF's routing (softmax, top-k, renormalize); float formats only
  (transformers runs no ggml blocks).

Rows carry the speedups and fastllm's weight bandwidth: the bytes of the experts the tokens
chose (each read once) over its time.

Defaults depend on ``--device``: on the CPU the sizes above (sized for two cores); on
CUDA tokens 1 to 1024. Sizes given on the command line replace the device's.

    python benchmarks/bench_moe.py --out results --tokens 1 16 --formats Q4_K
    python benchmarks/bench_moe.py --out results --device cuda
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from fastllm import ops
from fastllm.bench.report import markdown_table, publish
from fastllm.bench.timer import TimerConfig, compare
from fastllm.bench.workloads import parse_device

COMPETITORS = {"fastllm": "fastllm.ops.moe", "per_expert": "per-expert ops", "hf": "HF eager"}
FLOAT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BLOCK_TYPES = {name: type_id for type_id, (name, _, _) in ops.BLOCK_FORMATS.items()}
# The fp16 fields of each format's blocks (d, and the minimum's scale), at these bytes.
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


@dataclass(frozen=True)
class MoeBenchConfig:
    """What the MoE benchmark measures: Qwen3-30B-A3B's experts by default."""

    tokens: tuple[int, ...] = (1, 4, 16, 64)
    formats: tuple[str, ...] = ("bfloat16", "Q4_K", "Q8_0")
    hidden_size: int = 2048
    intermediate_size: int = 768
    num_experts: int = 128
    top_k: int = 8
    device: str = "cpu"
    timer: TimerConfig = field(default_factory=lambda: TimerConfig(warmup=1, repeats=10,
                                                                   budget_s=1.0))

    @classmethod
    def for_device(cls, device: str) -> MoeBenchConfig:
        """The defaults on ``device``: the class defaults (two CPU cores) except on CUDA, where
        the token counts run to 1024, with more calls timed."""
        if torch.device(device).type != "cuda":
            return cls(device=device)
        return cls(tokens=(1, 4, 16, 64, 256, 1024), device=device,
                   timer=TimerConfig(warmup=3, repeats=30, budget_s=0.5))


@dataclass(frozen=True)
class Experts:
    """One format's expert weights and how fastllm takes them."""

    gate_up: Tensor  # [E, 2I, H] floats, or uint8 blocks [E, 2I, row bytes]
    down: Tensor  # [E, H, I], or uint8 blocks [E, H, row bytes]
    weight_type: int | None  # ggml type id, None for floats
    dtype: torch.dtype  # the activations'

    def expert_bytes(self, e: int) -> int:
        return sum(w[e].numel() * w.element_size() for w in (self.gate_up, self.down))


def random_blocks(rows: int, in_features: int, name: str, device: torch.device) -> Tensor:
    """uint8 [rows, row bytes]: random blocks of format `name` whose fp16 scales are 2^-10 (any
    bits are a valid block; random scale bits could be inf or NaN)."""
    _, values, block_bytes = ops.BLOCK_FORMATS[BLOCK_TYPES[name]]
    blocks = torch.randint(0, 256, (rows, in_features // values, block_bytes), dtype=torch.uint8)
    for at in FP16_FIELDS[name]:
        blocks[..., at:at + 2] = torch.tensor([2**-10], dtype=torch.float16).view(torch.uint8)
    return blocks.view(rows, -1).to(device)


def make_experts(config: MoeBenchConfig, name: str) -> Experts:
    """The layer's experts in format `name`, random, on the config's device."""
    E, H, I = config.num_experts, config.hidden_size, config.intermediate_size
    device = torch.device(config.device)
    if name in FLOAT_FORMATS:
        dtype = FLOAT_FORMATS[name]
        gate_up = torch.empty(E, 2 * I, H, dtype=dtype, device=device).normal_(0, H**-0.5)
        down = torch.empty(E, H, I, dtype=dtype, device=device).normal_(0, I**-0.5)
        return Experts(gate_up, down, None, dtype)
    gate_up = random_blocks(E * 2 * I, H, name, device).view(E, 2 * I, -1)
    down = random_blocks(E * H, I, name, device).view(E, H, -1)
    return Experts(gate_up, down, BLOCK_TYPES[name], torch.bfloat16)


def hf_routing(logits: Tensor, top_k: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Qwen3MoeTopKRouter.forward after its linear layer: (top_k_index, top_k_weights)."""
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    weights, index = torch.topk(probs, top_k, dim=-1)
    weights /= weights.sum(dim=-1, keepdim=True)
    return index, weights.to(dtype)


def hf_experts(config: MoeBenchConfig, experts: Experts) -> torch.nn.Module:
    """transformers' Qwen3MoeExperts on the same weight tensors (no copy), eager."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    hf_config = Qwen3MoeConfig(hidden_size=config.hidden_size,
                               moe_intermediate_size=config.intermediate_size,
                               num_experts=config.num_experts, num_experts_per_tok=config.top_k)
    hf_config._experts_implementation = "eager"
    with torch.device("meta"):
        module = Qwen3MoeExperts(hf_config)
    module.gate_up_proj = torch.nn.Parameter(experts.gate_up, requires_grad=False)
    module.down_proj = torch.nn.Parameter(experts.down, requires_grad=False)
    return module


def per_expert_ops(x: Tensor, logits: Tensor, experts: Experts, top_k: int) -> Tensor:
    """fastllm.ops.moe's arithmetic as one fastllm op call per expert (HF's routing)."""
    index, weights = hf_routing(logits, top_k, x.dtype)
    out = torch.zeros_like(x)
    for e in index.unique().tolist():
        tokens, slots = (index == e).nonzero(as_tuple=True)
        if experts.weight_type is None:
            h = ops.linear(x[tokens], experts.gate_up[e])
            y = ops.linear(ops.silu_and_mul(h), experts.down[e])
        else:
            h = ops.quantized_linear(x[tokens], experts.gate_up[e], experts.weight_type)
            y = ops.quantized_linear(ops.silu_and_mul(h), experts.down[e], experts.weight_type)
        out.index_add_(0, tokens, y * weights[tokens, slots, None])
    return out


def competitors(config: MoeBenchConfig, experts: Experts, tokens: int
                ) -> tuple[dict[str, Callable[[], object]], int]:
    """One call of each competitor for `tokens` tokens (inputs built here), and the bytes of
    the experts they chose."""
    device = torch.device(config.device)
    x = torch.randn(tokens, config.hidden_size, device=device).to(experts.dtype)
    logits = torch.randn(tokens, config.num_experts, device=device)
    chosen = hf_routing(logits, config.top_k, x.dtype)[0].unique().tolist()
    calls: dict[str, Callable[[], object]] = {
        "fastllm": lambda: ops.moe(x, logits, experts.gate_up, experts.down, config.top_k, True,
                                   gate_up_type=experts.weight_type,
                                   down_type=experts.weight_type),
        "per_expert": lambda: per_expert_ops(x, logits, experts, config.top_k),
    }
    if experts.weight_type is None:
        module = hf_experts(config, experts)
        calls["hf"] = lambda: module(x, *hf_routing(logits, config.top_k, x.dtype))
    return calls, sum(experts.expert_bytes(e) for e in chosen)


def run(config: MoeBenchConfig) -> list[dict[str, object]]:
    """Times every competitor for every format and token count; returns the JSON rows."""
    rows: list[dict[str, object]] = []
    for name in config.formats:
        torch.manual_seed(0)
        experts = make_experts(config, name)
        for tokens in config.tokens:
            calls, chosen_bytes = competitors(config, experts, tokens)
            timings = compare(calls, config.timer, device=config.device)
            row: dict[str, object] = {"format": name, "tokens": tokens,
                                      "chosen_weight_mb": chosen_bytes / 2**20}
            for key, timing in timings.items():
                row.update({f"{key}_{k}": v for k, v in timing.to_dict().items()})
            fastllm_s = timings["fastllm"].median_s
            row["fastllm_gb_per_s"] = chosen_bytes / fastllm_s / 1e9
            row["speedup_vs_per_expert"] = timings["per_expert"].median_s / fastllm_s
            row["speedup_vs_hf"] = (timings["hf"].median_s / fastllm_s if "hf" in timings
                                    else None)
            rows.append(row)
            print(f"moe: {name}, {tokens} tokens measured", flush=True)
        del experts
    return rows


def tables(rows: list[dict[str, object]]) -> dict[str, str]:
    """The markdown table of the report, by title."""
    columns = {"format": "experts", "tokens": "tokens", "fastllm_median_ms": "fastllm (ms)",
               "per_expert_median_ms": "per-expert ops (ms)", "hf_median_ms": "HF eager (ms)",
               "speedup_vs_per_expert": "speedup vs per-expert",
               "speedup_vs_hf": "speedup vs HF", "chosen_weight_mb": "chosen experts (MiB)",
               "fastllm_gb_per_s": "fastllm GB/s"}
    return {"One MoE layer's experts (median ms; speedup > 1: fastllm faster)":
            markdown_table(rows, columns)}


def parse_args(argv: list[str] | None) -> tuple[MoeBenchConfig, Path]:
    """The config and output folder from the command line; defaults from ``--device``."""
    defaults = MoeBenchConfig.for_device(parse_device(argv))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"),
                        help="folder for moe.json and moe.md (default %(default)s)")
    parser.add_argument("--device", default=defaults.device, help="default %(default)s")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(defaults.tokens),
                        help="token counts (default %(default)s)")
    parser.add_argument("--formats", nargs="+", default=list(defaults.formats),
                        choices=[*FLOAT_FORMATS, *BLOCK_TYPES],
                        help="expert formats (default %(default)s)")
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    parser.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size)
    parser.add_argument("--num-experts", type=int, default=defaults.num_experts)
    parser.add_argument("--top-k", type=int, default=defaults.top_k)
    TimerConfig.add_arguments(parser, defaults.timer)
    args = parser.parse_args(argv)
    config = MoeBenchConfig(tokens=tuple(args.tokens), formats=tuple(args.formats),
                            hidden_size=args.hidden_size,
                            intermediate_size=args.intermediate_size,
                            num_experts=args.num_experts, top_k=args.top_k, device=args.device,
                            timer=TimerConfig.from_arguments(args))
    return config, args.out


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Runs the benchmark, writes ``moe.json`` and ``moe.md``, prints the table; returns the
    JSON document."""
    config, out = parse_args(argv)
    with torch.inference_mode():
        rows = run(config)
    return publish(benchmark="moe", device=config.device, config=config, rows=rows,
                   tables=tables(rows), out=out)


if __name__ == "__main__":
    main()
