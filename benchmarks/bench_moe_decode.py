"""Mixture-of-experts decode at batch 1: ``fastllm.LLM.generate`` against HF transformers
``generate`` on a Qwen3-MoE-shaped model, and against the bytes of its dense equivalent.

A Qwen3-30B-A3B-shaped model (hidden 2048, 32 query and 4 KV heads of 128, 128 experts of
MLP width 768 of which each token runs 8, renormalized; vocabulary 151,936) with ``--layers``
layers (default 2) and random weights (projections ``randn / sqrt(fan_in)``, embeddings
``randn * 0.02``, norms 1) is saved in bfloat16 with the Qwen3 tokenizer files. Per dtype,
both load it and generate ``1 + --decode-tokens`` greedy tokens after the same random
``--prompt-len``-token prompt, calls interleaved in one process (``bench_generate``'s calls
and clocks).

A decode step needs the weights of the experts its token chose, not all of them. The table
gives the bytes a step reads (every weight but the experts, the LM head included, plus
``experts_per_token`` experts a layer) and the bytes of the dense-equivalent model (every
expert), the machine's copy bandwidth measured in the same run, and the tokens/s a step that
read the dense-equivalent bytes at that bandwidth would reach at best: fastllm above it reads
only the chosen experts' weights.

    python benchmarks/bench_moe_decode.py --out results
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig

from bench_generate import (DEFAULT_MODELS_DIR, QWEN3_BOS, QWEN3_EOS, TOKENIZER_FILES,
                            copy_bandwidth, leading_agreement, measure_generate, random_hf_model,
                            random_prompt)
from fastllm.bench.report import markdown_table, publish
from fastllm.bench.timer import TimerConfig, summarize
from fastllm.bench.workloads import parse_device, parse_model_bench_args

COMPETITORS = {"fastllm": "fastllm", "hf": "HF"}
MODEL = "qwen3-30b-a3b"
# Qwen3-30B-A3B's dimensions but its layer count.
SHAPE = dict(vocab_size=151_936, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
             rope_theta=1_000_000.0, norm_topk_prob=True, tie_word_embeddings=False,
             rms_norm_eps=1e-6, max_position_embeddings=40_960, intermediate_size=6144)


@dataclass(frozen=True)
class MoeBenchConfig:
    """What the benchmark measures; the model's layers, hidden size and experts scale."""

    layers: int = 2
    hidden_size: int = 2048
    moe_intermediate_size: int = 768
    num_experts: int = 128
    experts_per_token: int = 8
    prompt_len: int = 64
    decode_tokens: int = 32
    dtypes: tuple[str, ...] = ("bfloat16",)
    device: str = "cpu"
    seed: int = 0
    models_dir: str = str(DEFAULT_MODELS_DIR)
    timer: TimerConfig = field(default_factory=lambda: TimerConfig(warmup=1, repeats=3,
                                                                   budget_s=30.0))
    copy_mib: int = 1024
    copy_timer: TimerConfig = field(default_factory=lambda: TimerConfig(warmup=2, repeats=10,
                                                                        budget_s=2.0))


@contextmanager
def random_moe_folder(config: MoeBenchConfig) -> Iterator[Path]:
    """A temporary folder holding the random bfloat16 model and the Qwen3 tokenizer files."""
    hf_config = AutoConfig.for_model(
        "qwen3_moe", **SHAPE, hidden_size=config.hidden_size, num_hidden_layers=config.layers,
        moe_intermediate_size=config.moe_intermediate_size, num_experts=config.num_experts,
        num_experts_per_tok=config.experts_per_token, bos_token_id=QWEN3_BOS,
        eos_token_id=QWEN3_EOS, pad_token_id=QWEN3_BOS)
    model = random_hf_model(hf_config, config.seed, torch.bfloat16)
    with tempfile.TemporaryDirectory(prefix="fastllm_bench_moe_decode_") as tmp:
        folder = Path(tmp)
        model.save_pretrained(folder)
        del model
        tokenizer_dir = Path(config.models_dir) / "qwen3_tokenizer"
        for name in TOKENIZER_FILES:
            shutil.copy(tokenizer_dir / name, folder / name)
        print(f"moe: random {MODEL} with {config.layers} layers saved", flush=True)
        yield folder


def step_bytes(hf: torch.nn.Module, config: MoeBenchConfig) -> tuple[int, int]:
    """(bytes a decode step reads, bytes of the whole model): every weight but the experts'
    and the embedding (a step looks up one row), plus ``experts_per_token`` of each layer's
    experts; the whole model counts every expert and the embedding."""
    total = sum(p.nbytes for p in hf.parameters())
    experts = sum(p.nbytes for name, p in hf.named_parameters() if ".experts." in name)
    embedding = hf.get_input_embeddings().weight.nbytes
    active_experts = experts * config.experts_per_token // config.num_experts
    return total - experts - embedding + active_experts, total


def dtype_row(config: MoeBenchConfig, folder: Path, dtype_name: str,
              prompt: list[int]) -> dict[str, object]:
    """Loads both competitors in ``dtype_name``, times them interleaved; returns the row."""
    copy_timing, copy_gbps = copy_bandwidth(config)
    timings, samples, (read_bytes, model_bytes) = measure_generate(
        config, folder, dtype_name, prompt, lambda hf, llm: step_bytes(hf, config))

    row: dict[str, object] = {
        "model": MODEL, "dtype": dtype_name, "layers": config.layers,
        "num_experts": config.num_experts, "experts_per_token": config.experts_per_token,
        "prompt_len": config.prompt_len, "decode_tokens": config.decode_tokens,
        "step_read_gb": read_bytes / 1e9, "dense_equivalent_gb": model_bytes / 1e9,
        "copy_gbps": copy_gbps,
        # The most tokens/s a step reading every weight could reach at the copy bandwidth.
        "dense_equivalent_tok_s": copy_gbps * 1e9 / model_bytes}
    row.update({f"copy_{key}": value for key, value in copy_timing.to_dict().items()})
    for name, timing in timings.items():
        kept = samples[name][-timing.repeats:]
        decode = summarize([s.decode_s for s in kept])
        row.update({f"{name}_decode_{key}": value for key, value in decode.to_dict().items()})
        row[f"{name}_decode_tok_s"] = config.decode_tokens / decode.median_s
        row[f"{name}_read_gbps"] = read_bytes * row[f"{name}_decode_tok_s"] / 1e9
        row[f"{name}_tokens"] = kept[-1].tokens
    row["decode_speedup_vs_hf"] = row["fastllm_decode_tok_s"] / row["hf_decode_tok_s"]
    row["vs_dense_equivalent"] = row["fastllm_decode_tok_s"] / row["dense_equivalent_tok_s"]
    row["tokens_agree"] = leading_agreement(row["fastllm_tokens"], row["hf_tokens"])
    return row


def run(config: MoeBenchConfig) -> list[dict[str, object]]:
    """Saves the random model, then measures every dtype; returns the JSON rows."""
    prompt = random_prompt(config)
    rows = []
    with random_moe_folder(config) as folder:
        for dtype_name in config.dtypes:
            rows.append(dtype_row(config, folder, dtype_name, prompt))
            print(f"moe: {dtype_name} measured", flush=True)
    return rows


def tables(config: MoeBenchConfig, rows: list[dict[str, object]]) -> dict[str, str]:
    """The markdown table of the report, by title."""
    columns = {"dtype": "dtype", "fastllm_decode_tok_s": "fastllm decode tok/s",
               "hf_decode_tok_s": "HF decode tok/s", "decode_speedup_vs_hf": "speedup vs HF",
               "step_read_gb": "GB a step reads", "dense_equivalent_gb": "dense-equivalent GB",
               "copy_gbps": "copy GB/s", "fastllm_read_gbps": "fastllm GB/s read",
               "dense_equivalent_tok_s": "dense-equivalent tok/s bound",
               "vs_dense_equivalent": "fastllm vs that bound", "tokens_agree": "tokens agree"}
    about = (f"{config.layers} layers of {config.num_experts} experts, {config.experts_per_token}"
             f" a token, hidden {config.hidden_size}, a {config.prompt_len}-token prompt, 1 + "
             f"{config.decode_tokens} greedy tokens. GB a step reads: every weight but the "
             "experts and the embedding, plus the chosen experts; dense-equivalent GB: every "
             "weight. Dense-equivalent tok/s bound: the copy bandwidth over the "
             "dense-equivalent bytes, the most a step reading them all could reach.")
    return {f"Mixture-of-experts decode at batch 1, random-weight {MODEL} (fastllm vs that "
            "bound > 1: only the chosen experts are read)": about + "\n\n"
            + markdown_table(rows, columns)}


def parse_args(argv: list[str] | None) -> tuple[MoeBenchConfig, Path]:
    """The config and output folder from the command line."""
    sizes = ("layers", "hidden_size", "moe_intermediate_size", "num_experts",
             "experts_per_token", "prompt_len", "decode_tokens", "copy_mib", "seed")
    return parse_model_bench_args(argv, MoeBenchConfig(device=parse_device(argv)),
                                  benchmark="moe_decode", description=__doc__.split("\n\n")[0],
                                  sizes=sizes, models_dir_help="folder holding qwen3_tokenizer")


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Runs the benchmark, writes ``moe_decode.json`` and ``moe_decode.md``, prints the table;
    returns the JSON document."""
    config, out = parse_args(argv)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    rows = run(config)
    return publish(benchmark="moe_decode", device=config.device, config=config, rows=rows,
                   tables=tables(config, rows), out=out)


if __name__ == "__main__":
    main()
