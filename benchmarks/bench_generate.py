"""End-to-end greedy generation at batch 1: ``fastllm.LLM.generate`` against HF transformers
``generate`` on the same weights.

A Qwen3-0.6B-shaped model (28 layers, hidden 1024, MLP 3072, 16 query and 8 KV heads of 128,
vocabulary 151,936, tied embeddings) with random weights (embedding ``randn * 0.02``,
projections ``randn / sqrt(fan_in)``, norms 1) is saved as float32 safetensors in a temporary
folder with the real Qwen3 tokenizer files (from ``--models-dir``). Per dtype (float32,
bfloat16), both load that folder in the dtype and generate ``1 + --decode-tokens`` greedy tokens
after the same random ``--prompt-len``-token prompt (ids of ordinary tokens, fixed seed),
interleaved in one process:

- fastllm: ``fastllm.LLM(folder, dtype=..., enable_prefix_caching=False)`` then
  ``llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=1 + n,
  ignore_eos=True))``; without prefix caching every call prefills the whole prompt, as HF's
  does;
- HF: ``AutoModelForCausalLM.from_pretrained(folder, dtype=..., attn_implementation="sdpa")``
  then ``model.generate(input_ids, max_new_tokens=1 + n, min_new_tokens=1 + n,
  do_sample=False)`` under ``torch.inference_mode``.

From each call: TTFT is the time from the call to the first generated token (prefill, LM head
and the first token: fastllm's ``metrics.first_token_time``, HF's second ``streamer.put``);
prefill tokens/s is the prompt length over TTFT; decode tokens/s is ``n`` over the time from
the first token to the last (fastllm's ``metrics.last_token_time``, HF's last
``streamer.put``), that is ``n`` single-token steps, and decode ms/token its inverse. Medians
after warm-up. Goals: fastllm decode >= 2x HF's tokens/s and TTFT <= 0.8x HF's, at the full
size.

Achieved weight bandwidth is the weight bytes times decode tokens/s: every parameter once in
the dtype, the tied embedding once (the LM head reads all of it each token; the embedding
lookup one row, not counted separately). Beside it, the machine's memory-copy bandwidth
measured in the same run: ``dst.copy_(src)`` on ``--copy-mib`` MiB, counting the bytes read
plus the bytes written. GB = 1e9 bytes. Greedy tokens are compared too: ``tokens_agree`` is how
many leading tokens fastllm and HF share (float32 should agree; bfloat16 may drift apart).

Defaults depend on ``--device``: on the CPU, float32 and bfloat16 with 64 decoded tokens (sized
for two cores); on CUDA, bfloat16 with 128 decoded tokens and five timed calls. Sizes given on
the command line replace the device's.

    python benchmarks/bench_generate.py --out results --dtypes float32 bfloat16
    python benchmarks/bench_generate.py --out results --device cuda
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, TypeVar
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

import fastllm
from fastllm.bench.report import format_cell, markdown_table, publish
from fastllm.bench.timer import TimerConfig, Timing, compare, summarize
from fastllm.bench.workloads import (MODEL_SHAPES, DeviceCopy, parse_device,
                                     parse_model_bench_args)
from fastllm.models.pool import model_pool

COMPETITORS = {"fastllm": "fastllm", "hf": "HF"}
GOAL_DECODE_SPEEDUP = 2.0  # fastllm decode tokens/s over HF's, at least
GOAL_TTFT_RATIO = 0.8  # fastllm TTFT over HF's, at most
MODEL = "qwen3-0.6b"
# Qwen3's ordinary (BPE) tokens are ids 0 .. 151642; its special tokens start at 151643.
QWEN3_BOS, QWEN3_EOS, QWEN3_ORDINARY_TOKENS = 151_643, 151_645, 151_643
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# As the tests find them: $FASTLLM_MODELS_DIR, else the shared folder beside the checkout.
DEFAULT_MODELS_DIR = Path(os.environ.get(
    "FASTLLM_MODELS_DIR", Path(__file__).resolve().parents[2] / "shared" / "models"))


@dataclass(frozen=True)
class GenerateBenchConfig:
    """What the generation benchmark measures. ``layers``, ``hidden_size`` and
    ``intermediate_size`` scale the model down (the goals hold at Qwen3-0.6B's own)."""

    layers: int = MODEL_SHAPES[MODEL].num_layers
    hidden_size: int = MODEL_SHAPES[MODEL].hidden_size
    intermediate_size: int = MODEL_SHAPES[MODEL].intermediate_size
    prompt_len: int = 512
    decode_tokens: int = 64  # generated after the first token
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    device: str = "cpu"
    seed: int = 0
    models_dir: str = str(DEFAULT_MODELS_DIR)
    # On two cores a call lasts many seconds: one warm-up, then up to three timed calls or 30 s
    # each, keep the default run within minutes.
    timer: TimerConfig = field(default_factory=lambda: TimerConfig(warmup=1, repeats=3,
                                                                   budget_s=30.0))
    copy_mib: int = 1024
    profile_tokens: int = 0  # decode steps under torch.profiler after the timed calls (0: none)
    copy_timer: TimerConfig = field(default_factory=lambda: TimerConfig(warmup=2, repeats=10,
                                                                        budget_s=2.0))

    @classmethod
    def for_device(cls, device: str) -> GenerateBenchConfig:
        """The defaults on ``device``: the class defaults (sized for two CPU cores) except on
        CUDA, where bfloat16 decodes 128 tokens per call (steps of milliseconds) and five
        calls are timed, then 32 decode steps are profiled."""
        if torch.device(device).type != "cuda":
            return cls(device=device)
        return cls(dtypes=("bfloat16",), decode_tokens=128, device=device, profile_tokens=32,
                   timer=TimerConfig(warmup=1, repeats=5, budget_s=30.0))

    @property
    def at_goal_size(self) -> bool:
        """Whether this run measures the model and prompt the goals are set for."""
        shape = MODEL_SHAPES[MODEL]
        return ((self.layers, self.hidden_size, self.intermediate_size, self.prompt_len)
                == (shape.num_layers, shape.hidden_size, shape.intermediate_size, 512))


class ModelSizes(Protocol):
    """What a benchmark config says of its random model (every benchmark's config has it)."""

    layers: int
    hidden_size: int
    intermediate_size: int
    seed: int
    models_dir: str


# The HF model type of each architecture save_random_model writes.
HF_MODEL_TYPES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}


def random_hf_model(hf_config: transformers.PretrainedConfig, seed: int,
                    dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    """An HF causal LM of ``hf_config`` with random weights, the benchmarks' way: norms 1, the
    embedding std 0.02 (the LM head too when tied: logits' std about 0.6), every projection
    (experts' ``[experts, out, in]`` too) std 1 / sqrt(fan_in), which keeps each layer's output
    about as large as its input so that the greedy tokens vary (with std 0.02 everywhere the
    model soon repeats one token, and a token comparison would check little)."""
    with torch.device("meta"):  # no HF initialization: every weight is overwritten below
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gave a tied lm_head its own storage
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name == "model.embed_tokens.weight":
                param.normal_(0.0, 0.02, generator=generator)
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
    return model


def save_random_model(config: ModelSizes, folder: Path, shape: str = MODEL) -> None:
    """Writes an HF model of ``shape``'s family and heads (default Qwen3-0.6B's) with the
    config's layers, hidden and MLP sizes, random float32 weights, and the Qwen3 tokenizer
    files into ``folder``."""
    dims = MODEL_SHAPES[shape]
    # Qwen3's special tokens, where the vocabulary holds them (random token ids never reach
    # them: they are drawn from the ordinary ones).
    special = ({"bos_token_id": QWEN3_BOS, "eos_token_id": QWEN3_EOS, "pad_token_id": QWEN3_BOS}
               if dims.vocab_size > QWEN3_EOS else {})
    hf_config = AutoConfig.for_model(
        HF_MODEL_TYPES[dims.architecture], vocab_size=dims.vocab_size,
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.layers, num_attention_heads=dims.n_heads,
        num_key_value_heads=dims.n_kv_heads, head_dim=dims.head_dim,
        tie_word_embeddings=dims.tie_word_embeddings, rope_theta=dims.rope_theta,
        rms_norm_eps=1e-6, max_position_embeddings=40_960, **special)
    model = random_hf_model(hf_config, config.seed)
    model.save_pretrained(folder)
    tokenizer_dir = Path(config.models_dir) / "qwen3_tokenizer"
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, folder / name)


@contextmanager
def random_model_folder(config: ModelSizes, benchmark: str, shape: str = MODEL
                        ) -> Iterator[Path]:
    """A temporary folder holding :func:`save_random_model`'s model, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=f"fastllm_bench_{benchmark}_") as tmp:
        folder = Path(tmp)
        save_random_model(config, folder, shape)
        print(f"{benchmark}: random {shape} with {config.layers} layers saved", flush=True)
        yield folder


def random_prompt(config: GenerateBenchConfig) -> list[int]:
    """``prompt_len`` ordinary-token ids drawn with the config's seed."""
    generator = torch.Generator().manual_seed(config.seed)
    return torch.randint(0, QWEN3_ORDINARY_TOKENS, (config.prompt_len,),
                         generator=generator).tolist()


@dataclass(frozen=True)
class GenerateSample:
    """One generate call: seconds from the call to the first token, seconds from the first
    token to the last, and the generated tokens."""

    ttft_s: float
    decode_s: float
    tokens: list[int]


def generate_columns(name: str, timing: Timing, samples: list[GenerateSample]
                     ) -> tuple[dict[str, float], Timing, Timing]:
    """Row columns ``{name}_{call,ttft,decode}_{statistic}`` of a competitor's timed calls
    (``compare``'s last ``timing.repeats`` samples: warm-ups come first), with the TTFT and
    decode summaries."""
    kept = samples[-timing.repeats:]
    ttft = summarize([s.ttft_s for s in kept])
    decode = summarize([s.decode_s for s in kept])
    columns = {f"{name}_{part}_{key}": value
               for part, summary in (("call", timing), ("ttft", ttft), ("decode", decode))
               for key, value in summary.to_dict().items()}
    return columns, ttft, decode


class TokenClock(BaseStreamer):
    """An HF streamer that notes when each ``put`` arrives: the prompt first, then one per
    generated token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def fastllm_call(llm: fastllm.LLM, prompt: list[int], new_tokens: int,
                 samples: list[GenerateSample]) -> Callable[[], None]:
    """One greedy ``LLM.generate`` of ``new_tokens`` tokens, appending its sample."""
    params = fastllm.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)

    def call() -> None:
        start = time.perf_counter()
        [out] = llm.generate([prompt], params, use_tqdm=False)
        metrics = out.metrics
        if metrics.num_cached_tokens:
            raise RuntimeError(f"{metrics.num_cached_tokens} prompt tokens came from a cache")
        samples.append(GenerateSample(metrics.first_token_time - start,
                                      metrics.last_token_time - metrics.first_token_time,
                                      list(out.outputs[0].token_ids)))

    return call


def hf_call(model: torch.nn.Module, prompt: list[int], new_tokens: int, device: str,
            samples: list[GenerateSample]) -> Callable[[], None]:
    """One greedy HF ``generate`` of ``new_tokens`` tokens, appending its sample."""
    input_ids = torch.tensor([prompt], device=device)
    attention_mask = torch.ones_like(input_ids)

    def call() -> None:
        clock = TokenClock()
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             streamer=clock)
        # times[0] is the prompt, times[1] the first generated token, times[-1] the last.
        samples.append(GenerateSample(clock.times[1] - start, clock.times[-1] - clock.times[1],
                                      out[0, len(prompt):].tolist()))

    return call


def copy_bandwidth(config: GenerateBenchConfig) -> tuple[Timing, float]:
    """The median ``dst.copy_(src)`` of ``copy_mib`` MiB and its GB/s (read + written bytes)."""
    copy = DeviceCopy.of_mib(config.copy_mib, config.device)
    timing = compare({"copy": copy}, config.copy_timer, device=config.device)["copy"]
    return timing, copy.gbps(timing)


def profile_decode(llm: fastllm.LLM, prompt: list[int], tokens: int,
                   layers: int) -> dict[str, object]:
    """Where a decode step's time goes, by torch.profiler: a ``generate`` of ``1 + tokens``
    tokens less one of the first token alone (prefill and its sampling), divided over the
    ``tokens`` decode steps."""
    from torch.profiler import ProfilerActivity, profile

    host_names = ("cudaMemcpyAsync", "cudaLaunchKernel", "cudaGraphLaunch")

    def tally(max_tokens: int) -> tuple[dict[str, list[float]], dict[str, float]]:
        params = fastllm.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate([prompt], params, use_tqdm=False)
        kernels: dict[str, list[float]] = {}
        counts = dict.fromkeys(("device_copies", *host_names, "graph_launch_us"), 0.0)
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                if event.name.startswith(("Memcpy", "Memset")):
                    counts["device_copies"] += 1
                else:
                    kernels.setdefault(event.name, []).append(event.device_time)
            elif event.name in host_names:
                counts[event.name] += 1
                if event.name == "cudaGraphLaunch":
                    counts["graph_launch_us"] += event.cpu_time_total
        return kernels, counts

    first_kernels, first_counts = tally(1)
    all_kernels, all_counts = tally(1 + tokens)
    steps = {name: (len(times) - len(first_kernels.get(name, [])),
                    sum(times) - sum(first_kernels.get(name, [])))
             for name, times in all_kernels.items()}
    steps = {name: step for name, step in steps.items() if step[0] > 0}
    count = sum(n for n, _ in steps.values())
    per_step = {name: (all_counts[name] - first_counts[name]) / tokens for name in all_counts}
    top = sorted(steps.items(), key=lambda item: -item[1][1])[:12]
    return {
        "profile_tokens": tokens,
        "kernels_per_step": count / tokens,
        "kernels_per_layer": count / tokens / layers,
        "kernel_ms_per_step": sum(us for _, us in steps.values()) / tokens / 1e3,
        **{f"{name}_per_step": per_step[name] for name in ("device_copies", *host_names)},
        "graph_launch_ms": (per_step["graph_launch_us"] / per_step["cudaGraphLaunch"] / 1e3
                            if per_step["cudaGraphLaunch"] else 0.0),
        "top_kernels": [{"name": name[:120], "per_step": n / tokens, "us_per_step": us / tokens}
                        for name, (n, us) in top],
    }


def leading_agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class GenerateRun(Protocol):
    """What :func:`measure_generate` reads of a benchmark's config."""

    prompt_len: int
    decode_tokens: int
    device: str
    timer: TimerConfig


Measured = TypeVar("Measured")


def measure_generate(config: GenerateRun, folder: Path, dtype_name: str, prompt: list[int],
                     measure: Callable[[torch.nn.Module, fastllm.LLM], Measured]
                     ) -> tuple[dict[str, Timing], dict[str, list[GenerateSample]], Measured]:
    """Loads ``folder``'s model in HF transformers (SDPA) and in ``fastllm.LLM`` in
    ``dtype_name``, times both generating ``1 + decode_tokens`` greedy tokens after ``prompt``,
    interleaved, then calls ``measure(hf, llm)``; releases both. Returns the timings, every
    call's sample by competitor, and what ``measure`` returned."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype_name),
                                              attn_implementation="sdpa").to(config.device).eval()
    llm = fastllm.LLM(folder, dtype=dtype_name, device=config.device,
                      max_model_len=config.prompt_len + 1 + config.decode_tokens,
                      enable_prefix_caching=False)
    new_tokens = 1 + config.decode_tokens
    samples: dict[str, list[GenerateSample]] = {"fastllm": [], "hf": []}
    with torch.inference_mode():
        calls = {"fastllm": fastllm_call(llm, prompt, new_tokens, samples["fastllm"]),
                 "hf": hf_call(hf, prompt, new_tokens, config.device, samples["hf"])}
        timings = compare(calls, config.timer, device=config.device)
        measured = measure(hf, llm)
    del hf, llm, calls
    model_pool.clear()  # fastllm.LLM shares loaded models through the pool: let this one go
    gc.collect()
    for name, timing in timings.items():
        tokens = samples[name][-1].tokens
        if len(tokens) != new_tokens:
            raise RuntimeError(f"{name} generated {len(tokens)} tokens, asked for {new_tokens}")
    return timings, samples, measured


def dtype_row(config: GenerateBenchConfig, folder: Path, dtype_name: str,
              prompt: list[int]) -> dict[str, object]:
    """Loads both competitors in ``dtype_name``, times them interleaved; returns the row."""
    copy_timing, copy_gbps = copy_bandwidth(config)

    def measure(hf: torch.nn.Module, llm: fastllm.LLM) -> dict[str, object]:
        return {"weight_bytes": sum(p.nbytes for p in hf.parameters()),  # tied embedding once
                "profile": (profile_decode(llm, prompt, config.profile_tokens, config.layers)
                            if config.profile_tokens else {})}

    timings, samples, measured = measure_generate(config, folder, dtype_name, prompt, measure)
    weight_bytes, profile = measured["weight_bytes"], measured["profile"]

    row: dict[str, object] = {"model": MODEL, "dtype": dtype_name, "layers": config.layers,
                              "hidden_size": config.hidden_size, "prompt_len": config.prompt_len,
                              "decode_tokens": config.decode_tokens,
                              "weight_bytes": weight_bytes, "copy_mib": config.copy_mib}
    row.update({f"copy_{key}": value for key, value in copy_timing.to_dict().items()})
    row["copy_gbps"] = copy_gbps
    for name, timing in timings.items():
        columns, ttft, decode = generate_columns(name, timing, samples[name])
        row.update(columns)
        row[f"{name}_prefill_tok_s"] = config.prompt_len / ttft.median_s
        row[f"{name}_decode_tok_s"] = config.decode_tokens / decode.median_s
        row[f"{name}_decode_ms_per_token"] = decode.median_s * 1e3 / config.decode_tokens
        row[f"{name}_weight_gbps"] = weight_bytes * row[f"{name}_decode_tok_s"] / 1e9
        row[f"{name}_tokens"] = samples[name][-1].tokens
    row["decode_speedup_vs_hf"] = row["fastllm_decode_tok_s"] / row["hf_decode_tok_s"]
    row["ttft_vs_hf"] = row["fastllm_ttft_median_ms"] / row["hf_ttft_median_ms"]
    row["tokens_agree"] = leading_agreement(row["fastllm_tokens"], row["hf_tokens"])
    row.update({f"fastllm_{key}": value for key, value in profile.items()})
    return row


def run(config: GenerateBenchConfig) -> list[dict[str, object]]:
    """Saves the random model, then measures every dtype; returns the JSON rows."""
    prompt = random_prompt(config)
    rows = []
    with random_model_folder(config, "generate") as folder:
        for dtype_name in config.dtypes:
            rows.append(dtype_row(config, folder, dtype_name, prompt))
            print(f"generate: {dtype_name} measured", flush=True)
    return rows


def goal_summary(config: GenerateBenchConfig, rows: list[dict[str, object]]) -> str:
    """One line: the goals and, at the goal size, each dtype's figures against them."""
    goal = (f"Goal: fastllm decode >= {GOAL_DECODE_SPEEDUP:g}x HF's tokens/s and TTFT <= "
            f"{GOAL_TTFT_RATIO:g}x HF's, batch 1, {MODEL} with a 512-token prompt")
    if not config.at_goal_size or not rows:
        return f"{goal}: not measured in this run (model or prompt scaled down)."
    found = []
    for row in rows:
        met = (row["decode_speedup_vs_hf"] >= GOAL_DECODE_SPEEDUP
               and row["ttft_vs_hf"] <= GOAL_TTFT_RATIO)
        found.append(f"{row['dtype']} decode {format_cell(row['decode_speedup_vs_hf'])}x, "
                     f"TTFT {format_cell(row['ttft_vs_hf'])}x ({'met' if met else 'NOT met'})")
    return f"{goal}: " + "; ".join(found) + "."


def tables(config: GenerateBenchConfig, rows: list[dict[str, object]]) -> dict[str, str]:
    """The markdown tables of the report, by title."""
    columns = {"dtype": "dtype"}
    for metric, header in (("ttft_median_ms", "TTFT (ms)"),
                           ("prefill_tok_s", "prefill tok/s"),
                           ("decode_tok_s", "decode tok/s"),
                           ("decode_ms_per_token", "decode ms/token")):
        columns |= {f"{name}_{metric}": f"{label} {header}"
                    for name, label in COMPETITORS.items()}
    columns |= {"ttft_vs_hf": "TTFT vs HF", "decode_speedup_vs_hf": "decode speedup vs HF"}
    labelled = [dict(row, weight_gb=row["weight_bytes"] / 1e9) for row in rows]
    columns |= {"weight_gb": "weights (GB)"}
    columns |= {f"{name}_weight_gbps": f"{label} weight GB/s"
                for name, label in COMPETITORS.items()}
    columns |= {"copy_gbps": "copy GB/s", "tokens_agree": "tokens agree"}
    about = (f"{config.layers} layers, hidden {config.hidden_size}, a {config.prompt_len}-token "
             f"prompt, 1 + {config.decode_tokens} greedy tokens. Weight GB/s: weight bytes "
             "(tied embedding once) x decode tokens/s; copy GB/s: bytes read + written by "
             f"a {config.copy_mib} MiB copy; tokens agree: leading tokens fastllm and HF "
             f"share, of {1 + config.decode_tokens}.")
    reports = {f"Greedy generation at batch 1, random-weight {MODEL} (TTFT vs HF < 1 and "
               "decode speedup > 1: fastllm faster)":
               goal_summary(config, rows) + "\n\n" + about + "\n\n"
               + markdown_table(labelled, columns)}
    profiled = [row for row in rows if "fastllm_kernels_per_step" in row]
    if profiled:
        columns = {"dtype": "dtype", "fastllm_kernels_per_step": "kernels/step",
                   "fastllm_kernels_per_layer": "kernels/layer",
                   "fastllm_kernel_ms_per_step": "kernel ms/step",
                   "fastllm_decode_ms_per_token": "wall ms/step",
                   "fastllm_device_copies_per_step": "device copies/step",
                   "fastllm_cudaMemcpyAsync_per_step": "cudaMemcpyAsync/step",
                   "fastllm_cudaLaunchKernel_per_step": "cudaLaunchKernel/step",
                   "fastllm_graph_launch_ms": "cudaGraphLaunch ms"}
        kernel_rows = [{"dtype": row["dtype"], **kernel} for row in profiled
                       for kernel in row["fastllm_top_kernels"]]
        reports["Where a fastllm decode step goes (torch.profiler, "
                f"{profiled[0]['fastllm_profile_tokens']} steps)"] = (
            markdown_table(profiled, columns) + "\n\n" + markdown_table(
                kernel_rows, {"dtype": "dtype", "name": "kernel", "per_step": "launches/step",
                              "us_per_step": "us/step"}))
    return reports


def parse_args(argv: list[str] | None) -> tuple[GenerateBenchConfig, Path]:
    """The config and output folder from the command line."""
    sizes = ("layers", "hidden_size", "intermediate_size", "prompt_len", "decode_tokens",
             "copy_mib", "profile_tokens", "seed")
    return parse_model_bench_args(argv, GenerateBenchConfig.for_device(parse_device(argv)),
                                  benchmark="generate", description=__doc__.split("\n\n")[0],
                                  sizes=sizes,
                                  models_dir_help="folder holding qwen3_tokenizer")


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Runs the benchmark, writes ``generate.json`` and ``generate.md``, prints the tables;
    returns the JSON document."""
    config, out = parse_args(argv)
    transformers.logging.set_verbosity_error()  # no tied-weight or generation-config notes
    transformers.logging.disable_progress_bar()  # nor weight-loading bars
    rows = run(config)
    return publish(benchmark="generate", device=config.device, config=config, rows=rows,
                   tables=tables(config, rows), out=out)


if __name__ == "__main__":
    main()
