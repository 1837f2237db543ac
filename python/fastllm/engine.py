"""The engine: continuous batching over a paged KV cache with prefix caching and chunked prefill.

Each :meth:`Engine.step` builds one packed batch under a token budget: first the running
requests (one decode token each, or the next chunk of a prompt still being prefilled), then
waiting requests in arrival order while sequences, tokens and KV blocks last. A prompt whose
prefix is cached starts after it. A long prompt is prefilled a chunk per step, so it never
stalls the running decodes. When KV blocks run out, the newest running request is preempted:
its blocks are freed and it waits at the front of the queue to be recomputed (its prompt and
the tokens it had generated, often from the prefix cache); its random stream is keyed by its
own seed and token count, so its output does not change.

The host waits for the device once per step, for the sampled ids.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from fastllm import ops
from fastllm.decode_graphs import DecodeGraphs
from fastllm.host_to_device import device_tensor, to_device
from fastllm.kv_cache import KVCacheFullError, PagedKVCache
from fastllm.model_runner import run_step
from fastllm.models import DecoderLM
from fastllm.outputs import Logprob
from fastllm.request import Request
from fastllm.sampling import SampleOutput, SamplingTensors, sample_next_tokens
from fastllm.tokenizer import Tokenizer

__all__ = ["Engine", "EngineConfig", "EngineStats"]


@dataclass
class EngineConfig:
    """Scheduling limits.

    Attributes:
        max_num_seqs: most requests in a step's batch.
        max_num_batched_tokens: most tokens (decode tokens plus prefill chunks) in a step.
        max_prefill_chunk: most prompt tokens one request prefills in a step; None = as many
            as the token budget leaves.
        enforce_eager: on CUDA, run decode steps op by op instead of replaying CUDA graphs
            (:mod:`fastllm.decode_graphs`); other devices always run eagerly.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int | None = None
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_prefill_chunk is not None and (
                not isinstance(self.max_prefill_chunk, int) or self.max_prefill_chunk < 1):
            raise ValueError(f"max_prefill_chunk must be None or an int >= 1, got "
                             f"{self.max_prefill_chunk!r}")


@dataclass
class EngineStats:
    """Counters since the engine started."""

    steps: int = 0
    scheduled_tokens: int = 0
    preemptions: int = 0
    peak_kv_usage: float = 0.0  # the largest fraction of KV blocks held by running requests
    step_s: float = 0.0  # wall time in step()
    detokenize_s: float = 0.0  # of which: detokenization and stop checks
    prefix_cache_hits: int = 0  # prompt blocks reused (the block manager's counters)
    prefix_cache_queries: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries \
            else 0.0


@dataclass
class _Scheduled:
    request: Request
    start: int  # position of the first token computed this step
    tokens: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last token, so its logits give a token."""
        return self.start + len(self.tokens) == self.request.num_tokens


class Engine:
    """Runs many requests at once on one model and one paged KV cache. Not thread-safe: one
    caller at a time (``fastllm.LLM`` and ``fastllm.AsyncLLM`` hold a lock around it)."""

    def __init__(self, model: DecoderLM, tokenizer: Tokenizer, kv_cache: PagedKVCache,
                 config: EngineConfig, max_model_len: int) -> None:
        self.model, self.tokenizer, self.kv_cache = model, tokenizer, kv_cache
        self.config = config
        self.max_model_len = max_model_len
        self.vocab_size = model.config.vocab_size
        self.device = kv_cache.k_cache.device
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = EngineStats()
        self._seq_ids = itertools.count()
        self.decode_graphs = (
            DecodeGraphs(model, kv_cache, max_batch=config.max_num_seqs,
                         max_model_len=max_model_len)
            if self.device.type == "cuda" and not config.enforce_eager else None)

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues a request; a prompt that cannot fit the context or the KV pool is a
        ValueError for this request alone."""
        length = len(request.prompt_token_ids)
        if length >= self.max_model_len:
            raise ValueError(f"request {request.request_id}: the prompt has {length} tokens, "
                             f"which leaves no room to generate under max_model_len="
                             f"{self.max_model_len}")
        blocks = math.ceil((length + 1) / self.kv_cache.spec.block_size)
        if blocks > self.kv_cache.num_blocks:
            raise ValueError(f"request {request.request_id}: the prompt needs {blocks} KV "
                             f"blocks but the pool has {self.kv_cache.num_blocks}")
        if request.params.needs_penalties():
            prompt_mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            prompt_mask[request.prompt_token_ids] = True
            request.prompt_mask = to_device(prompt_mask, self.device)
            request.output_counts = torch.zeros(self.vocab_size, dtype=torch.int32,
                                                device=self.device)
        self.waiting.append(request)

    def abort_request(self, request: Request) -> None:
        """Ends a request now ("abort"): its KV blocks are freed at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.abort()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, request: Request) -> None:
        if request.seq_id is not None:
            self.kv_cache.block_manager.free(request.seq_id)
            request.seq_id = None

    def _preempt(self, request: Request) -> None:
        """Frees the request's blocks and queues it first, to be recomputed."""
        self.running.remove(request)
        self._release(request)
        request.metrics.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(request)

    # ---- scheduling --------------------------------------------------------------------------

    def _chunk(self, remaining: int, budget: int) -> int:
        limit = self.config.max_prefill_chunk or remaining
        return min(remaining, budget, limit)

    def _hold_new_tokens(self, request: Request) -> bool:
        """Gives the block manager the tokens the request sampled since its last step,
        preempting the newest running requests while blocks lack; False when the request
        itself had to go."""
        manager = self.kv_cache.block_manager
        new = request.all_token_ids[manager.num_tokens(request.seq_id):]
        while True:
            try:
                self.kv_cache.copy_blocks(manager.append_tokens(request.seq_id, new))
                return True
            except KVCacheFullError:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    return False

    def _schedule(self) -> list[_Scheduled]:
        manager = self.kv_cache.block_manager
        budget = self.config.max_num_batched_tokens
        batch: list[_Scheduled] = []
        preempted = self.stats.preemptions
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if not self._hold_new_tokens(request):
                continue  # it left the running list
            start = manager.num_computed_tokens(request.seq_id)
            n = self._chunk(request.num_tokens - start, budget)
            batch.append(_Scheduled(request, start, request.all_token_ids[start:start + n]))
            budget -= n
            i += 1
        # New requests only when nothing was preempted this step (they would take the blocks).
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and self.stats.preemptions == preempted):
            request = self.waiting[0]
            seq_id = next(self._seq_ids)
            tokens = request.all_token_ids  # a preempted request recomputes its output too
            try:
                cached = manager.allocate(seq_id, tokens)
            except KVCacheFullError:
                break
            self.waiting.popleft()
            self.running.append(request)
            request.seq_id = seq_id
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.perf_counter()
                request.metrics.num_cached_tokens = cached
            n = self._chunk(len(tokens) - cached, budget)
            batch.append(_Scheduled(request, cached, tokens[cached:cached + n]))
            budget -= n
        return batch

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Schedules, runs and samples one batch; returns the requests that got a token (their
        new text is in ``take_deltas()``; finished ones have left the engine)."""
        started = time.perf_counter()
        batch = self._schedule()
        if not batch:
            return []
        with torch.inference_mode():
            logits = run_step(self.model, self.kv_cache,
                              [s.request.seq_id for s in batch], [s.tokens for s in batch],
                              starts=[s.start for s in batch],
                              logits=[s.samples for s in batch],
                              decode_graphs=self.decode_graphs)
            sampling = [s.request for s in batch if s.samples]
            # SamplingParams checked every value on the host.
            with ops.trusted_inputs():
                sampled = self._sample(logits, sampling) if sampling else None
        self.stats.steps += 1
        self.stats.scheduled_tokens += sum(len(s.tokens) for s in batch)
        self.stats.peak_kv_usage = max(self.stats.peak_kv_usage,
                                       self.kv_cache.block_manager.usage)
        if sampled is not None:
            self._append_tokens(sampling, sampled)
        counters = self.kv_cache.block_manager.stats()
        self.stats.prefix_cache_hits = counters["hits"]
        self.stats.prefix_cache_queries = counters["queries"]
        self.stats.step_s += time.perf_counter() - started
        return sampling

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> SampleOutput:
        tensors = SamplingTensors.from_params([r.params for r in requests], self.vocab_size,
                                              self.device, seeds=[r.seed for r in requests])
        # Each request's random stream is keyed by (seed, tokens it has sampled): the batch
        # around it never changes its draws.
        offsets = device_tensor([len(r.output_token_ids) for r in requests], torch.int64,
                                self.device)
        prompt_mask = output_counts = None
        if tensors.needs_penalties:
            zeros_mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            zeros_counts = torch.zeros(self.vocab_size, dtype=torch.int32, device=self.device)
            prompt_mask = torch.stack([zeros_mask if r.prompt_mask is None else r.prompt_mask
                                       for r in requests])
            output_counts = torch.stack([zeros_counts if r.output_counts is None
                                         else r.output_counts for r in requests])
        sampled = sample_next_tokens(logits, tensors, offsets, prompt_mask=prompt_mask,
                                     output_counts=output_counts)
        if tensors.needs_penalties:
            one = torch.ones(1, dtype=torch.int32, device=self.device)
            for row, request in enumerate(requests):
                if request.output_counts is not None:  # counted on the device: no sync
                    request.output_counts.index_put_((sampled.tokens[row:row + 1],), one,
                                                     accumulate=True)
        return sampled

    def _append_tokens(self, requests: list[Request], sampled: SampleOutput) -> None:
        sampled = sampled.to_host()  # the step's one wait for the device
        tokens = sampled.tokens.tolist()
        started = time.perf_counter()  # after the sync: device time is not detokenization
        for row, (request, token) in enumerate(zip(requests, tokens)):
            if token < 0:  # how a GPU sampler under trusted_inputs marks a bad logits row
                raise ValueError(f"request {request.request_id}: its logits contain NaN or "
                                 f"+inf, or no finite value")
            logprobs = (self._logprob_entry(sampled, row, token, request.params.logprobs)
                        if request.params.logprobs is not None else None)
            request.append_token(token, logprobs)
            if request.finished:
                request.metrics.kv_usage = self.kv_cache.block_manager.usage
                self.running.remove(request)
                self._release(request)
        self.stats.detokenize_s += time.perf_counter() - started

    def _logprob_entry(self, sampled: SampleOutput, row: int, token: int,
                       num_logprobs: int) -> dict[int, Logprob]:
        """The sampled token's logprob, then the ``num_logprobs`` most likely tokens'."""
        top_ids = sampled.top_ids[row, :num_logprobs].tolist()
        top_logprobs = sampled.top_logprobs[row, :num_logprobs].tolist()
        ranks = {token_id: rank for rank, token_id in enumerate(top_ids, 1) if token_id >= 0}
        decode = self.tokenizer.decode
        entry = {token: Logprob(float(sampled.token_logprobs[row]), ranks.get(token),
                                decode([token], skip_special_tokens=False))}
        for token_id, logprob in zip(top_ids, top_logprobs):
            if token_id >= 0 and token_id != token:
                entry[token_id] = Logprob(logprob, ranks[token_id],
                                          decode([token_id], skip_special_tokens=False))
        return entry
