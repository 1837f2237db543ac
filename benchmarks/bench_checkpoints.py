"""A quantized checkpoint as GPU users download it, on the CPU: a W4A16 compressed-tensors
folder of the Qwen3-0.6B shape (random weights), batch-1 decode and 512-token TTFT in
``fastllm.LLM``, against HF transformers on the same folder and against fastllm on a Q4_0
GGUF of the same shape.

The checkpoint: :func:`bench_generate.save_random_model`'s Qwen3-0.6B (``--layers``,
``--hidden-size``, ``--intermediate-size`` scale it down for quick checks) in bfloat16,
quantized by the compressed-tensors library as llm-compressor's ``W4A16`` preset does: every
Linear but the LM head, int4 symmetric, one scale per ``--group-size`` (128) columns from the
weights' min-max, ``pack-quantized``; saved once into ``--cache-dir`` (``build/bench-models``,
as bench_gguf's files). fastllm holds its weights as Q4_0 blocks (exact: a group of 128 is four
blocks of 32 with its scale; :mod:`fastllm.models.formats.integers`).

The GGUF: :func:`fastllm.bench.gguf_files.write_random_gguf`'s model of the same shape, its
projections Q4_0 and its (tied) embedding F16, so that a decode step reads as many bytes as
the checkpoint's (whose unquantized embedding and LM head are bfloat16).

The systems, each call a ``1 + --decode-tokens`` (32) greedy generation after a
``--prompt-len`` (512) prompt of random ordinary tokens; fastllm's two alternate after a
warm-up call each, then HF's two do (a fastllm call right after one of HF's runs measurably
slower, which would tilt the pair):

- w4a16: ``fastllm.LLM(folder, dtype=--dtype)``;
- q4_0_gguf: ``fastllm.LLM(gguf, dtype=--dtype)``;
- hf: ``AutoModelForCausalLM.from_pretrained(folder, quantization_config=
  CompressedTensorsConfig(dequantize=True), dtype=--dtype)``, SDPA: transformers' way to run
  a compressed-tensors folder on the CPU (its compressed Linear needs GPU kernels), the weights
  dequantized at load;
- hf_float32 (``--dtype`` bfloat16 only): the same in float32, HF's faster dtype on a CPU
  without bfloat16 arithmetic.

Reported from each one's median call: TTFT, decode tokens/s, the ratios (goals: w4a16 decode
at least the Q4_0 GGUF's, and at least 3x HF's best), and how many leading greedy tokens
fastllm's W4A16 shares with HF on the same folder.

    python benchmarks/bench_checkpoints.py --out results
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

import fastllm
from fastllm import ops
from bench_generate import (DEFAULT_MODELS_DIR, MODEL, QWEN3_ORDINARY_TOKENS, TOKENIZER_FILES,
                            GenerateSample, fastllm_call, generate_columns, hf_call,
                            leading_agreement, save_random_model)
from bench_gguf import DEFAULT_CACHE_DIR
from fastllm.bench.cache import cached
from fastllm.bench.gguf_files import file_sha256, write_random_gguf
from fastllm.bench.report import format_cell, markdown_table, publish
from fastllm.bench.timer import TimerConfig, compare
from fastllm.bench.workloads import MODEL_SHAPES
from fastllm.models.pool import model_pool

SYSTEMS = {"w4a16": "fastllm, W4A16 compressed-tensors", "q4_0_gguf": "fastllm, Q4_0 GGUF",
           "hf": "HF transformers, same folder", "hf_float32": "HF transformers in float32"}
GOAL_VS_Q4_0 = 1.0  # W4A16 decode tokens/s over the Q4_0 GGUF's, at least
GOAL_VS_HF = 3.0  # W4A16 decode tokens/s over HF's best on the same folder, at least
# Changes with how the cached files are written: a new value makes them again.
FILES_VERSION = 1


@dataclass(frozen=True)
class CheckpointBenchConfig:
    """What the checkpoint benchmark measures. ``layers``, ``hidden_size`` and
    ``intermediate_size`` scale the model down (the goals hold at Qwen3-0.6B's own)."""

    layers: int = MODEL_SHAPES[MODEL].num_layers
    hidden_size: int = MODEL_SHAPES[MODEL].hidden_size
    intermediate_size: int = MODEL_SHAPES[MODEL].intermediate_size
    group_size: int = 128
    prompt_len: int = 512
    decode_tokens: int = 32  # generated after the first token
    dtype: str = "bfloat16"
    seed: int = 0
    models_dir: str = str(DEFAULT_MODELS_DIR)
    cache_dir: str = str(DEFAULT_CACHE_DIR)
    # HF's calls last tens of seconds on two cores: one warm-up, then up to three timed calls.
    timer: TimerConfig = field(default_factory=lambda: TimerConfig(warmup=1, repeats=3,
                                                                   budget_s=60.0))

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if min(self.layers, self.prompt_len, self.decode_tokens) < 1:
            raise ValueError(f"layers, prompt_len and decode_tokens must be >= 1, got {self}")
        if self.group_size < 32 or self.group_size % 32:
            raise ValueError(f"group_size must be a multiple of 32, got {self.group_size}")
        for name in ("hidden_size", "intermediate_size"):
            if getattr(self, name) % self.group_size:
                raise ValueError(f"{name} ({getattr(self, name)}) must be a multiple of "
                                 f"group_size ({self.group_size})")

    @property
    def systems(self) -> tuple[str, ...]:
        """The systems this run times (HF in float32 too when the dtype is bfloat16)."""
        return tuple(name for name in SYSTEMS
                     if name != "hf_float32" or self.dtype != "float32")

    @property
    def at_goal_size(self) -> bool:
        """Whether this run measures the model and prompt the goals are set for."""
        shape = MODEL_SHAPES[MODEL]
        return ((self.layers, self.hidden_size, self.intermediate_size, self.group_size,
                 self.prompt_len) == (shape.num_layers, shape.hidden_size,
                                      shape.intermediate_size, 128, 512))


# ---- the files -------------------------------------------------------------------------------


def _key(config: CheckpointBenchConfig, *parts: object) -> str:
    """A short hash of what a cached file is made from."""
    tokenizer_dir = Path(config.models_dir) / "qwen3_tokenizer"
    made_from = [FILES_VERSION, config.layers, config.hidden_size, config.intermediate_size,
                 config.seed, *(file_sha256(tokenizer_dir / name) for name in TOKENIZER_FILES),
                 *parts]
    return hashlib.sha256(json.dumps(made_from).encode()).hexdigest()[:12]


def save_w4a16(config: CheckpointBenchConfig, dest: Path) -> None:
    """The random model in bfloat16, quantized by compressed-tensors (W4A16: int4 symmetric
    groups of ``group_size`` from each group's min-max, every Linear but the LM head) and saved
    packed to ``dest`` with the Qwen3 tokenizer files."""
    # Imported here: compressed-tensors takes seconds to import, and only this writer needs it.
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                                 QuantizationScheme, apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    with tempfile.TemporaryDirectory(prefix="fastllm_bench_checkpoints_") as tmp:
        save_random_model(config, Path(tmp))
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16)
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                               group_size=config.group_size)
    apply_quantization_config(hf, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        ignore=["lm_head"]), show_progress=False)
    with torch.no_grad():
        for module in hf.modules():
            if hasattr(module, "quantization_scheme"):
                low, high = module.weight.unflatten(-1, (-1, config.group_size)).aminmax(dim=-1)
                scale, _ = calculate_qparams(low, high, weights)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(hf)
    compressor.compress_model(hf)
    hf.save_pretrained(dest)
    compressor.update_config(dest)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(config.models_dir) / "qwen3_tokenizer" / name, dest / name)


def w4a16_folder(config: CheckpointBenchConfig) -> Path:
    """The W4A16 checkpoint, made into the cache if it is not there."""
    path = Path(config.cache_dir) / (f"random-{MODEL}-{config.layers}layers.w4a16-g"
                                     f"{config.group_size}.{_key(config, 'w4a16')}")
    return cached(path, lambda dest: save_w4a16(config, dest), "checkpoints")


def q4_0_gguf(config: CheckpointBenchConfig) -> Path:
    """The Q4_0 GGUF of the same shape (F16 embedding), made into the cache if it is not
    there."""
    shape = dataclasses.replace(MODEL_SHAPES[MODEL], hidden_size=config.hidden_size,
                                intermediate_size=config.intermediate_size)
    path = Path(config.cache_dir) / (f"random-{MODEL}-{config.layers}layers.Q4_0-F16embd."
                                     f"{_key(config, 'q4_0', 'F16')}.gguf")
    tokenizer_dir = Path(config.models_dir) / "qwen3_tokenizer"
    return cached(path, lambda dest: write_random_gguf(
        dest, shape, layers=config.layers, type_name="Q4_0", embedding_type="F16",
        tokenizer_dir=tokenizer_dir, seed=config.seed), "checkpoints")


# ---- the measurement -------------------------------------------------------------------------


def hf_model(folder: Path, dtype: str) -> transformers.PreTrainedModel:
    """transformers' model of the compressed-tensors ``folder``, dequantized at load."""
    return AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=CompressedTensorsConfig(dequantize=True),
        dtype=getattr(torch, dtype), attn_implementation="sdpa").eval()


def run(config: CheckpointBenchConfig) -> list[dict[str, object]]:
    """Makes (or finds) both files, times the systems interleaved; returns the row."""
    folder, gguf = w4a16_folder(config), q4_0_gguf(config)
    prompt = torch.randint(0, QWEN3_ORDINARY_TOKENS, (config.prompt_len,),
                           generator=torch.Generator().manual_seed(config.seed)).tolist()
    new_tokens = 1 + config.decode_tokens
    limits = dict(dtype=config.dtype, max_model_len=config.prompt_len + new_tokens,
                  enable_prefix_caching=False)
    w4a16 = fastllm.LLM(folder, **limits)
    q4_0 = fastllm.LLM(gguf, **limits)
    hf = {"hf": hf_model(folder, config.dtype)}
    if "hf_float32" in config.systems:
        hf["hf_float32"] = hf_model(folder, "float32")
    print("checkpoints: models loaded", flush=True)
    samples: dict[str, list[GenerateSample]] = {name: [] for name in config.systems}
    with torch.inference_mode():
        timings = compare({
            "w4a16": fastllm_call(w4a16, prompt, new_tokens, samples["w4a16"]),
            "q4_0_gguf": fastllm_call(q4_0, prompt, new_tokens, samples["q4_0_gguf"])},
            config.timer)
        timings |= compare({name: hf_call(model, prompt, new_tokens, "cpu", samples[name])
                            for name, model in hf.items()}, config.timer)
    weight_types = sorted({GGMLQuantizationType(module.weight_type % ops.INTERLEAVED_TYPES).name
                           if hasattr(module, "weight_type") else "float"
                           for name, module in w4a16.model.named_modules()
                           if name.endswith("_proj")})
    del w4a16, q4_0, hf
    model_pool.clear()  # fastllm.LLM shares loaded models through the pool: let them go
    gc.collect()

    row: dict[str, object] = {
        "model": MODEL, "weights": "random", "dtype": config.dtype, "layers": config.layers,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "group_size": config.group_size, "prompt_len": config.prompt_len,
        "decode_tokens": config.decode_tokens, "w4a16_weight_types": weight_types,
        "goal_vs_q4_0": GOAL_VS_Q4_0, "goal_vs_hf": GOAL_VS_HF}
    for name, timing in timings.items():
        tokens = samples[name][-1].tokens
        if len(tokens) != new_tokens:
            raise RuntimeError(f"{name} generated {len(tokens)} tokens, asked for {new_tokens}")
        columns, ttft, decode = generate_columns(name, timing, samples[name])
        row.update(columns)
        row[f"{name}_decode_tok_s"] = config.decode_tokens / decode.median_s
        row[f"{name}_tokens"] = tokens
    best_hf = max((name for name in timings if name.startswith("hf")),
                  key=lambda name: row[f"{name}_decode_tok_s"])
    row["best_hf"] = best_hf
    row["decode_vs_q4_0"] = row["w4a16_decode_tok_s"] / row["q4_0_gguf_decode_tok_s"]
    row["decode_vs_hf"] = row["w4a16_decode_tok_s"] / row[f"{best_hf}_decode_tok_s"]
    row["ttft_vs_q4_0"] = row["w4a16_ttft_median_ms"] / row["q4_0_gguf_ttft_median_ms"]
    row["ttft_vs_hf"] = row["w4a16_ttft_median_ms"] / row[f"{best_hf}_ttft_median_ms"]
    row["tokens_agree_hf"] = leading_agreement(row["w4a16_tokens"], row["hf_tokens"])
    return [row]


# ---- the report ------------------------------------------------------------------------------


def goal_summary(config: CheckpointBenchConfig, rows: list[dict[str, object]]) -> str:
    """One line: the goals and, at the goal size, the figures against them."""
    goal = (f"Goal: W4A16 decode >= {GOAL_VS_Q4_0:g}x fastllm's Q4_0 GGUF and >= "
            f"{GOAL_VS_HF:g}x HF's best on the same folder")
    if not config.at_goal_size or not rows:
        return f"{goal}: not measured in this run (a {config.layers}-layer model)."
    row = rows[0]
    met = row["decode_vs_q4_0"] >= GOAL_VS_Q4_0 and row["decode_vs_hf"] >= GOAL_VS_HF
    return (f"{goal}: {format_cell(row['decode_vs_q4_0'])}x and "
            f"{format_cell(row['decode_vs_hf'])}x ({'met' if met else 'NOT met'}).")


def tables(config: CheckpointBenchConfig, rows: list[dict[str, object]]) -> dict[str, str]:
    """The markdown tables of the report, by title."""
    systems = [{"system": SYSTEMS[name], "ttft_ms": row[f"{name}_ttft_median_ms"],
                "decode_tok_s": row[f"{name}_decode_tok_s"],
                "vs_w4a16": row[f"{name}_decode_tok_s"] / row["w4a16_decode_tok_s"],
                "repeats": row[f"{name}_call_repeats"]}
               for row in rows for name in config.systems]
    about = (f"{MODEL} shape, {config.layers} layers, random weights; W4A16 (int4 symmetric, "
             f"groups of {config.group_size}, LM head bfloat16) written by compressed-tensors; "
             f"a {config.prompt_len}-token prompt, 1 + {config.decode_tokens} greedy tokens, "
             f"batch 1, activations in {config.dtype} (HF in float32 too); medians of "
             "alternating calls (fastllm's two, then HF's two). The Q4_0 GGUF has the same "
             "shape and an F16 embedding.")
    return {"W4A16 checkpoint on the CPU (decode / W4A16 < 1: slower than fastllm's W4A16)":
            goal_summary(config, rows) + "\n\n" + about + "\n\n" + markdown_table(systems, {
                "system": "system", "ttft_ms": "TTFT (ms)", "decode_tok_s": "decode tok/s",
                "vs_w4a16": "decode / W4A16", "repeats": "calls timed"})}


def parse_args(argv: list[str] | None) -> tuple[CheckpointBenchConfig, Path]:
    """The config and output folder from the command line."""
    defaults = CheckpointBenchConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"),
                        help="folder for checkpoints.json and checkpoints.md "
                             "(default %(default)s)")
    sizes = ("layers", "hidden_size", "intermediate_size", "group_size", "prompt_len",
             "decode_tokens", "seed")
    for name in sizes:
        parser.add_argument("--" + name.replace("_", "-"), type=int,
                            default=getattr(defaults, name), help="default %(default)s")
    parser.add_argument("--dtype", default=defaults.dtype, choices=["float32", "bfloat16"],
                        help="fastllm's and HF's activations (default %(default)s)")
    parser.add_argument("--models-dir", default=defaults.models_dir,
                        help="where qwen3_tokenizer is (default %(default)s)")
    parser.add_argument("--cache-dir", type=Path, default=defaults.cache_dir,
                        help="where the checkpoint and the GGUF are kept (default %(default)s)")
    TimerConfig.add_arguments(parser, defaults.timer)
    args = parser.parse_args(argv)
    config = dataclasses.replace(defaults, dtype=args.dtype, models_dir=args.models_dir,
                                 cache_dir=str(args.cache_dir),
                                 timer=TimerConfig.from_arguments(args),
                                 **{name: getattr(args, name) for name in sizes})
    return config, args.out


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Runs the benchmark, writes ``checkpoints.json`` and ``checkpoints.md``, prints the
    tables; returns the JSON document."""
    config, out = parse_args(argv)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    # transformers' note that dequantize=True overrides the folder's own quantization_config.
    warnings.filterwarnings("ignore", message="You passed `quantization_config`",
                            category=UserWarning)
    rows = run(config)
    return publish(benchmark="checkpoints", device="cpu", config=config, rows=rows,
                   tables=tables(config, rows), out=out)


if __name__ == "__main__":
    main()
