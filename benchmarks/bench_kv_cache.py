"""KV cache: paged decode attention, KV reuse across requests, and memory.

Each comparison is interleaved in one process:

- decode attention: ``fastllm.ops.attention`` over each sequence's keys stored back to back
  against ``fastllm.ops.paged_attention`` over the same keys scattered in ``block_size`` blocks
  of a shared pool in shuffled order (as a long-running server's pool ends up); goal: paged
  >= 0.9x the contiguous speed. Each one's GB/s counts the bytes it must move (K and V read,
  q read, the output written); with ``--copy-mib``, a ``copy_`` of that many MiB is timed in
  the same rounds, and paged decode's GB/s over the copy's (read plus written bytes) is its
  ``fraction_of_copy``; goal: >= 0.8 at batch >= 16 and >= 4096 keys;
- time to first token of a prompt whose prefix blocks are in the prefix cache against the same
  prompt computed cold (goal: >= 5x lower);
- independent-chunk prefill (block attention: a :class:`fastllm.ChunkedPrompt` of a prefix,
  reused chunks and a suffix) against a full causal prefill of the same tokens, with the chunks
  found in the store and with them encoded on the spot;
- how far independent-chunk prefill moves the next-token distribution from full causal
  attention, on the real stories260K model (``--models-dir``), over prompts cut from stories
  it writes itself.

The KV-reuse rows time ``fastllm.LLM.generate`` of one greedy token (the call lasts as long as
the time to the first token) on a model of ``--prefill-model``'s dimensions with random weights
and ``--prefill-layers`` layers (each layer costs the same, so the ratios do not depend on how
many are run), saved with the Qwen3 tokenizer (``--models-dir``). TTFT: each request is a shared
``--ttft-cached-len``-token prefix and a new tail, ``--ttft-prompt-len`` tokens in all, on an
``LLM`` with prefix caching off (cold) and one with it on (the prefix cached by an earlier
request). Independent chunks: an ``LLM``
with ``chunk_store_memory`` (a position-independent KV cache and a chunk store) and prefix
caching off, so every call computes the prefix anew: the peer is the same ``LLM`` given the
prompt's tokens as an ordinary prompt (a causal prefill over the same cache); "chunks reused"
finds every chunk in the store (filled by an earlier call); "chunks encoded" runs on an ``LLM``
whose store keeps nothing (``chunk_store_memory=0``), so each call encodes every chunk too.
The drift rows compare, in one batched ``generate`` on stories260K, each prompt as a
``ChunkedPrompt`` and as its tokens: the first position's log-probabilities of the whole
vocabulary (``SamplingParams(logprobs=vocab_size)``, so KL and top-1 are exact) and 32 greedy
tokens.

The memory table gives, per model shape, the KV bytes of one token and of one sequence at the
longest decode length, for the cache dtype.

Defaults depend on ``--device``. On the CPU: float32 and bfloat16, decode at batch 1, 8 and 32
over 4096 keys, no copy (sized for two cores). On CUDA: bfloat16, decode at batch 1, 4, 16 and
64 over 600, 1024, 4096, 16384 and 32768 keys beside a 1 GiB copy (the largest case, 64 sequences
of 32768 keys of 8 KV heads, holds 8 GiB of K/V back to back and 8 GiB in the pool; one case
is held at a time).
Sizes given on the command line replace the device's. The logit drift table runs on the CPU
whatever the device.

    python benchmarks/bench_kv_cache.py --out results
    python benchmarks/bench_kv_cache.py --out results --device cuda
"""

from __future__ import annotations

import argparse
import gc
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from torch import Tensor

import fastllm
from fastllm.bench.report import markdown_table, publish
from fastllm.bench.timer import TimerConfig, compare
from fastllm.bench.workloads import (MODEL_SHAPES, DeviceCopy, add_shape_arguments,
                                     make_attention_inputs, parse_device)
from fastllm.engine.chunked_prompt import ChunkedPrompt
from fastllm.kv_cache import KVCacheSpec, zeros_pool
from fastllm.models.pool import model_pool

# The random model folder is bench_generate's.
from bench_generate import DEFAULT_MODELS_DIR, random_model_folder

GOAL_PAGED_VS_CONTIGUOUS = 0.9
GOAL_CACHED_TTFT_SPEEDUP = 5.0
# Paged decode's GB/s over the copy's, at least, in the cases at least this large.
GOAL_FRACTION_OF_COPY, GOAL_COPY_MIN_BATCH, GOAL_COPY_MIN_KEYS = 0.8, 16, 4096


@dataclass(frozen=True)
class KVCacheBenchConfig:
    """What the KV-cache benchmark measures."""

    models: tuple[str, ...] = ("qwen3-0.6b", "llama-3-8b")
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    decode_batches: tuple[int, ...] = (1, 8, 32)
    decode_lens_k: tuple[int, ...] = (4096,)  # keys per decode sequence, one case each
    block_size: int = 16
    copy_mib: int = 0  # the copy timed beside each decode case; 0: none
    device: str = "cpu"
    timer: TimerConfig = field(default_factory=lambda: TimerConfig(warmup=2, repeats=20,
                                                                   budget_s=0.5))
    # KV reuse, on a random-weight model of prefill_model's dimensions with prefill_layers layers.
    prefill_model: str = "qwen3-0.6b"
    prefill_layers: int = 4
    ttft_prompt_len: int = 1024
    ttft_cached_len: int = 960
    chunk_prefix_len: int = 64
    num_chunks: int = 8
    chunk_len: int = 256
    chunk_suffix_len: int = 32
    prefill_timer: TimerConfig = field(default_factory=lambda: TimerConfig(warmup=1, repeats=5,
                                                                           budget_s=10.0))
    # Logit drift of block attention on a real model.
    models_dir: str = str(DEFAULT_MODELS_DIR)
    drift_prompts: int = 16

    @classmethod
    def for_device(cls, device: str) -> KVCacheBenchConfig:
        """The defaults on ``device``: the class defaults (sized for two CPU cores) except on
        CUDA, where decode runs in bfloat16 at batch 1 to 64 over 600 to 32768 keys beside a
        1 GiB copy, with more warm-up calls."""
        if torch.device(device).type != "cuda":
            return cls(device=device)
        return cls(dtypes=("bfloat16",), decode_batches=(1, 4, 16, 64),
                   decode_lens_k=(600, 1024, 4096, 16384, 32768), copy_mib=1024, device=device,
                   timer=TimerConfig(warmup=3, repeats=20, budget_s=0.5))


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
    pool_shape = (num_blocks, block_size, *k.shape[1:])
    k_cache = zeros_pool(pool_shape, k.dtype, k.device)  # as PagedKVCache allocates its pools
    v_cache = zeros_pool(pool_shape, k.dtype, k.device)
    positions = torch.arange(len_k, device=k.device)
    slots = (block_tables.long()[:, positions // block_size] * block_size
             + positions % block_size).flatten()  # [batch * len_k], packed order
    fastllm.ops.reshape_and_cache(k, v, k_cache, v_cache, slots)
    seq_lens = torch.full((batch,), len_k, dtype=torch.int32, device=k.device)
    return PagedKV(k_cache, v_cache, block_tables, seq_lens)


def decode_row(config: KVCacheBenchConfig, model: str, dtype_name: str, batch: int,
               len_k: int, copy: DeviceCopy | None) -> dict[str, object]:
    """Times contiguous against paged decode attention (and ``copy``, when given) on one
    batch; returns its row. Its K/V, held twice, are freed on return."""
    x = make_attention_inputs(MODEL_SHAPES[model], batch=batch, len_q=1, len_k=len_k,
                              dtype=getattr(torch, dtype_name), device=config.device)
    paged = to_paged(x.k, x.v, batch, len_k, config.block_size)
    competitors: dict[str, Callable[[], object]] = {
        "contiguous": lambda: fastllm.ops.attention(
            x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, 1, x.len_k),
        "paged": lambda: fastllm.ops.paged_attention(
            x.q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens,
            x.cu_seqlens_q, 1),
    }
    if copy is not None:
        competitors["copy"] = copy
    with fastllm.ops.trusted_inputs():  # as the engine calls it: no host copy of the tables
        timings = compare(competitors, config.timer, device=config.device)
    row: dict[str, object] = {"model": model, "dtype": dtype_name, "batch": batch,
                              "keys": len_k, "block_size": config.block_size}
    for name, timing in timings.items():
        row.update({f"{name}_{k}": v for k, v in timing.to_dict().items()})
    row["paged_vs_contiguous"] = timings["contiguous"].median_s / timings["paged"].median_s
    for name in ("contiguous", "paged"):
        row[f"{name}_gbps"] = x.io_bytes / timings[name].median_s / 1e9
    if copy is not None:
        row["copy_gbps"] = copy.gbps(timings["copy"])
        row["fraction_of_copy"] = row["paged_gbps"] / row["copy_gbps"]
    return row


def decode_rows(config: KVCacheBenchConfig) -> list[dict[str, object]]:
    """Times contiguous against paged decode attention for every model, dtype, key count and
    batch."""
    copy = DeviceCopy.of_mib(config.copy_mib, config.device) if config.copy_mib else None
    rows = []
    for model in config.models:
        for dtype_name in config.dtypes:
            for len_k in config.decode_lens_k:
                for batch in config.decode_batches:
                    row = decode_row(config, model, dtype_name, batch, len_k, copy)
                    rows.append(row)
                    figures = f"paged {row['paged_gbps']:.3g} GB/s"
                    if copy is not None:
                        figures += f", {row['fraction_of_copy']:.3g} of the copy"
                    print(f"kv_cache: {model} {dtype_name} batch={batch} keys={len_k} "
                          f"measured: {figures}, {row['paged_vs_contiguous']:.3g}x contiguous",
                          flush=True)
    return rows


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass(frozen=True)
class ReuseModelSizes:
    """The KV-reuse model's sizes, as :func:`bench_generate.save_random_model` reads them."""

    layers: int
    hidden_size: int
    intermediate_size: int
    models_dir: str
    seed: int = 0


# One output token: the call lasts as long as the time to the first token.
FIRST_TOKEN = fastllm.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def first_token(llm: fastllm.LLM, prompt: list[int] | ChunkedPrompt) -> fastllm.RequestOutput:
    """``llm.generate`` of one greedy token after ``prompt``."""
    [out] = llm.generate([prompt], FIRST_TOKEN, use_tqdm=False)
    return out


def reuse_rows(config: KVCacheBenchConfig) -> list[dict[str, object]]:
    """TTFT with a cached prefix vs cold, and independent-chunk prefill vs full prefill, each
    an ``LLM.generate`` of one token on a random-weight model saved with the Qwen3 tokenizer."""
    shape = MODEL_SHAPES[config.prefill_model]
    sizes = ReuseModelSizes(config.prefill_layers, shape.hidden_size, shape.intermediate_size,
                            config.models_dir)
    with random_model_folder(sizes, "kv_cache", config.prefill_model) as folder:
        rows = reuse_rows_of(config, folder)
    model_pool.clear()  # the LLMs shared the model through the pool: let it go
    gc.collect()
    print("kv_cache: KV reuse measured", flush=True)
    return rows


def reuse_rows_of(config: KVCacheBenchConfig, folder: Path) -> list[dict[str, object]]:
    """:func:`reuse_rows` on the model saved in ``folder``."""
    vocab = MODEL_SHAPES[config.prefill_model].vocab_size
    spec = fastllm.load(folder, device=config.device).kv_cache_spec(config.block_size)
    chunked = ChunkedPrompt(random_tokens(config.chunk_prefix_len, vocab, 2),
                            [random_tokens(config.chunk_len, vocab, 10 + i)
                             for i in range(config.num_chunks)],
                            random_tokens(config.chunk_suffix_len, vocab, 3))
    longest = max(config.ttft_prompt_len, len(chunked.token_ids)) + 1  # and the output token
    # Room for a request beside a cached prompt, and for a fork encoding each chunk.
    blocks = (2 * -(-longest // config.block_size) + config.num_chunks
              * -(-(config.chunk_prefix_len + config.chunk_len) // config.block_size))

    def llm(**kwargs: object) -> fastllm.LLM:
        return fastllm.LLM(folder, device=config.device, max_model_len=longest,
                           block_size=config.block_size,
                           kv_cache_memory=blocks * spec.bytes_per_block, **kwargs)

    base = {"model": config.prefill_model, "layers": config.prefill_layers, "dtype": "float32"}
    rows = []

    # TTFT of 1024-token prompts, cold (no prefix caching) and with a 960-token prefix cached:
    # every request brings a new tail, so only the shared prefix can be reused.
    prefix = random_tokens(config.ttft_cached_len, vocab, 0)
    tail_len = config.ttft_prompt_len - config.ttft_cached_len
    tail_seeds = itertools.count(1)

    def new_prompt() -> list[int]:
        return prefix + random_tokens(tail_len, vocab, next(tail_seeds))

    cold_llm, warm_llm = llm(enable_prefix_caching=False), llm()
    first_token(warm_llm, new_prompt())  # the request that leaves the prefix cached
    cached: list[int] = []
    timings = compare({"cold": lambda: first_token(cold_llm, new_prompt()),
                       "cached prefix": lambda: cached.append(
                           first_token(warm_llm, new_prompt()).metrics.num_cached_tokens)},
                      config.prefill_timer, device=config.device)
    rows.append({**base, "case": f"TTFT, {config.ttft_prompt_len}-token prompt",
                 "reused_tokens": min(cached),  # what each request reused, at least
                 "peer": "cold prefill", "method": "prefix cache hit",
                 "peer_ms": timings["cold"].median_s * 1e3,
                 "method_ms": timings["cached prefix"].median_s * 1e3,
                 "speedup": timings["cold"].median_s / timings["cached prefix"].median_s})
    del cold_llm, warm_llm

    # Independent chunks: [prefix][8 x 256][suffix], chunks reused from the store or encoded,
    # against a causal prefill of the same tokens on the LLM that reuses them. Prefix caching
    # is off: every call computes the prefix (and the whole causal prompt) anew.
    reuse_llm = llm(enable_prefix_caching=False,
                    chunk_store_memory=2 * config.num_chunks * config.chunk_len
                    * spec.bytes_per_token)
    encode_llm = llm(enable_prefix_caching=False, chunk_store_memory=0)  # keeps no chunk
    reuse_store = reuse_llm.engine.scheduler.chunk_index
    first_token(reuse_llm, chunked)  # fills the store
    misses = reuse_store.misses
    timings = compare({
        "full prefill": lambda: first_token(reuse_llm, chunked.token_ids),
        "chunks reused": lambda: first_token(reuse_llm, chunked),
        "chunks encoded": lambda: first_token(encode_llm, chunked),
    }, config.prefill_timer, device=config.device)
    if reuse_store.misses != misses or encode_llm.engine.scheduler.chunk_index.hits:
        raise RuntimeError("a chunk was encoded where the store had it, or found where it "
                           "should not be kept")
    case = (f"{config.chunk_prefix_len} + {config.num_chunks} x {config.chunk_len} + "
            f"{config.chunk_suffix_len} tokens")
    for method in ("chunks reused", "chunks encoded"):
        rows.append({**base, "case": f"independent chunks, {case}",
                     "reused_tokens": (config.num_chunks * config.chunk_len
                                       if method == "chunks reused" else 0),
                     "peer": "full causal prefill", "method": method,
                     "peer_ms": timings["full prefill"].median_s * 1e3,
                     "method_ms": timings[method].median_s * 1e3,
                     "speedup": timings["full prefill"].median_s / timings[method].median_s})
    return rows


def drift_rows(config: KVCacheBenchConfig) -> list[dict[str, object]]:
    """How far block attention moves the next-token distribution from causal attention on
    stories260K: prompts cut from its own stories into a prefix, 4 chunks and a suffix."""
    path = Path(config.models_dir) / "stories260K_hf"
    if not path.is_dir():
        print(f"kv_cache: {path} not found; skipping the logit drift table", flush=True)
        return []
    # Prefix caching off: the causal prompts share nothing with the chunked ones.
    llm = fastllm.LLM(path, block_size=config.block_size, enable_prefix_caching=False,
                      chunk_store_memory=0)
    vocab = llm.model.config.vocab_size
    n_chunks, chunk_len, prefix_len, suffix_len, continuation = 4, 24, 16, 8, 32
    need = prefix_len + n_chunks * chunk_len + suffix_len
    # Stories the model writes itself (sampled at temperature 1 from BOS), then cut up.
    stories = llm.generate([[1]] * config.drift_prompts, [
        fastllm.SamplingParams(temperature=1.0, seed=i, max_tokens=need - 1, ignore_eos=True)
        for i in range(config.drift_prompts)], use_tqdm=False)
    chunked, causal = [], []
    for output in stories:
        story = [1, *output.outputs[0].token_ids]
        chunked.append(ChunkedPrompt(
            story[:prefix_len], [story[prefix_len + c * chunk_len:prefix_len + (c + 1) * chunk_len]
                                 for c in range(n_chunks)], story[need - suffix_len:need]))
        causal.append(story[:need])
    # All in one batch: per prompt, its whole next-token distribution (the log-probabilities of
    # every token) and its greedy continuation, under block attention and causal attention.
    distribution = fastllm.SamplingParams(temperature=0, max_tokens=1, logprobs=vocab,
                                          ignore_eos=True)
    greedy = fastllm.SamplingParams(temperature=0, max_tokens=continuation, ignore_eos=True)
    n = len(chunked)
    outputs = llm.generate([*chunked, *causal, *chunked, *causal],
                           [distribution] * (2 * n) + [greedy] * (2 * n), use_tqdm=False)
    rows = []
    for i in range(n):
        q, p = (next_token_logprobs(out, vocab) for out in (outputs[i], outputs[n + i]))
        block, full = (out.outputs[0].token_ids for out in (outputs[2 * n + i], outputs[3 * n + i]))
        agree = next((t for t, (a, b) in enumerate(zip(full, block)) if a != b), continuation)
        rows.append({"prompt": i, "max_abs_logprob_diff": float((p - q).abs().max()),
                     "kl_full_to_chunks": float((p.exp() * (p - q)).sum()),
                     "same_top1": bool(p.argmax() == q.argmax()),
                     "greedy_tokens_agreeing": agree})
    print("kv_cache: logit drift measured", flush=True)
    return rows


def next_token_logprobs(output: fastllm.RequestOutput, vocab: int) -> Tensor:
    """``[vocab]`` log-probabilities of the first output position (all of them reported)."""
    entry = output.outputs[0].logprobs[0]
    if len(entry) != vocab:
        raise RuntimeError(f"{len(entry)} logprobs reported, not the whole vocabulary's {vocab}")
    logprobs = torch.empty(vocab)
    logprobs[list(entry)] = torch.tensor([logprob.logprob for logprob in entry.values()])
    return logprobs


def memory_rows(config: KVCacheBenchConfig) -> list[dict[str, object]]:
    """KV bytes per token and per sequence of decode length, per model shape and dtype."""
    rows = []
    for model in config.models:
        shape = MODEL_SHAPES[model]
        for dtype_name in config.dtypes:
            spec = KVCacheSpec(num_layers=shape.num_layers, n_kv_heads=shape.n_kv_heads,
                               head_dim=shape.head_dim, dtype=getattr(torch, dtype_name),
                               block_size=config.block_size)
            seq_tokens = max(config.decode_lens_k)
            blocks = -(-seq_tokens // config.block_size)
            rows.append({"model": model, "dtype": dtype_name,
                         "bytes_per_token": spec.bytes_per_token,
                         "seq_tokens": seq_tokens,
                         "mib_per_seq": blocks * spec.bytes_per_block / 2**20})
    return rows


def tables(decode: list[dict[str, object]], reuse: list[dict[str, object]],
           drift: list[dict[str, object]], memory: list[dict[str, object]]) -> dict[str, str]:
    """The markdown tables of the report, by title."""
    worst = min((row["paged_vs_contiguous"] for row in decode), default=float("nan"))
    verdict = "met" if worst >= GOAL_PAGED_VS_CONTIGUOUS else "NOT met"
    summary = (f"Goal: paged >= {GOAL_PAGED_VS_CONTIGUOUS}x the contiguous cache's speed: "
               f"worst case measured {worst:.2f}x ({verdict}).\n\n" + copy_goal_summary(decode))
    decode_columns = {
        "model": "model", "dtype": "dtype", "batch": "batch", "keys": "keys",
        "block_size": "block size", "contiguous_median_ms": "contiguous (ms)",
        "paged_median_ms": "paged (ms)", "paged_vs_contiguous": "paged speed vs contiguous",
        "contiguous_gbps": "contiguous GB/s", "paged_gbps": "paged GB/s"}
    if any("copy_gbps" in row for row in decode):
        decode_columns |= {"copy_gbps": "copy GB/s", "fraction_of_copy": "paged / copy"}
    decode_table = markdown_table(decode, decode_columns)
    memory_table = markdown_table(memory, {
        "model": "model", "dtype": "dtype", "bytes_per_token": "KV bytes per token",
        "seq_tokens": "tokens per sequence", "mib_per_seq": "MiB per sequence"})
    ttft = [row["speedup"] for row in reuse if row["method"] == "prefix cache hit"]
    ttft_verdict = ("met" if min(ttft) >= GOAL_CACHED_TTFT_SPEEDUP else "NOT met") if ttft else ""
    reuse_summary = (f"Goal: TTFT with the prefix cached >= {GOAL_CACHED_TTFT_SPEEDUP}x lower "
                     f"than cold: {min(ttft):.1f}x ({ttft_verdict})." if ttft else "")
    reuse_table = markdown_table(reuse, {
        "case": "case", "model": "model", "layers": "layers", "reused_tokens": "reused tokens",
        "peer": "peer", "peer_ms": "peer (ms)", "method": "method", "method_ms": "method (ms)",
        "speedup": "speedup"})
    result = {"Decode attention: paged pool vs contiguous cache (speed > 1: paged faster)":
              summary + "\n\n" + decode_table,
              "KV reuse: prefix cache and independent chunks (random weights)":
              reuse_summary + "\n\n" + reuse_table}
    if drift:
        n = len(drift)
        summary_row = {
            "prompts": n,
            "median_kl": sorted(r["kl_full_to_chunks"] for r in drift)[n // 2],
            "max_kl": max(r["kl_full_to_chunks"] for r in drift),
            "median_max_logprob_diff": sorted(r["max_abs_logprob_diff"] for r in drift)[n // 2],
            "same_top1": sum(r["same_top1"] for r in drift) / n,
            "median_greedy_agreeing": sorted(r["greedy_tokens_agreeing"] for r in drift)[n // 2]}
        about = ("Prompts: BOS + 15 story tokens, 4 chunks of 24, 8 suffix tokens, each generated "
                 "as a ChunkedPrompt and as one causal prompt in one LLM.generate batch: the "
                 "log-probabilities of every next token, and 32 greedy tokens.")
        result["Block attention vs causal attention on stories260K (next-token distribution)"] = (
            about + "\n\n" + markdown_table([summary_row], {
                "prompts": "prompts", "median_kl": "median KL(causal, chunks)",
                "max_kl": "max KL", "median_max_logprob_diff": "median max abs logprob diff",
                "same_top1": "same next token", "median_greedy_agreeing":
                "median greedy tokens before the first difference"}))
    result["KV memory (all layers, K and V)"] = memory_table
    return result


def copy_goal_summary(decode: list[dict[str, object]]) -> str:
    """One line: paged decode's worst fraction of the copy bandwidth where the goal is set."""
    goal = (f"Goal: paged decode >= {GOAL_FRACTION_OF_COPY:g} of the copy's GB/s at batch >= "
            f"{GOAL_COPY_MIN_BATCH} and >= {GOAL_COPY_MIN_KEYS} keys")
    judged = [row["fraction_of_copy"] for row in decode if "fraction_of_copy" in row
              and row["batch"] >= GOAL_COPY_MIN_BATCH and row["keys"] >= GOAL_COPY_MIN_KEYS]
    if not judged:
        return f"{goal}: not measured in this run (no copy, or no case that large)."
    worst = min(judged)
    verdict = "met" if worst >= GOAL_FRACTION_OF_COPY else "NOT met"
    return f"{goal}: worst case measured {worst:.2f} ({verdict})."


def parse_args(argv: list[str] | None) -> tuple[KVCacheBenchConfig, Path]:
    """The config and output folder from the command line."""
    defaults = KVCacheBenchConfig.for_device(parse_device(argv))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser, benchmark="kv_cache", models=defaults.models,
                        dtypes=defaults.dtypes)
    parser.add_argument("--decode-batches", type=int, nargs="+",
                        default=list(defaults.decode_batches), help="default %(default)s")
    parser.add_argument("--decode-lens-k", "--decode-len-k", type=int, nargs="+",
                        default=list(defaults.decode_lens_k),
                        help="keys per decode sequence, a case each (default %(default)s)")
    parser.add_argument("--block-size", type=int, default=defaults.block_size,
                        help="tokens per cache block (default %(default)s)")
    parser.add_argument("--copy-mib", type=int, default=defaults.copy_mib,
                        help="MiB of the copy timed beside each decode case, the bandwidth "
                             "paged decode is judged against; 0: none (default %(default)s)")
    parser.add_argument("--device", default=defaults.device,
                        help="cpu or cuda; the other defaults depend on it (default "
                             "%(default)s)")
    parser.add_argument("--prefill-model", choices=sorted(MODEL_SHAPES),
                        default=defaults.prefill_model,
                        help="dimensions of the KV-reuse model (default %(default)s)")
    sizes = ("prefill_layers", "ttft_prompt_len", "ttft_cached_len", "chunk_prefix_len",
             "num_chunks", "chunk_len", "chunk_suffix_len", "drift_prompts")
    for name in sizes:
        parser.add_argument("--" + name.replace("_", "-"), type=int,
                            default=getattr(defaults, name), help="default %(default)s")
    parser.add_argument("--models-dir", type=Path, default=defaults.models_dir,
                        help="folder holding stories260K_hf and qwen3_tokenizer (default "
                             "%(default)s)")
    TimerConfig.add_arguments(parser, defaults.timer)
    args = parser.parse_args(argv)
    timer = TimerConfig.from_arguments(args)
    config = KVCacheBenchConfig(
        models=tuple(args.models), dtypes=tuple(args.dtypes),
        decode_batches=tuple(args.decode_batches), decode_lens_k=tuple(args.decode_lens_k),
        block_size=args.block_size, copy_mib=args.copy_mib, device=args.device, timer=timer,
        prefill_model=args.prefill_model, models_dir=str(args.models_dir),
        # Prefills last seconds: fewer repeats than the decode timer's, the same warm-up.
        prefill_timer=TimerConfig(warmup=min(timer.warmup, 1), repeats=min(timer.repeats, 5),
                                  budget_s=max(timer.budget_s, 10.0)),
        **{name: getattr(args, name) for name in sizes})
    return config, args.out


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Runs the benchmark, writes ``kv_cache.json`` and ``kv_cache.md``, prints the tables;
    returns the JSON document."""
    config, out = parse_args(argv)
    transformers.logging.disable_progress_bar()  # no bars saving the random model
    with torch.inference_mode():
        decode = decode_rows(config)
        reuse = reuse_rows(config)
        drift = drift_rows(config)
    memory = memory_rows(config)
    return publish(benchmark="kv_cache", device=config.device, config=config,
                   rows=decode + reuse + drift + memory,
                   tables=tables(decode, reuse, drift, memory), out=out)


if __name__ == "__main__":
    main()
