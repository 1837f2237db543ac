"""Continuous batching: ``fastllm.LLM.generate`` serving many requests at once against HF
transformers ``generate`` on padded batches of the same prompts, the prefix cache's effect on
time to first token, and ``fastllm.LLM(path)`` on its defaults (the KV pool sized from the
memory budget) on mixed prompts.

The model is bench_generate's random-weight Qwen3-0.6B (28 layers, hidden 1024, MLP 3072,
16 query and 8 KV heads of 128, vocabulary 151,936, tied embeddings), saved once with the Qwen3
tokenizer files; ``--layers``, ``--hidden-size`` and ``--intermediate-size`` scale it down. Per
dtype (bfloat16 by default), both competitors load that folder in the dtype. The throughput
and LLM-defaults sections time one call each: on two cores a call lasts long enough to be its
own warm-up (see ``TimerConfig``); ``--layers 4`` makes a shorter run.

Throughput: ``--num-requests`` prompts (64) of random ordinary-token ids, their lengths drawn
uniformly from ``--min-prompt-len`` .. ``--max-prompt-len`` (32 .. 512, fixed seed), each
answered with ``--output-tokens`` (64) greedy tokens, EOS ignored. All requests arrive at once;
a call serves them all and its wall time gives output tokens/s. Interleaved in one process:

- fastllm: ``fastllm.LLM(folder, dtype=..., enable_prefix_caching=False, max_num_seqs=64,
  max_num_batched_tokens=2048, kv_cache_memory=...)`` with KV room for every request at full
  length (no preemption needed), then ``llm.generate(prompts, SamplingParams(temperature=0,
  max_tokens=64, ignore_eos=True))``. Prefix caching is off: the random prompts share nothing,
  and every call computes every prompt as HF does. Per request, ``RequestOutput.metrics``
  gives TTFT, time per output token (TPOT) and queue time; per call, the difference of
  ``llm.engine.stats`` gives steps, preemptions and the peak KV-block usage (the largest since
  the LLM was made; every call is alike), and the output processor's time (detokenization,
  stop strings) as a share of the engine's step time;
- HF: ``AutoModelForCausalLM.from_pretrained(folder, dtype=..., attn_implementation="sdpa")``;
  the prompts sorted by length (HF's best case: the least padding) and cut into batches of
  ``--hf-batch-size`` (16), each left-padded with id 0 and an attention mask, run one after
  another through ``model.generate(input_ids, attention_mask=..., max_new_tokens=64,
  min_new_tokens=64, do_sample=False)``. A request's TTFT is from the start of the call to
  its batch's first generated token, its queue time to the start of its batch's ``generate``,
  its TPOT its batch's mean time between tokens.

Throughput is from each competitor's median call; TTFT, TPOT and queue-time percentiles are
over the requests of its last call.

Prefix cache: a fresh ``fastllm.LLM`` with prefix caching on serves, one after another,
``--prefix-requests`` requests (8) of one shared ``--prefix-len``-token system prompt (512)
followed by a distinct ``--suffix-len``-token question (32), one output token each (TTFT is
all this measures). The first request computes the whole prompt (cold); the later ones find
the system prompt's KV cached. ``--prefix-rounds`` rounds (3), each with a new system prompt,
after the timer's warm-up rounds: cold TTFT is the median of the rounds' first requests,
cached TTFT the median of all the others; the hit rate is the block manager's (prompt blocks
reused over prompt blocks looked up, in the timed rounds).

LLM defaults: ``fastllm.LLM(folder)`` with no argument but the device (float32, prefix
caching on, the engine's default limits, and ``kv_cache_memory=None``: the KV pool sized from
the memory budget) serves ``--mixed-requests`` prompts (24) of ``--mixed-min-prompt-len`` ..
``--mixed-max-prompt-len`` random tokens (10 .. 400), ``--mixed-output-tokens`` (32) greedy
tokens each, against HF ``generate`` in float32 on the same prompts in padded batches as above,
on the same random-weight shape with ``--mixed-layers`` layers (4), saved apart. Each call gets
new prompts of the same lengths (the same for both competitors), so the prefix cache never
serves one call from another's. Reported: output tokens/s of each, preemptions over every call
(the check: none, the default pool holding every request), and the tokens the last call
scheduled against those it needed (every prompt token, and every output token but each
request's last, once).

Batch-invariant mode: the throughput section's requests on two fastllm.LLM of the same
settings, one with ``batch_invariant=True`` (each request's arithmetic that of the request
alone: the few-row matmul kernels for prefill rows too, one attention path and no split of a
decode row's keys), calls alternating: output tokens/s of each, their ratio (the mode's cost)
and the median TTFT and TPOT; also how many requests got the same greedy tokens in both. Left
out on CUDA, where the engine refuses the mode (its batch-invariant kernels are the CPU's).

Tensor parallelism (``--tensor-parallel-size N``, N > 1): the throughput section's requests
on ``fastllm.LLM(..., tensor_parallel_size=N)`` (N ranks, one process each; on the CPU they
share the cores, rank 0 keeping 1/N of this process's threads) and on one process with every
thread, calls alternating: output tokens/s of each, rank 0's time broadcasting a step to the
other ranks (mean per step) and how many requests got the same greedy tokens. On a CPU the ranks split the same cores, so this shows what the ranks' collectives
cost, not a speedup.

Goals, at the full Qwen3-0.6B shape with 64 requests of 32-512 tokens: fastllm throughput
>= 5x HF's; cached-prefix TTFT >= 5x lower than cold. Greedy tokens are compared per request:
float32 should agree; bfloat16 may drift apart (batch shapes change the rounding).

Sections: ``--sections`` runs some of throughput, prefix, batch_invariant and defaults (all by
default; tensor parallelism runs when ``--tensor-parallel-size`` is above 1).

Defaults depend on ``--device``: on CUDA, HF generates all 64 requests as one padded batch
(``--hf-batch-size 64``, its best case on a GPU) instead of four of 16. Sizes given on the
command line replace the device's.

    python benchmarks/bench_engine.py --out results
    python benchmarks/bench_engine.py --out results --device cuda
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

import fastllm
from fastllm.bench.report import format_cell, markdown_table, publish
from fastllm.bench.timer import TimerConfig, compare
from fastllm.bench.workloads import MODEL_SHAPES, parse_device, parse_model_bench_args
from fastllm.engine import EngineStats
from fastllm.models.pool import model_pool
from fastllm.models import DecoderLM

# The random model, its prompts' vocabulary and the HF token clock are bench_generate's.
from bench_generate import (DEFAULT_MODELS_DIR, MODEL, QWEN3_ORDINARY_TOKENS,
                            TokenClock, leading_agreement, random_model_folder)

COMPETITORS = {"fastllm": "fastllm", "hf": "HF"}
GOAL_THROUGHPUT_SPEEDUP = 5.0  # fastllm output tokens/s over HF's, at least
GOAL_PREFIX_TTFT_RATIO = 5.0  # cold TTFT over cached-prefix TTFT, at least
PAD_ID = 0
# The sections ``--sections`` chooses from, in the order they run.
SECTIONS = ("throughput", "prefix", "batch_invariant", "defaults")
ADDITIVE_STATS = ("steps", "scheduled_tokens", "preemptions", "step_s", "prefix_cache_hits",
                  "prefix_cache_queries")


@dataclass(frozen=True)
class EngineBenchConfig:
    """What the engine benchmark measures. ``layers``, ``hidden_size`` and
    ``intermediate_size`` scale the model down (the goals hold at Qwen3-0.6B's own)."""

    layers: int = MODEL_SHAPES[MODEL].num_layers
    hidden_size: int = MODEL_SHAPES[MODEL].hidden_size
    intermediate_size: int = MODEL_SHAPES[MODEL].intermediate_size
    num_requests: int = 64
    min_prompt_len: int = 32
    max_prompt_len: int = 512
    output_tokens: int = 64
    hf_batch_size: int = 16
    max_num_batched_tokens: int = 2048
    prefix_len: int = 512
    suffix_len: int = 32
    prefix_requests: int = 8  # per round: one cold, then cached
    prefix_rounds: int = 3
    # LLM(path) on its defaults: mixed prompts on the same shape with mixed_layers layers.
    mixed_requests: int = 24
    mixed_min_prompt_len: int = 10
    mixed_max_prompt_len: int = 400
    mixed_output_tokens: int = 32
    mixed_layers: int = 4
    dtypes: tuple[str, ...] = ("bfloat16",)
    device: str = "cpu"
    sections: tuple[str, ...] = SECTIONS
    tensor_parallel_size: int = 1  # > 1: the tensor-parallel section runs
    seed: int = 0
    models_dir: str = str(DEFAULT_MODELS_DIR)
    # A call serving every request lasts far longer than the budget at the default size, so
    # its warm-up call is kept as the one sample (see TimerConfig); at tiny sizes it repeats.
    timer: TimerConfig = field(default_factory=lambda: TimerConfig(warmup=1, repeats=3,
                                                                   budget_s=10.0))

    def __post_init__(self) -> None:
        if not 1 <= self.min_prompt_len <= self.max_prompt_len:
            raise ValueError(f"need 1 <= min_prompt_len <= max_prompt_len, got {self}")
        if self.output_tokens < 2 or self.prefix_requests < 2 or self.prefix_rounds < 1:
            raise ValueError(f"need output_tokens >= 2, prefix_requests >= 2 and "
                             f"prefix_rounds >= 1, got {self}")
        if not (1 <= self.mixed_min_prompt_len <= self.mixed_max_prompt_len
                and self.mixed_requests >= 1 and self.mixed_output_tokens >= 2
                and self.mixed_layers >= 1):
            raise ValueError(f"need 1 <= mixed_min_prompt_len <= mixed_max_prompt_len, "
                             f"mixed_requests >= 1, mixed_output_tokens >= 2 and "
                             f"mixed_layers >= 1, got {self}")
        if any(section not in SECTIONS for section in self.sections):
            raise ValueError(f"sections must be some of {', '.join(SECTIONS)}, got "
                             f"{self.sections}")

    @classmethod
    def for_device(cls, device: str) -> EngineBenchConfig:
        """The defaults on ``device``: the class defaults (sized for two CPU cores) except on
        CUDA, where HF generates every request in one padded batch."""
        if torch.device(device).type != "cuda":
            return cls(device=device)
        return cls(hf_batch_size=64, device=device)

    @property
    def at_goal_size(self) -> bool:
        """Whether this run measures the model and workload the goals are set for."""
        shape = MODEL_SHAPES[MODEL]
        return ((self.layers, self.hidden_size, self.intermediate_size, self.num_requests,
                 self.min_prompt_len, self.max_prompt_len, self.output_tokens, self.prefix_len)
                == (shape.num_layers, shape.hidden_size, shape.intermediate_size, 64, 32, 512,
                    64, 512))

    @property
    def max_model_len(self) -> int:
        """The longest sequence either section holds."""
        return max(self.max_prompt_len + self.output_tokens,
                   self.prefix_len + self.suffix_len + 1)



def random_tokens(generator: torch.Generator, length: int) -> list[int]:
    """``length`` ordinary-token ids."""
    return torch.randint(0, QWEN3_ORDINARY_TOKENS, (length,), generator=generator).tolist()


def random_prompts(config: EngineBenchConfig) -> list[list[int]]:
    """``num_requests`` prompts of lengths drawn uniformly from ``min_prompt_len`` ..
    ``max_prompt_len``, with the config's seed."""
    generator = torch.Generator().manual_seed(config.seed)
    lengths = torch.randint(config.min_prompt_len, config.max_prompt_len + 1,
                            (config.num_requests,), generator=generator).tolist()
    return [random_tokens(generator, length) for length in lengths]


def percentile(values: Sequence[float], pct: int) -> float:
    """The ``pct``-th percentile of ``values`` (linear interpolation between samples)."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[pct - 1]


@dataclass
class RunSample:
    """One call serving every request: per request in prompt order, TTFT, TPOT and queue time
    (seconds), prompt tokens found cached and the generated tokens; the engine's counters for
    the call (fastllm only)."""

    ttft_s: list[float]
    tpot_s: list[float]
    queue_s: list[float]
    cached_tokens: list[int]
    tokens: list[list[int]]
    stats: dict[str, float] | None = None


def stats_since(before: EngineStats, after: EngineStats) -> dict[str, float]:
    """The engine's counters over one call: differences of the additive ones, the peak KV
    usage as it stands (the largest since the engine started)."""
    stats: dict[str, float] = {name: getattr(after, name) - getattr(before, name)
                               for name in ADDITIVE_STATS}
    stats["peak_kv_usage"] = after.peak_kv_usage
    return stats


def kv_cache_memory(model: DecoderLM, config: EngineBenchConfig) -> int:
    """Bytes of KV for every request at its full length, each rounded up to whole blocks (and
    at least one sequence of ``max_model_len``, as ``fastllm.LLM`` requires)."""
    spec = model.kv_cache_spec()
    blocks = -(-(config.max_prompt_len + config.output_tokens) // spec.block_size)
    longest = -(-config.max_model_len // spec.block_size)
    return max(config.num_requests * blocks, longest) * spec.bytes_per_block


def fastllm_call(llm: fastllm.LLM, prompts: list[list[int]], new_tokens: int,
                 samples: list[RunSample]) -> Callable[[], None]:
    """One ``LLM.generate`` over every prompt, appending its sample."""
    params = fastllm.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    inputs = [{"prompt_token_ids": prompt} for prompt in prompts]

    def call() -> None:
        before = copy.copy(llm.engine.stats)
        processed_s = llm.client.output_processor.process_s
        outputs = llm.generate(inputs, params, use_tqdm=False)
        metrics = [out.metrics for out in outputs]
        stats = stats_since(before, llm.engine.stats)
        # The output processor's time: detokenization, stop strings, logprobs.
        stats["detokenize_s"] = llm.client.output_processor.process_s - processed_s
        samples.append(RunSample(
            [m.ttft for m in metrics], [m.time_per_output_token for m in metrics],
            [m.queue_time for m in metrics], [m.num_cached_tokens for m in metrics],
            [list(out.outputs[0].token_ids) for out in outputs], stats))

    return call


@dataclass(frozen=True)
class PaddedBatch:
    """Prompts left-padded to one length: their indices among the prompts, ``input_ids`` and
    ``attention_mask`` ``[batch, longest]``."""

    indices: list[int]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def padded_batches(prompts: list[list[int]], batch_size: int, device: str) -> list[PaddedBatch]:
    """The prompts sorted by length, cut into batches of ``batch_size``, each left-padded with
    ``PAD_ID``."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = []
    for first in range(0, len(order), batch_size):
        indices = order[first:first + batch_size]
        longest = max(len(prompts[i]) for i in indices)
        input_ids = torch.full((len(indices), longest), PAD_ID, dtype=torch.long)
        attention_mask = torch.zeros((len(indices), longest), dtype=torch.long)
        for row, i in enumerate(indices):
            input_ids[row, longest - len(prompts[i]):] = torch.tensor(prompts[i])
            attention_mask[row, longest - len(prompts[i]):] = 1
        batches.append(PaddedBatch(indices, input_ids.to(device), attention_mask.to(device)))
    return batches


def hf_call(model: torch.nn.Module, batches: list[PaddedBatch], num_requests: int,
            new_tokens: int, samples: list[RunSample]) -> Callable[[], None]:
    """HF ``generate`` on each padded batch in turn, appending the sample of the whole call."""

    def call() -> None:
        ttft, tpot, queue = ([0.0] * num_requests for _ in range(3))
        tokens: list[list[int]] = [[] for _ in range(num_requests)]
        start = time.perf_counter()
        for batch in batches:
            clock = TokenClock()
            batch_start = time.perf_counter()
            out = model.generate(batch.input_ids, attention_mask=batch.attention_mask,
                                 do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, streamer=clock)
            # times[0] is the prompt, times[1] the first generated token, times[-1] the last.
            for row, i in enumerate(batch.indices):
                ttft[i] = clock.times[1] - start
                tpot[i] = (clock.times[-1] - clock.times[1]) / (new_tokens - 1)
                queue[i] = batch_start - start
                tokens[i] = out[row, batch.input_ids.shape[1]:].tolist()
        samples.append(RunSample(ttft, tpot, queue, [0] * num_requests, tokens))

    return call


def throughput_rows(config: EngineBenchConfig, folder: Path, dtype_name: str,
                    prompts: list[list[int]]) -> list[dict[str, object]]:
    """Loads both competitors in ``dtype_name`` and times them interleaved; returns the run's
    row and one row per request and competitor (of the last call)."""
    dtype = getattr(torch, dtype_name)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                              attn_implementation="sdpa").to(config.device).eval()
    model = fastllm.load(folder, dtype_name, config.device)
    llm = fastllm.LLM(folder, dtype=dtype_name, device=config.device,
                      max_model_len=config.max_model_len,
                      kv_cache_memory=kv_cache_memory(model, config),
                      enable_prefix_caching=False, max_num_seqs=config.num_requests,
                      max_num_batched_tokens=config.max_num_batched_tokens)
    samples: dict[str, list[RunSample]] = {"fastllm": [], "hf": []}
    batches = padded_batches(prompts, config.hf_batch_size, config.device)
    with torch.inference_mode():
        calls = {"fastllm": fastllm_call(llm, prompts, config.output_tokens,
                                         samples["fastllm"]),
                 "hf": hf_call(hf, batches, len(prompts), config.output_tokens, samples["hf"])}
        timings = compare(calls, config.timer, device=config.device)
    del hf, llm, model, calls
    model_pool.clear()  # fastllm.LLM shares loaded models through the pool: let this one go
    gc.collect()

    output_tokens = len(prompts) * config.output_tokens
    run: dict[str, object] = {
        "section": "throughput", "model": MODEL, "dtype": dtype_name, "layers": config.layers,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts), "output_tokens": output_tokens,
        "hf_batch_size": config.hf_batch_size,
        "hf_padded_prompt_tokens": sum(b.input_ids.numel() for b in batches)}
    requests: list[dict[str, object]] = []
    for name, timing in timings.items():
        # Throughput from the median call; per-request figures from the last call.
        last = samples[name][-1]
        run.update({f"{name}_call_{key}": value for key, value in timing.to_dict().items()})
        run[f"{name}_tok_s"] = output_tokens / timing.median_s
        for metric in ("ttft", "tpot", "queue"):
            values = getattr(last, f"{metric}_s")
            for pct in (50, 99):
                run[f"{name}_{metric}_p{pct}_ms"] = percentile(values, pct) * 1e3
        for i, prompt in enumerate(prompts):
            requests.append({"section": "request", "dtype": dtype_name, "competitor": name,
                             "request": i, "prompt_len": len(prompt),
                             "ttft_ms": last.ttft_s[i] * 1e3, "tpot_ms": last.tpot_s[i] * 1e3,
                             "queue_ms": last.queue_s[i] * 1e3,
                             "cached_tokens": last.cached_tokens[i]})
        wrong = [i for i, t in enumerate(last.tokens) if len(t) != config.output_tokens]
        if wrong:
            raise RuntimeError(f"{name} generated {len(last.tokens[wrong[0]])} tokens for "
                               f"request {wrong[0]}, asked for {config.output_tokens}")
    run["throughput_speedup_vs_hf"] = run["fastllm_tok_s"] / run["hf_tok_s"]
    agree = [leading_agreement(f, h) for f, h in zip(samples["fastllm"][-1].tokens,
                                                     samples["hf"][-1].tokens)]
    for row, tokens_agree in zip(requests, agree):  # the fastllm rows come first
        row["tokens_agree"] = tokens_agree
    run["requests_tokens_equal"] = sum(n == config.output_tokens for n in agree)
    run["tokens_agree_min"] = min(agree)
    stats = samples["fastllm"][-1].stats
    run.update(stats)
    run["detokenize_share"] = stats["detokenize_s"] / stats["step_s"]
    run["prefix_cache_hit_rate"] = (stats["prefix_cache_hits"] / stats["prefix_cache_queries"]
                                    if stats["prefix_cache_queries"] else 0.0)
    return [run, *requests]


def prefix_rows(config: EngineBenchConfig, folder: Path,
                dtype_name: str) -> list[dict[str, object]]:
    """Shared-system-prompt requests one after another on an LLM with prefix caching; returns
    the section's row and one row per timed request."""
    llm = fastllm.LLM(folder, dtype=dtype_name, device=config.device,
                      max_model_len=config.max_model_len, enable_prefix_caching=True,
                      max_num_batched_tokens=config.max_num_batched_tokens)
    params = fastllm.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    generator = torch.Generator().manual_seed(config.seed + 1)
    requests: list[dict[str, object]] = []
    before = copy.copy(llm.engine.stats)
    for round_index in range(-config.timer.warmup, config.prefix_rounds):
        if round_index == 0:
            before = copy.copy(llm.engine.stats)
        system = random_tokens(generator, config.prefix_len)
        for index in range(config.prefix_requests):
            prompt = system + random_tokens(generator, config.suffix_len)
            [out] = llm.generate([prompt], params, use_tqdm=False)
            if round_index >= 0:
                requests.append({"section": "prefix_request", "dtype": dtype_name,
                                 "round": round_index, "index": index,
                                 "prompt_len": len(prompt), "ttft_ms": out.metrics.ttft * 1e3,
                                 "cached_tokens": out.metrics.num_cached_tokens})
    stats = stats_since(before, llm.engine.stats)
    del llm
    model_pool.clear()
    gc.collect()

    cold = [r["ttft_ms"] for r in requests if r["index"] == 0]
    cached = [r["ttft_ms"] for r in requests if r["index"] > 0]
    cached_share = [r["cached_tokens"] / r["prompt_len"] for r in requests if r["index"] > 0]
    row: dict[str, object] = {
        "section": "prefix", "model": MODEL, "dtype": dtype_name, "layers": config.layers,
        "prefix_len": config.prefix_len, "suffix_len": config.suffix_len,
        "prefix_requests": config.prefix_requests, "prefix_rounds": config.prefix_rounds,
        "cold_ttft_ms": statistics.median(cold), "cached_ttft_ms": statistics.median(cached),
        "cached_ttft_p99_ms": percentile(cached, 99),
        "cached_token_share": statistics.mean(cached_share),
        "prefix_cache_hit_rate": stats["prefix_cache_hits"] / stats["prefix_cache_queries"]}
    row["prefix_ttft_ratio"] = row["cold_ttft_ms"] / row["cached_ttft_ms"]
    return [row, *requests]


def batch_invariant_rows(config: EngineBenchConfig, folder: Path, dtype_name: str,
                         prompts: list[list[int]]) -> list[dict[str, object]]:
    """The throughput section's requests on fastllm as it runs by default and with
    ``batch_invariant=True`` (each request computed as if alone: no GEMM for prefill rows, no
    split of a decode row's keys), calls alternating; returns the section's row: the cost of
    seeded output that ignores the batch."""
    samples: dict[str, list[RunSample]] = {"fastllm": [], "fastllm_invariant": []}
    memory = kv_cache_memory(fastllm.load(folder, dtype_name, config.device), config)
    llms = {name: fastllm.LLM(folder, dtype=dtype_name, device=config.device,
                              max_model_len=config.max_model_len, kv_cache_memory=memory,
                              enable_prefix_caching=False, max_num_seqs=config.num_requests,
                              max_num_batched_tokens=config.max_num_batched_tokens,
                              batch_invariant=name == "fastllm_invariant")
            for name in samples}
    with torch.inference_mode():
        calls = {name: fastllm_call(llm, prompts, config.output_tokens, samples[name])
                 for name, llm in llms.items()}
        timings = compare(calls, config.timer, device=config.device)
    del llms, calls
    model_pool.clear()
    gc.collect()
    output_tokens = len(prompts) * config.output_tokens
    row: dict[str, object] = {"section": "batch_invariant", "model": MODEL, "dtype": dtype_name,
                              "layers": config.layers, "num_requests": len(prompts)}
    for name, timing in timings.items():
        last = samples[name][-1]
        row.update({f"{name}_call_{key}": value for key, value in timing.to_dict().items()})
        row[f"{name}_tok_s"] = output_tokens / timing.median_s
        row[f"{name}_ttft_p50_ms"] = percentile(last.ttft_s, 50) * 1e3
        row[f"{name}_tpot_p50_ms"] = percentile(last.tpot_s, 50) * 1e3
    row["invariant_throughput_ratio"] = row["fastllm_invariant_tok_s"] / row["fastllm_tok_s"]
    row["requests_tokens_equal"] = sum(
        a == b for a, b in zip(samples["fastllm"][-1].tokens,
                               samples["fastllm_invariant"][-1].tokens))
    return [row]


def tensor_parallel_rows(config: EngineBenchConfig, folder: Path, dtype_name: str,
                         prompts: list[list[int]]) -> list[dict[str, object]]:
    """The throughput section's requests on ``tensor_parallel_size`` ranks and on one process,
    calls alternating; returns the section's row."""
    size = config.tensor_parallel_size
    memory = kv_cache_memory(fastllm.load(folder, dtype_name, config.device), config)
    threads = torch.get_num_threads()
    llms = {name: fastllm.LLM(folder, dtype=dtype_name, device=config.device,
                              max_model_len=config.max_model_len, kv_cache_memory=memory,
                              enable_prefix_caching=False, max_num_seqs=config.num_requests,
                              max_num_batched_tokens=config.max_num_batched_tokens,
                              tensor_parallel_size=size if name == "fastllm_tp" else 1)
            for name in ("fastllm", "fastllm_tp")}
    tp_threads = torch.get_num_threads()  # rank 0's share

    def with_threads(count: int, call: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            torch.set_num_threads(count)
            call()
        return run

    samples: dict[str, list[RunSample]] = {name: [] for name in llms}
    try:
        with torch.inference_mode():
            calls = {name: with_threads(threads if name == "fastllm" else tp_threads,
                                        fastllm_call(llm, prompts, config.output_tokens,
                                                     samples[name]))
                     for name, llm in llms.items()}
            timings = compare(calls, config.timer, device=config.device)
        executor = llms["fastllm_tp"].engine.executor
        broadcast_ms = 1e3 * executor.broadcast_s / llms["fastllm_tp"].engine.stats.steps
    finally:
        llms["fastllm_tp"].shutdown()
        torch.set_num_threads(threads)
    del llms, calls
    model_pool.clear()
    gc.collect()
    output_tokens = len(prompts) * config.output_tokens
    row: dict[str, object] = {"section": "tensor_parallel", "model": MODEL, "dtype": dtype_name,
                              "layers": config.layers, "num_requests": len(prompts),
                              "tensor_parallel_size": size, "rank_threads": tp_threads,
                              "broadcast_ms_per_step": broadcast_ms}
    for name, timing in timings.items():
        row.update({f"{name}_call_{key}": value for key, value in timing.to_dict().items()})
        row[f"{name}_tok_s"] = output_tokens / timing.median_s
        row[f"{name}_tpot_p50_ms"] = percentile(samples[name][-1].tpot_s, 50) * 1e3
    row["tp_throughput_ratio"] = row["fastllm_tp_tok_s"] / row["fastllm_tok_s"]
    row["requests_tokens_equal"] = sum(
        a == b for a, b in zip(samples["fastllm"][-1].tokens, samples["fastllm_tp"][-1].tokens))
    return [row]


def mixed_prompt_sets(config: EngineBenchConfig) -> list[list[list[int]]]:
    """One set of ``mixed_requests`` prompts per call the timer may make (warm-up and timed):
    the same lengths, drawn uniformly from ``mixed_min_prompt_len`` .. ``mixed_max_prompt_len``,
    with new tokens in each set (so no call finds an earlier one's prompts in the prefix
    cache)."""
    generator = torch.Generator().manual_seed(config.seed + 2)
    lengths = torch.randint(config.mixed_min_prompt_len, config.mixed_max_prompt_len + 1,
                            (config.mixed_requests,), generator=generator).tolist()
    return [[random_tokens(generator, length) for length in lengths]
            for _ in range(config.timer.warmup + config.timer.repeats)]


def in_turn(calls: Sequence[Callable[[], None]]) -> Callable[[], None]:
    """A call whose n-th run runs ``calls[n]``."""
    pending = iter(calls)
    return lambda: next(pending)()


def defaults_rows(config: EngineBenchConfig, folder: Path) -> list[dict[str, object]]:
    """``fastllm.LLM(folder)`` on every default (float32, the KV pool sized from the memory
    budget) against HF ``generate`` in float32 on mixed prompts; returns the section's row."""
    prompt_sets = mixed_prompt_sets(config)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                              attn_implementation="sdpa").to(config.device).eval()
    llm = fastllm.LLM(folder, device=config.device)  # the device alone is given
    new_tokens = config.mixed_output_tokens
    samples: dict[str, list[RunSample]] = {"fastllm": [], "hf": []}
    with torch.inference_mode():
        calls = {"fastllm": in_turn([fastllm_call(llm, prompts, new_tokens, samples["fastllm"])
                                     for prompts in prompt_sets]),
                 "hf": in_turn([hf_call(hf, padded_batches(prompts, config.hf_batch_size,
                                                           config.device),
                                        len(prompts), new_tokens, samples["hf"])
                                for prompts in prompt_sets])}
        timings = compare(calls, config.timer, device=config.device)
    kv_pool_tokens = llm.kv_cache.num_blocks * llm.kv_cache.spec.block_size
    row: dict[str, object] = {
        "section": "defaults", "model": MODEL, "dtype": "float32", "layers": config.mixed_layers,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_requests": config.mixed_requests, "min_prompt_len": config.mixed_min_prompt_len,
        "max_prompt_len": config.mixed_max_prompt_len, "output_tokens_each": new_tokens,
        "prompt_tokens": sum(len(p) for p in prompt_sets[0]),
        "max_model_len": llm.max_model_len, "kv_pool_tokens": kv_pool_tokens,
        "kv_pool_mib": llm.kv_cache.nbytes / 2**20,
        "preemptions": llm.engine.stats.preemptions}  # over every call
    del hf, llm, calls
    model_pool.clear()
    gc.collect()
    output_tokens = config.mixed_requests * new_tokens
    for name, timing in timings.items():
        row.update({f"{name}_call_{key}": value for key, value in timing.to_dict().items()})
        row[f"{name}_tok_s"] = output_tokens / timing.median_s
    row["throughput_speedup_vs_hf"] = row["fastllm_tok_s"] / row["hf_tok_s"]
    # Every prompt token and every output token but the last of each request, once.
    row["needed_tokens"] = row["prompt_tokens"] + config.mixed_requests * (new_tokens - 1)
    last = samples["fastllm"][-1]
    row["scheduled_tokens"] = last.stats["scheduled_tokens"]  # of the last call
    row["scheduled_over_needed"] = row["scheduled_tokens"] / row["needed_tokens"]
    row["steps"] = last.stats["steps"]
    row["peak_kv_usage"] = last.stats["peak_kv_usage"]
    agree = [leading_agreement(f, h) for f, h in zip(last.tokens, samples["hf"][-1].tokens)]
    row["requests_tokens_equal"] = sum(n == new_tokens for n in agree)
    return [row]


# Why the batch-invariant section does not run on CUDA (the engine refuses the mode there).
INVARIANT_LEFT_OUT = "batch_invariant=True has CPU kernels only; the engine refuses it on CUDA"


def run(config: EngineBenchConfig) -> list[dict[str, object]]:
    """Saves the random model, then measures the sections per dtype; returns the JSON rows."""
    prompts = random_prompts(config)
    rows = []
    sections = set(config.sections)
    with random_model_folder(config, "engine") as folder:
        for dtype_name in config.dtypes:
            if "throughput" in sections:
                rows += throughput_rows(config, folder, dtype_name, prompts)
                print(f"engine: {dtype_name} throughput measured", flush=True)
            if "prefix" in sections:
                rows += prefix_rows(config, folder, dtype_name)
                print(f"engine: {dtype_name} prefix cache measured", flush=True)
            if config.tensor_parallel_size > 1:
                rows += tensor_parallel_rows(config, folder, dtype_name, prompts)
                print(f"engine: {dtype_name} tensor parallelism measured", flush=True)
            if "batch_invariant" not in sections:
                continue
            if torch.device(config.device).type == "cuda":
                print(f"engine: batch-invariant section left out: {INVARIANT_LEFT_OUT}", flush=True)
                continue
            rows += batch_invariant_rows(config, folder, dtype_name, prompts)
            print(f"engine: {dtype_name} batch-invariant mode measured", flush=True)
    if "defaults" in sections:
        with random_model_folder(replace(config, layers=config.mixed_layers),
                                 "engine") as folder:
            rows += defaults_rows(config, folder)
            print("engine: LLM defaults measured", flush=True)
    return rows


def goal_summary(config: EngineBenchConfig, rows: list[dict[str, object]]) -> str:
    """One line: the goals and, at the goal size, each dtype's figures against them."""
    goal = (f"Goals: fastllm output tokens/s >= {GOAL_THROUGHPUT_SPEEDUP:g}x HF's, and TTFT "
            f"with a cached {config.prefix_len}-token system prompt >= "
            f"{GOAL_PREFIX_TTFT_RATIO:g}x lower than cold, on {MODEL} with 64 requests of 32-512 "
            "tokens and 64 output tokens")
    if not {"throughput", "prefix"} <= set(config.sections):
        return f"{goal}: not measured in this run (sections {', '.join(config.sections)})."
    if not config.at_goal_size or not rows:
        return (f"{goal}: not measured in this run (scaled down to {config.layers} of "
                f"{MODEL_SHAPES[MODEL].num_layers} layers, hidden {config.hidden_size}, "
                f"{config.num_requests} requests of {config.min_prompt_len}-"
                f"{config.max_prompt_len} tokens, {config.output_tokens} output tokens).")
    found = []
    prefix = {row["dtype"]: row for row in rows if row["section"] == "prefix"}
    for row in rows:
        if row["section"] != "throughput":
            continue
        speedup = row["throughput_speedup_vs_hf"]
        ratio = prefix[row["dtype"]]["prefix_ttft_ratio"]
        found.append(f"{row['dtype']} throughput {format_cell(speedup)}x "
                     f"({'met' if speedup >= GOAL_THROUGHPUT_SPEEDUP else 'NOT met'}), "
                     f"prefix TTFT {format_cell(ratio)}x "
                     f"({'met' if ratio >= GOAL_PREFIX_TTFT_RATIO else 'NOT met'})")
    return f"{goal}: " + "; ".join(found) + "."


def tables(config: EngineBenchConfig, rows: list[dict[str, object]]) -> dict[str, str]:
    """The markdown tables of the report, by title."""
    runs = [row for row in rows if row["section"] == "throughput"]
    prefix = [row for row in rows if row["section"] == "prefix"]
    about = (f"{config.layers} layers, hidden {config.hidden_size}, MLP "
             f"{config.intermediate_size}; {config.num_requests} requests arriving at once, "
             f"prompts of {config.min_prompt_len}-{config.max_prompt_len} random tokens, "
             f"{config.output_tokens} greedy output tokens each. fastllm: one generate call, "
             f"max_num_seqs {config.num_requests}, max_num_batched_tokens "
             f"{config.max_num_batched_tokens}, prefix caching off. HF: the prompts sorted by "
             f"length, in left-padded batches of {config.hf_batch_size}, one after another.")
    throughput = markdown_table(runs, {
        "dtype": "dtype", "fastllm_tok_s": "fastllm tok/s", "hf_tok_s": "HF tok/s",
        "throughput_speedup_vs_hf": "speedup vs HF", "fastllm_call_median_ms": "fastllm call (ms)",
        "hf_call_median_ms": "HF call (ms)", "hf_call_repeats": "calls timed",
        "prompt_tokens": "prompt tokens", "hf_padded_prompt_tokens": "HF padded prompt tokens",
        "requests_tokens_equal": "requests with equal tokens"})
    latency_rows = [{"dtype": row["dtype"], "competitor": label,
                     **{key: row[f"{name}_{key}"] for key in (
                         "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                         "queue_p50_ms")}}
                    for row in runs for name, label in COMPETITORS.items()]
    latency = markdown_table(latency_rows, {
        "dtype": "dtype", "competitor": "", "ttft_p50_ms": "TTFT p50 (ms)",
        "ttft_p99_ms": "TTFT p99 (ms)", "tpot_p50_ms": "TPOT p50 (ms)",
        "tpot_p99_ms": "TPOT p99 (ms)", "queue_p50_ms": "queue p50 (ms)"})
    stats = markdown_table(runs, {
        "dtype": "dtype", "steps": "steps", "scheduled_tokens": "tokens scheduled",
        "preemptions": "preemptions", "peak_kv_usage": "peak KV usage", "step_s": "step s",
        "detokenize_s": "detokenize s", "detokenize_share": "detokenize share",
        "prefix_cache_hit_rate": "prefix-cache hit rate"})
    prefix_table = markdown_table(prefix, {
        "dtype": "dtype", "cold_ttft_ms": "cold TTFT (ms)", "cached_ttft_ms": "cached TTFT (ms)",
        "cached_ttft_p99_ms": "cached TTFT p99 (ms)", "prefix_ttft_ratio": "cold / cached",
        "prefix_cache_hit_rate": "block hit rate", "cached_token_share": "prompt share cached"})
    invariant = markdown_table([row for row in rows if row["section"] == "batch_invariant"], {
        "dtype": "dtype", "fastllm_tok_s": "default tok/s",
        "fastllm_invariant_tok_s": "batch-invariant tok/s",
        "invariant_throughput_ratio": "batch-invariant / default",
        "fastllm_ttft_p50_ms": "default TTFT p50 (ms)",
        "fastllm_invariant_ttft_p50_ms": "batch-invariant TTFT p50 (ms)",
        "fastllm_tpot_p50_ms": "default TPOT p50 (ms)",
        "fastllm_invariant_tpot_p50_ms": "batch-invariant TPOT p50 (ms)",
        "requests_tokens_equal": "requests with equal greedy tokens"})
    parallel = markdown_table([row for row in rows if row["section"] == "tensor_parallel"], {
        "dtype": "dtype", "tensor_parallel_size": "ranks", "rank_threads": "threads a rank",
        "fastllm_tok_s": "one process tok/s", "fastllm_tp_tok_s": "tensor-parallel tok/s",
        "tp_throughput_ratio": "tensor-parallel / one process",
        "broadcast_ms_per_step": "step broadcast (ms)",
        "fastllm_tpot_p50_ms": "one process TPOT p50 (ms)",
        "fastllm_tp_tpot_p50_ms": "tensor-parallel TPOT p50 (ms)",
        "requests_tokens_equal": "requests with equal greedy tokens"})
    prefix_about = (f"{config.prefix_rounds} rounds of {config.prefix_requests} requests one "
                    f"after another, each a shared {config.prefix_len}-token system prompt "
                    f"(new per round) and a distinct {config.suffix_len}-token question, one "
                    "output token; cold: each round's first request, cached: the others.")

    def ran(section: str, text: str) -> str:
        return text if section in config.sections else "Not run: --sections leaves it out."

    return {
        f"Throughput: {config.num_requests} requests on a random-weight {MODEL} "
        "(speedup > 1: fastllm faster)":
            goal_summary(config, rows) + "\n\n"
            + ran("throughput", about + "\n\n" + throughput),
        "Latency per request (TTFT and queue time from the arrival of all requests; "
        "HF's per batch)": ran("throughput", latency),
        "fastllm engine per call (detokenize share: the output processor's detokenization and "
        "stop strings over the engine's step time)": ran("throughput", stats),
        "Prefix cache: TTFT with a shared system prompt (cold / cached > 1: the cache "
        "helps)": ran("prefix", prefix_about + "\n\n" + prefix_table),
        f"fastllm.LLM(path) on its defaults: {config.mixed_requests} mixed requests "
        "(speedup > 1: fastllm faster)": ran("defaults", defaults_table(config, rows)),
        "The cost of batch_invariant=True (seeded output independent of the batch, chunking "
        "and preemption in every dtype): the throughput section's requests, calls alternating":
            ran("batch_invariant", invariant if torch.device(config.device).type != "cuda"
                else f"Left out on {config.device}: {INVARIANT_LEFT_OUT}."),
        f"Tensor parallelism over {config.tensor_parallel_size} ranks: the throughput "
        "section's requests, calls alternating with one process":
            parallel if config.tensor_parallel_size > 1
            else "Not run: --tensor-parallel-size is 1.",
    }


def defaults_table(config: EngineBenchConfig, rows: list[dict[str, object]]) -> str:
    """The defaults section's check, what it ran, and its table."""
    found = [row for row in rows if row["section"] == "defaults"]
    preemptions = sum(row["preemptions"] for row in found)
    check = (f"Check: no preemption with LLM's default KV pool: {preemptions} "
             f"({'met' if preemptions == 0 else 'NOT met'})." if found else "")
    about = (f"fastllm.LLM(path) with every default (float32, prefix caching on, the KV pool "
             f"sized from the memory budget) against HF generate in float32, the prompts sorted "
             f"by length in left-padded batches of {config.hf_batch_size}; "
             f"{config.mixed_requests} requests arriving at once, "
             f"prompts of {config.mixed_min_prompt_len}-{config.mixed_max_prompt_len} random "
             f"tokens (new ones each call), {config.mixed_output_tokens} greedy output tokens "
             f"each, on a random-weight {MODEL} shape with {config.mixed_layers} layers. "
             "Preemptions: over every call; tokens scheduled: in the last call, against those "
             "needed (every prompt token, and every output token but each request's last, "
             "once).")
    return check + "\n\n" + about + "\n\n" + markdown_table(found, {
        "fastllm_tok_s": "fastllm tok/s", "hf_tok_s": "HF tok/s",
        "throughput_speedup_vs_hf": "speedup vs HF", "preemptions": "preemptions",
        "scheduled_tokens": "tokens scheduled", "needed_tokens": "tokens needed",
        "kv_pool_tokens": "KV pool tokens", "kv_pool_mib": "KV pool MiB",
        "peak_kv_usage": "peak KV usage", "requests_tokens_equal": "requests with equal tokens"})


def parse_args(argv: list[str] | None) -> tuple[EngineBenchConfig, Path]:
    """The config and output folder from the command line."""
    sizes = ("layers", "hidden_size", "intermediate_size", "num_requests", "min_prompt_len",
             "max_prompt_len", "output_tokens", "hf_batch_size", "max_num_batched_tokens",
             "prefix_len", "suffix_len", "prefix_requests", "prefix_rounds", "mixed_requests",
             "mixed_min_prompt_len", "mixed_max_prompt_len", "mixed_output_tokens",
             "mixed_layers", "tensor_parallel_size", "seed")
    return parse_model_bench_args(argv, EngineBenchConfig.for_device(parse_device(argv)),
                                  benchmark="engine", description=__doc__.split("\n\n")[0],
                                  sizes=sizes, choice_lists={"sections": SECTIONS},
                                  models_dir_help="folder holding qwen3_tokenizer")


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Runs the benchmark, writes ``engine.json`` and ``engine.md``, prints the tables; returns
    the JSON document."""
    config, out = parse_args(argv)
    transformers.logging.set_verbosity_error()  # no tied-weight or generation-config notes
    transformers.logging.disable_progress_bar()  # nor weight-loading bars
    rows = run(config)
    return publish(benchmark="engine", device=config.device, config=config, rows=rows,
                   tables=tables(config, rows), out=out)


if __name__ == "__main__":
    main()
