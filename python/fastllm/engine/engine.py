"""The engine: continuous batching over a paged KV cache with prefix caching and chunked prefill.

Each :meth:`Engine.step` asks the :class:`~fastllm.engine.scheduler.Scheduler` (the one owner of
KV state) for a batch, has the :class:`~fastllm.engine.model_runner.ModelRunner` run it, tells
the scheduler what was computed, then samples one token for each request that reached the end
of its tokens. A preempted request's random stream is keyed by its own seed and token count, so
its output does not change when it is recomputed.

The host waits for the device once per step, for the sampled ids.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from fastllm import ops
from fastllm.engine.decode_graphs import DecodeGraphs
from fastllm.engine.model_runner import ModelRunner, ScheduledBatch, StepLogits
from fastllm.engine.outputs import Logprob
from fastllm.engine.request import Request
from fastllm.engine.scheduler import Scheduler, SchedulerConfig
from fastllm.engine.structured_output import GrammarCompiler, grammar_bitmask
from fastllm.kv_cache import ChunkKVStore, PagedKVCache
from fastllm.models import DecoderLM
from fastllm.models.pool import resolve_dtype
from fastllm.ops.host_to_device import device_tensor, to_device
from fastllm.sampling import SampleOutput, SamplingTensors, draw, mask_tokens, penalize
from fastllm.tokenizer import Tokenizer

__all__ = ["Engine", "EngineConfig", "EngineStats"]

logger = logging.getLogger("fastllm")


@dataclass
class EngineConfig:
    """Scheduling limits and the KV cache's dtype.

    Attributes:
        max_num_seqs: most requests in a step's batch.
        max_num_batched_tokens: most tokens (decode tokens plus prefill chunks) in a step.
        max_prefill_chunk: most prompt tokens one request prefills in a step; None = as many
            as the token budget leaves.
        enforce_eager: on CUDA, run decode steps op by op instead of replaying CUDA graphs
            (:mod:`fastllm.engine.decode_graphs`); other devices always run eagerly.
        kv_cache_dtype: what the KV cache stores, as vLLM's option: "auto" (the model's
            dtype), or "float32", "bfloat16", "float16" (or a torch dtype). A float32 model may
            keep K/V in bfloat16 or float16, half the memory and half the bytes decode
            attention reads (as llama.cpp's default F16 cache); K/V are rounded once as they
            are cached and attention always reads them back from the cache, so whether a
            sequence's keys came from this step or an earlier one (chunked prefill, prefix
            hits, preemption) moves its result no more than rounding noise. Not on CUDA, whose
            cache is in the model's dtype.
        batch_invariant: run every step under :func:`fastllm.ops.batch_invariant`: each
            request's arithmetic does not depend on the others in its steps, on how its prompt
            was chunked or on a preemption, so a seeded request gives the same tokens alone or
            in any batch, in every dtype (without it that holds in float32 decode batches, not
            across prefill and decode or in 16 bits). Costs prefill speed (no GEMM); CPU only.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int | None = None
    enforce_eager: bool = False
    kv_cache_dtype: str | torch.dtype = "auto"
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_prefill_chunk is not None and (
                not isinstance(self.max_prefill_chunk, int) or self.max_prefill_chunk < 1):
            raise ValueError(f"max_prefill_chunk must be None or an int >= 1, got "
                             f"{self.max_prefill_chunk!r}")
        for name in ("enforce_eager", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.cache_dtype(torch.float32)  # a bad name fails here, before anything is loaded

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's storage dtype for a model whose activations are ``model_dtype``."""
        if isinstance(self.kv_cache_dtype, str) and self.kv_cache_dtype == "auto":
            return model_dtype
        try:
            return resolve_dtype(self.kv_cache_dtype)
        except ValueError:
            raise ValueError(f"kv_cache_dtype must be 'auto', 'float32', 'bfloat16' or "
                             f"'float16', got {self.kv_cache_dtype!r}") from None


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


class Engine:
    """Runs many requests at once on one model and one paged KV cache. Not thread-safe: one
    caller at a time (``fastllm.LLM`` and ``fastllm.AsyncLLM`` hold a lock around it)."""

    def __init__(self, model: DecoderLM, tokenizer: Tokenizer, kv_cache: PagedKVCache,
                 config: EngineConfig, max_model_len: int,
                 chunk_store: ChunkKVStore | None = None) -> None:
        self.model, self.tokenizer, self.kv_cache = model, tokenizer, kv_cache
        self.config = config
        self.max_model_len = max_model_len
        self.vocab_size = model.config.vocab_size
        self.device = kv_cache.k_cache.device
        # The model's spec for the configured dtype: a pairing the ops refuse fails here.
        cache_dtype = model.kv_cache_spec(kv_cache.spec.block_size,
                                          config.cache_dtype(model.dtype)).dtype
        if kv_cache.spec.dtype != cache_dtype:
            raise ValueError(f"the KV cache stores {kv_cache.spec.dtype} but kv_cache_dtype="
                             f"{config.kv_cache_dtype!r} asks for {cache_dtype} (model: "
                             f"{model.dtype})")
        if self.device.type == "cuda" and cache_dtype != model.dtype:
            raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r}: on CUDA the KV cache "
                             f"must be in the model's dtype ({model.dtype}); paged attention's "
                             f"CUDA kernels read no other")
        if self.device.type == "cuda" and config.batch_invariant:
            raise ValueError("batch_invariant=True: only the CPU kernels have a batch-invariant "
                             "mode")
        self.stats = EngineStats()
        self.scheduler = Scheduler(
            kv_cache, SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                      max_num_batched_tokens=config.max_num_batched_tokens,
                                      max_prefill_chunk=config.max_prefill_chunk),
            max_model_len, chunk_store)
        decode_graphs = (
            DecodeGraphs(model, kv_cache, max_batch=config.max_num_seqs,
                         max_model_len=max_model_len)
            if self.device.type == "cuda" and not config.enforce_eager else None)
        self.runner = ModelRunner(model, kv_cache, decode_graphs)
        self._grammars: GrammarCompiler | None = None  # built for the first constrained request
        self._failed: list[Request] = []  # the requests the current step failed

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues a request; a prompt that cannot fit the context or the KV pool is a
        ValueError for this request alone, as is a structured output constraint that does
        not compile."""
        if request.params.structured_outputs is not None and request.score_token_ids is None:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
            request.grammar = self._grammars.matcher(request.params.structured_outputs)
        self.scheduler.add_request(request)
        if request.params.needs_penalties() and request.score_token_ids is None:
            prompt_mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            prompt_mask[request.prompt_token_ids] = True
            request.prompt_mask = to_device(prompt_mask, self.device)
            request.output_counts = torch.zeros(self.vocab_size, dtype=torch.int32,
                                                device=self.device)

    def abort_request(self, request: Request) -> None:
        """Ends a request now ("abort"): its KV blocks are freed at once."""
        self.scheduler.finish_request(request)
        request.abort()

    def fail_request(self, request: Request, error: Exception) -> None:
        """Ends a request that cannot go on (finish_reason "error", ``error`` kept on it): its
        KV blocks are freed at once."""
        logger.warning("request %s failed: %s", request.request_id, error)
        self.scheduler.finish_request(request)
        request.fail(error)
        self._failed.append(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks (prefilling or decoding)."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for their first (or, after a preemption, next) schedule."""
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        """The fraction of KV blocks held by requests now."""
        return self.scheduler.usage

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Schedules, runs and samples one batch; returns the requests that got a token or
        finished (their new text is in ``take_deltas()``; finished ones have left the
        engine).

        A request that fails in the step fails alone (:meth:`fail_request`): when the model
        step raises, each request's share is run again alone; when sampling raises, each row is
        sampled alone. The others go on as if it had not been there."""
        started = time.perf_counter()
        self._failed = []
        scheduled = self.scheduler.schedule()
        self.stats.preemptions = self.scheduler.num_preemptions
        if scheduled is None:
            return []
        batch, owners = scheduled
        scored, sampling, logits = [], [], []
        with torch.inference_mode(), ops.batch_invariant(self.config.batch_invariant):
            for part, part_owners, output in self._execute(batch, owners):
                scored += self.scheduler.update_from_output(part, part_owners, output)
                sampling += [owner for owner, sequence in zip(part_owners, part.sequences)
                             if sequence.logit_token_ids == "all"]
                if output.logits is not None:
                    logits.append(output.logits)
            sampled = None
            if sampling:
                # SamplingParams checked every value on the host.
                with ops.trusted_inputs():
                    sampling, sampled = self._sample(
                        logits[0] if len(logits) == 1 else torch.cat(logits), sampling)
        self.stats.steps += 1
        self.stats.scheduled_tokens += batch.num_tokens
        self.stats.peak_kv_usage = max(self.stats.peak_kv_usage, self.scheduler.usage)
        for request in scored:
            request.finish_prompt()
            self._finish(request)
        if sampled is not None:
            self._append_tokens(sampling, sampled)
        counters = self.scheduler.prefix_cache_counters()
        self.stats.prefix_cache_hits = counters["hits"]
        self.stats.prefix_cache_queries = counters["queries"]
        self.stats.step_s += time.perf_counter() - started
        return list(dict.fromkeys(scored + sampling + self._failed))

    def _execute(self, batch: ScheduledBatch, owners: list[Request]
                 ) -> list[tuple[ScheduledBatch, list[Request], StepLogits]]:
        """The model step, as (batch, owners, logits) parts: the whole batch or, when it raises,
        each request's share run alone (nothing was marked computed yet, so a share runs again
        as it was), the ones that raise again failed."""
        try:
            return [(batch, owners, self.runner.execute(batch))]
        except Exception as error:  # not KeyboardInterrupt: that ends the caller's requests
            if len(set(owners)) == 1:
                self.fail_request(owners[0], _request_error(
                    "the model step failed on this request", error))
                return []
        parts = []
        for part, part_owners in self.scheduler.split_batch(batch, owners):
            try:
                parts.append((part, part_owners, self.runner.execute(part)))
            except Exception as error:
                self.fail_request(part_owners[0], _request_error(
                    "the model step failed on this request", error))
        return parts

    def _finish(self, request: Request) -> None:
        request.metrics.kv_usage = self.scheduler.usage
        self.scheduler.finish_request(request)

    def _sample(self, logits: torch.Tensor, requests: list[Request]
                ) -> tuple[list[Request], SampleOutput | None]:
        """A token for each request; returns the requests that got one and their rows. When
        the batch cannot be sampled (the CPU sampler raises on a row whose logits hold NaN or
        +inf, e.g. after its penalties overflowed), each row is sampled alone and the requests
        whose row still fails fail alone. A row's draw never depends on the other rows, so the
        others get the tokens the batch would have given them."""
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
        constrained = [row for row, request in enumerate(requests) if request.grammar is not None]
        if constrained:  # before the penalties: a disallowed token stays -inf whatever they add
            mask_tokens(logits, constrained,
                        grammar_bitmask([requests[row].grammar for row in constrained]))
        penalized = not tensors.needs_penalties
        try:
            if not penalized:
                penalize(logits, tensors, prompt_mask, output_counts)
                penalized = True  # every row: the op raises before it writes, or not at all
            kept, sampled = requests, draw(logits, tensors, offsets)
        except Exception:
            kept, parts = [], []
            for row, request in enumerate(requests):
                rows = slice(row, row + 1)
                try:
                    if not penalized:
                        penalize(logits[rows], tensors.rows(rows), prompt_mask[rows],
                                 output_counts[rows])
                    parts.append(draw(logits[rows], tensors.rows(rows), offsets[rows]))
                except Exception as error:
                    self.fail_request(request, _request_error(
                        "this request's logits (after its penalties and logit_bias) cannot be "
                        "sampled", error))
                    continue
                kept.append(request)
            sampled = SampleOutput.cat(parts) if parts else None
        if tensors.needs_penalties and sampled is not None:
            one = torch.ones(1, dtype=torch.int32, device=self.device)
            for row, request in enumerate(kept):
                if request.output_counts is not None:  # counted on the device: no sync
                    request.output_counts.index_put_((sampled.tokens[row:row + 1],), one,
                                                     accumulate=True)
        return kept, sampled

    def _append_tokens(self, requests: list[Request], sampled: SampleOutput) -> None:
        sampled = sampled.to_host()  # the step's one wait for the device
        tokens = sampled.tokens.tolist()
        started = time.perf_counter()  # after the sync: device time is not detokenization
        for row, (request, token) in enumerate(zip(requests, tokens)):
            if token < 0:  # how a GPU sampler under trusted_inputs marks a bad logits row
                self.fail_request(request, ValueError(
                    "this request's logits (after its penalties and logit_bias) contain NaN or "
                    "+inf, or no finite value"))
                continue
            try:
                logprobs = (self._logprob_entry(sampled, row, token, request.params.logprobs)
                            if request.params.logprobs is not None else None)
                request.append_token(token, logprobs)
            except Exception as error:  # e.g. its tokenizer cannot decode the token
                self.fail_request(request, _request_error(
                    f"this request's token {token} cannot be added", error))
                continue
            if request.finished:
                self._finish(request)
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


def _request_error(what: str, error: Exception) -> Exception:
    """``error`` with what failed said first (a ValueError stays one), chained to it."""
    said = (ValueError if isinstance(error, ValueError) else RuntimeError)(f"{what}: {error}")
    said.__cause__ = error
    return said
