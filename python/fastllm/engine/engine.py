"""The engine: continuous batching over a paged KV cache with prefix caching and chunked prefill.

Each :meth:`Engine.step` asks the :class:`~fastllm.engine.scheduler.Scheduler` (the one owner of
KV state) for a batch, has the :class:`~fastllm.engine.model_runner.ModelRunner` run it, tells
the scheduler what was computed, then samples one token for each request that reached the end
of its tokens. A preempted request's random stream is keyed by its own seed and token count, so
its output does not change when it is recomputed.

With ``speculative`` set (:mod:`fastllm.engine.speculative`), a decoding request's step also
verifies the tokens drafted for it: they are sampled row by row as plain decode steps would
sample them, the leading ones that match are kept, and the scheduler drops the rest's KV.

The host waits for the device once per step, for the sampled ids. A step's host data (the model's
inputs and the sampler's parameters) reach the device in one copy, and its samples come back in
one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from fastllm import ops
from fastllm.engine.decode_graphs import DecodeGraphs
from fastllm.engine.model_runner import (ModelRunner, ScheduledBatch, ScheduledSequence,
                                         StepLogits)
from fastllm.engine.outputs import Logprob, spec_acceptance_rate, spec_mean_accepted_length
from fastllm.engine.request import Request
from fastllm.engine.scheduler import Scheduler, SchedulerConfig
from fastllm.engine.structured_output import GrammarCompiler, grammar_bitmask
from fastllm.engine.speculative import (DraftLength, DraftModelProposer, NgramProposer,
                                        SpeculativeConfig, StepCosts, accepted_length)
from fastllm.kv_cache import ChunkKVStore, PagedKVCache
from fastllm.models import DecoderLM
from fastllm.models.pool import load, resolve_dtype
from fastllm.ops.host_to_device import StagingBuffer, to_device
from fastllm.sampling import SampleOutput, SamplingTensors, draw, mask_tokens, penalize
from fastllm.tokenizer import Tokenizer

__all__ = ["Engine", "EngineConfig", "EngineStats"]

logger = logging.getLogger("fastllm")
T = TypeVar("T")


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
        speculative: speculative decoding, a :class:`~fastllm.engine.speculative.
            SpeculativeConfig` or a dict of its fields, e.g. ``{"method": "ngram",
            "num_speculative_tokens": 4}`` or ``{"method": "draft", "model": PATH}``; None
            (default) drafts nothing. Tokens are the same with it as without.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int | None = None
    enforce_eager: bool = False
    kv_cache_dtype: str | torch.dtype = "auto"
    batch_invariant: bool = False
    speculative: SpeculativeConfig | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        self.speculative = SpeculativeConfig.of(self.speculative)
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
    num_draft_tokens: int = 0  # speculative decoding: drafts verified
    num_accepted_tokens: int = 0  # of which accepted
    num_verify_steps: int = 0  # request-steps that verified drafts
    propose_s: float = 0.0  # of step_s: drafting

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts over drafted ones, all requests (None before any draft)."""
        return spec_acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verification step gave a request on average, its own included (None
        before any)."""
        return spec_mean_accepted_length(self.num_accepted_tokens, self.num_verify_steps)

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
        # Constrained rows' bitmasks: filled once the model step is queued (the grammar work on
        # the host overlaps it), so they take a copy of their own.
        self._mask_staging = StagingBuffer(self.device)
        self._grammars: GrammarCompiler | None = None  # built for the first constrained request
        self.proposer = self._make_proposer(config.speculative)
        self._step_costs = (None if config.speculative is None
                            else StepCosts(config.speculative.num_speculative_tokens))
        self._failed: list[Request] = []  # the requests the current step failed

    def _make_proposer(self, config: SpeculativeConfig | None
                       ) -> NgramProposer | DraftModelProposer | None:
        if config is None:
            return None
        if config.method == "ngram":
            return NgramProposer(config)
        draft = load(config.model, config.draft_dtype or self.model.dtype, self.device)
        if draft.config.vocab_size != self.vocab_size:
            raise ValueError(f"speculative model {config.model} has a vocabulary of "
                             f"{draft.config.vocab_size} tokens, the model {self.vocab_size}: "
                             "a draft model must share the tokenizer")
        return DraftModelProposer(draft, self.device, self.kv_cache.num_blocks,
                                  self.kv_cache.spec.block_size, self.max_model_len)

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
        self._release_drafts(request)
        request.abort()

    def fail_request(self, request: Request, error: Exception) -> None:
        """Ends a request that cannot go on (finish_reason "error", ``error`` kept on it): its
        KV blocks are freed at once."""
        logger.warning("request %s failed: %s", request.request_id, error)
        self.scheduler.finish_request(request)
        self._release_drafts(request)
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
            # The sampler's inputs travel with the model's, in the step's one copy.
            parts = self._execute(batch, owners,
                                  self._sampling_inputs(_sampling_rows(owners, batch)))
            for part, part_owners, output in parts:
                scored += self.scheduler.update_from_output(part, part_owners, output)
                sampling += _sampling_rows(part_owners, part)
                if output.logits is not None:
                    logits.append(output.logits)
            sampled = None
            if sampling:
                # SamplingParams checked every value on the host.
                with ops.trusted_inputs():
                    sampling, sampled = self._sample(
                        logits[0] if len(logits) == 1 else torch.cat(logits), sampling,
                        parts[0][2].extra if parts[0][0] is batch else None)
        self.stats.steps += 1
        self.stats.scheduled_tokens += batch.num_tokens
        self.stats.peak_kv_usage = max(self.stats.peak_kv_usage, self.scheduler.usage)
        for request in scored:
            request.finish_prompt()
            self._finish(request)
        if sampled is not None:
            if self.proposer is not None:
                # The draft model reads a prompt when the target has read it, before the first
                # token: a one-time cost of the prompt (its TTFT), not of decoding.
                self._prepare_drafts([request for request, _ in sampling
                                      if not request.output_token_ids])
            self._append_tokens(sampling, sampled)
            if self.proposer is not None:
                if all(len(s.token_ids) == 1 + s.num_draft_tokens for s in batch.sequences):
                    self._step_costs.record_step(
                        max(s.num_draft_tokens for s in batch.sequences),
                        time.perf_counter() - started)
                self._propose([request for request, _ in sampling])
        counters = self.scheduler.prefix_cache_counters()
        self.stats.prefix_cache_hits = counters["hits"]
        self.stats.prefix_cache_queries = counters["queries"]
        self.stats.step_s += time.perf_counter() - started
        return list(dict.fromkeys(scored + [request for request, _ in sampling] + self._failed))

    def _execute(self, batch: ScheduledBatch, owners: list[Request],
                 sampling_inputs: dict[str, torch.Tensor]
                 ) -> list[tuple[ScheduledBatch, list[Request], StepLogits]]:
        """The model step, as (batch, owners, logits) parts: the whole batch (its logits'
        ``extra``: ``sampling_inputs`` on the device) or, when it raises, each request's share
        run alone (nothing was marked computed yet, so a share runs again as it was), the ones
        that raise again failed."""
        try:
            return [(batch, owners, self.runner.execute(batch, sampling_inputs))]
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
        self._release_drafts(request)

    def _release_drafts(self, request: Request) -> None:
        request.draft_token_ids = []
        if self.proposer is not None:
            self.proposer.release(request)

    @staticmethod
    def _speculates(request: Request) -> bool:
        """Whether a request may draft: running and unconstrained (a constrained request's
        verified rows would each need the grammar's state after the drafts before them)."""
        return not request.finished and request.seq_id is not None and request.grammar is None

    def _prepare_drafts(self, requests: list[Request]) -> None:
        """Has the proposer read the prompts of requests that will speculate, but where the
        step costs measured so far say no draft could pay for a proposer that reads every
        token (:meth:`DraftLength.gives_up_if_hopeless`): those requests never draft, and the
        draft model reads nothing of theirs."""
        going = [r for r in requests if self._speculates(r) and r.params.max_tokens > 1]
        if going and self.proposer.reads_every_token:
            step_s = self._step_costs.step_s()
            if step_s is not None:
                going = [r for r in going
                         if not self._draft_length(r).gives_up_if_hopeless(step_s)]
        if not going:
            return
        started = time.perf_counter()
        self._draft_or_drop(going, lambda: self.proposer.prepare(going))
        self.stats.propose_s += time.perf_counter() - started

    def _draft_length(self, request: Request) -> DraftLength:
        """The request's adaptive draft length, made at its first use."""
        if request.draft_length is None:
            config = self.config.speculative
            request.draft_length = DraftLength(config.num_speculative_tokens, config.adaptive,
                                               self.proposer.reads_every_token)
        return request.draft_length

    def _draft_or_drop(self, requests: list[Request], work: Callable[[], T]) -> T | None:
        """``work()`` (the proposer's, for ``requests``) under inference mode; when it raises,
        their draft state is dropped and None returned: drafts are an optimization, no request
        fails for one."""
        try:
            with torch.inference_mode():
                return work()
        except Exception as error:
            logger.warning("speculative drafting failed, this step goes without: %s", error)
            for request in requests:
                self.proposer.release(request)
            return None

    def _propose(self, requests: list[Request]) -> None:
        """Drafts the next tokens of the requests that just got tokens and go on, as many as
        each one's adaptive draft length allows and its limits leave room for."""
        started = time.perf_counter()
        step_s = self._step_costs.step_s()
        going, lengths, resuming = [], [], False
        for request in requests:
            if not self._speculates(request):
                continue
            # Room for the drafts and the verification step's own token.
            room = min(request.params.max_tokens - len(request.output_token_ids),
                       self.max_model_len - request.num_tokens) - 1
            k = min(self._draft_length(request).next_k(step_s), room)
            if request.draft_length.stopped:  # for good: its draft state can go now
                self.proposer.release(request)
            if k > 0:
                going.append(request)
                lengths.append(k)
                resuming |= request.draft_length.resuming
        if going:
            def draft() -> tuple[float, list[list[int]]]:
                self.proposer.prepare(going)  # a request readmitted after preemption
                return time.perf_counter(), self.proposer.propose(going, lengths)

            drafted = self._draft_or_drop(going, draft)
            if drafted is None:
                return
            drafting, drafts = drafted
            for request, tokens in zip(going, drafts):
                request.draft_token_ids = tokens
            if not resuming:  # a draft model resuming after a pause first reads what it missed
                self._step_costs.record_drafting(max(lengths), time.perf_counter() - drafting)
        self.stats.propose_s += time.perf_counter() - started

    def _sampling_inputs(self, sampling: list[tuple[Request, ScheduledSequence]]
                         ) -> dict[str, torch.Tensor]:
        """The host tensors that sampling ``sampling``'s rows reads: the rows' parameters
        (:meth:`SamplingTensors.host_columns`), "offsets" and, in a verification step,
        "draft_ids" (every sequence's drafts, in order)."""
        if not sampling:
            return {}
        counts = [1 + sequence.num_draft_tokens for _, sequence in sampling]
        rows = [request for (request, _), n in zip(sampling, counts) for _ in range(n)]
        inputs = SamplingTensors.host_columns([r.params for r in rows], self.vocab_size,
                                              seeds=[r.seed for r in rows])
        # Each request's random stream is keyed by (seed, its output position): the batch
        # around it, and whether the position is verified or decoded, never change its draws.
        inputs["offsets"] = torch.tensor(
            [len(request.output_token_ids) + j
             for (request, _), n in zip(sampling, counts) for j in range(n)], dtype=torch.int64)
        drafts = [t for _, sequence in sampling for t in sequence.draft_token_ids]
        if drafts:
            inputs["draft_ids"] = torch.tensor(drafts, dtype=torch.int64)
        return inputs

    def _sample(self, logits: torch.Tensor,
                sampling: list[tuple[Request, ScheduledSequence]],
                staged: dict[str, torch.Tensor] | None
                ) -> tuple[list[tuple[Request, ScheduledSequence]], SampleOutput | None]:
        """A token for each logits row (``1 + num_draft_tokens`` rows per request, the rows of
        a verification step sampled as the plain decode steps at those positions would);
        returns the requests that got theirs and their rows. When the batch cannot be sampled
        (the CPU sampler raises on a row whose logits hold NaN or +inf, e.g. after its
        penalties overflowed), each request's rows are sampled alone and the requests whose
        rows still fail fail alone. A row's draw never depends on the other rows, so the
        others get the tokens the batch would have given them. ``staged`` is
        :meth:`_sampling_inputs` on the device, None when the step ran in parts (then the rows'
        inputs take a copy of their own)."""
        if staged is None:
            staged = self.runner.staging.send(self._sampling_inputs(sampling))[0]
        counts = [1 + sequence.num_draft_tokens for _, sequence in sampling]
        rows = [request for (request, _), n in zip(sampling, counts) for _ in range(n)]
        tensors = SamplingTensors.from_columns(staged, [r.params for r in rows], self.vocab_size)
        offsets = staged["offsets"]
        prompt_mask = output_counts = None
        if tensors.needs_penalties:
            zeros_mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            prompt_mask = torch.stack([zeros_mask if r.prompt_mask is None else r.prompt_mask
                                       for r in rows])
            row_counts, start = [], 0
            for request, sequence in sampling:
                end = start + sequence.num_draft_tokens
                row_counts.append(self._output_counts(
                    request, staged["draft_ids"][start:end] if end > start else None))
                start = end
            output_counts = torch.cat(row_counts)
        constrained = [row for row, request in enumerate(rows) if request.grammar is not None]
        if constrained:  # before the penalties: a disallowed token stays -inf whatever they add
            masks = self._mask_staging.send({
                "rows": torch.tensor(constrained, dtype=torch.int64),
                "bitmask": grammar_bitmask([rows[row].grammar for row in constrained])})[0]
            mask_tokens(logits, masks["rows"], masks["bitmask"])
        penalized = not tensors.needs_penalties
        try:
            if not penalized:
                penalize(logits, tensors, prompt_mask, output_counts)
                penalized = True  # every row: the op raises before it writes, or not at all
            return sampling, draw(logits, tensors, offsets)
        except Exception:
            kept, parts, start = [], [], 0
            for (request, sequence), n in zip(sampling, counts):
                part, start = slice(start, start + n), start + n
                try:
                    if not penalized:
                        penalize(logits[part], tensors.rows(part), prompt_mask[part],
                                 output_counts[part])
                    parts.append(draw(logits[part], tensors.rows(part), offsets[part]))
                except Exception as error:
                    self.fail_request(request, _request_error(
                        "this request's logits (after its penalties and logit_bias) cannot be "
                        "sampled", error))
                    continue
                kept.append((request, sequence))
            return kept, SampleOutput.cat(parts) if parts else None

    def _output_counts(self, request: Request, drafts: torch.Tensor | None) -> torch.Tensor:
        """int32 ``[1 + len(drafts), vocab]``: the request's output counts at each row of its
        step, row j counting the first j ``drafts`` (int64, on the device) as generated."""
        n = 1 if drafts is None else 1 + drafts.shape[0]
        if request.output_counts is None:
            return torch.zeros(n, self.vocab_size, dtype=torch.int32, device=self.device)
        counts = request.output_counts.expand(n, -1)
        if n == 1:
            return counts
        drafted = torch.zeros(n, self.vocab_size, dtype=torch.int32, device=self.device)
        drafted[torch.arange(1, n, device=self.device), drafts] = 1
        return counts + drafted.cumsum(0, dtype=torch.int32)

    def _append_tokens(self, sampling: list[tuple[Request, ScheduledSequence]],
                       sampled: SampleOutput) -> None:
        """Gives each request its sampled token or, after a verification step, the drafts that
        match the samples at their rows and the sample that follows them."""
        on_device = sampled.tokens
        sampled = sampled.to_host()  # the step's one wait for the device
        tokens = sampled.tokens.tolist()
        started = time.perf_counter()  # after the sync: device time is not detokenization
        row = 0
        for request, sequence in sampling:
            first, row = row, row + 1 + sequence.num_draft_tokens
            drafts = sequence.draft_token_ids
            accepted = accepted_length(drafts, tokens[first:row])
            if drafts:
                self._count_drafts(request, len(drafts), accepted)
            appended = []
            for at in range(first, first + accepted + 1):
                if not self._append_token(request, sampled, at, tokens[at]):
                    break
                appended.append(tokens[at])
                if request.finished:
                    self._finish(request)
                    break
            if request.finished:
                continue
            if request.output_counts is not None:  # counted from the device's copy: no copy
                request.output_counts.index_put_(
                    (on_device[first:first + len(appended)],),
                    torch.ones(len(appended), dtype=torch.int32, device=self.device),
                    accumulate=True)
            if drafts:
                self.scheduler.settle_drafts(request, sequence, accepted)
        self.stats.detokenize_s += time.perf_counter() - started

    def _append_token(self, request: Request, sampled: SampleOutput, row: int,
                      token: int) -> bool:
        """Adds row ``row``'s token to the request; False when that failed the request."""
        if token < 0:  # how a GPU sampler under trusted_inputs marks a bad logits row
            self.fail_request(request, ValueError(
                "this request's logits (after its penalties and logit_bias) contain NaN or "
                "+inf, or no finite value"))
            return False
        try:
            logprobs = (self._logprob_entry(sampled, row, token, request.params.logprobs)
                        if request.params.logprobs is not None else None)
            request.append_token(token, logprobs)
        except Exception as error:  # e.g. its tokenizer cannot decode the token
            self.fail_request(request, _request_error(
                f"this request's token {token} cannot be added", error))
            return False
        return True

    def _count_drafts(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        for metrics in (request.metrics, self.stats):
            metrics.num_draft_tokens += num_drafted
            metrics.num_accepted_tokens += num_accepted
            metrics.num_verify_steps += 1
        request.draft_length.update(num_drafted, num_accepted)

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


def _sampling_rows(owners: list[Request], batch: ScheduledBatch
                   ) -> list[tuple[Request, ScheduledSequence]]:
    """The batch's sequences that sample, with their requests."""
    return [(owner, sequence) for owner, sequence in zip(owners, batch.sequences)
            if sequence.logit_token_ids == "all"]


def _request_error(what: str, error: Exception) -> Exception:
    """``error`` with what failed said first (a ValueError stays one), chained to it."""
    said = (ValueError if isinstance(error, ValueError) else RuntimeError)(f"{what}: {error}")
    said.__cause__ = error
    return said
