"""The scheduler: the one owner of KV state.

Each step it decides which requests run and which of their tokens, drives the block manager
(allocations, appends, forks, frees, preemption) and lays the step out as a
:class:`~fastllm.engine.scheduler_output.SchedulerOutput` (tokens, positions, block tables, slot
mapping, which rows give logits, what sampling needs). After an executor ran it,
:meth:`Scheduler.update_from_output` takes the step's
:class:`~fastllm.engine.scheduler_output.ModelRunnerOutput` once: the block manager marks what
was computed (only then may full blocks serve other sequences), each request gets its tokens
(accepted drafts kept, rejected ones dropped) and next drafts, finished requests leave, and
independent-chunk prompts move on. The scheduler is the one writer of every
:class:`~fastllm.engine.request.Request`.

Policy: first the running requests (one decode token each, or the next chunk of a prompt still
being prefilled), then waiting requests in arrival order while sequences, tokens and KV blocks
last. A prompt whose prefix is cached starts after it. When KV blocks run out, the newest running
request is preempted: its blocks are freed and it waits at the front of the queue to be
recomputed (its prompt and the tokens it had generated, often from the prefix cache).

A :class:`~fastllm.engine.chunked_prompt.ChunkedPrompt` request runs in three phases: its prefix
(ordinary prefill, through the prefix cache), then the chunks the
:class:`~fastllm.kv_cache.ChunkIndex` lacks, each encoded in a fork of the prefix (a short-lived
sequence of its own, batched like any other, whose last step saves its K/V in the store), then
every chunk's K/V loaded into the request's blocks and the rest (suffix, and output after a
preemption) prefilled over them.

The scheduler moves no KV tensor: it holds block ids and chunk entry ids, and each move (a
copy-on-write block copy, a chunk encoding saved, loaded or forgotten) travels with the step's
sequences for every worker to run on its own cache.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fastllm.engine.request import Request
from fastllm.engine.scheduler_output import (ModelRunnerOutput, SampledLogprobs,
                                             ScheduledSequence, SchedulerOutput, layout_batch,
                                             request_error)
from fastllm.engine.structured_output import GrammarMatcher, grammar_bitmask
from fastllm.kv_cache import ChunkIndex, KVCacheFullError, PagedKVCache, cache_slots

__all__ = ["Scheduler", "SchedulerConfig"]

logger = logging.getLogger("fastllm")


@dataclass
class SchedulerConfig:
    """Scheduling limits (see :class:`fastllm.engine.EngineConfig`)."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int | None = None
    max_loras: int | None = None  # LoRA adapters in a step at most; None: no LoRA


@dataclass
class _ChunkJob:
    """Where a chunked-prompt request stands. ``encoders``: chunk -> the sequence encoding it;
    ``saving``: chunk -> the index entry its encoder's last step saves into; ``found``: chunk
    -> its stored entry (pinned until the request leaves); ``placed``: the chunks' K/V sit in
    the request's blocks."""

    encoders: dict[tuple[int, ...], int] = field(default_factory=dict)
    saving: dict[tuple[int, ...], int] = field(default_factory=dict)
    found: dict[tuple[int, ...], int] = field(default_factory=dict)
    started: bool = False  # encoders were set up (or every chunk was found) since admission
    placed: bool = False


class Scheduler:
    """Owns the waiting and running requests, the paged KV cache's block manager and the chunk
    index; not thread-safe (the engine's caller holds a lock)."""

    def __init__(self, kv_cache: PagedKVCache, config: SchedulerConfig, max_model_len: int,
                 chunk_index: ChunkIndex | None = None) -> None:
        self.kv_cache = kv_cache
        self.block_manager = kv_cache.block_manager
        self.config = config
        self.max_model_len = max_model_len
        self.chunk_index = chunk_index
        # Moves for the workers' next step: copy-on-write copies (seq id, src, dst), and chunk
        # encodings each sequence loads before it runs.
        self._block_copies: list[tuple[int, int, int]] = []
        self._chunk_loads: dict[int, list[tuple[int, Tensor]]] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._seq_ids = itertools.count()
        self._encoder_ids = itertools.count(-1, -1)  # never meet a request's (>= 0) ids
        self._chunk_jobs: dict[Request, _ChunkJob] = {}
        self._requests: dict[str, Request] = {}  # every request in, by id
        self._shown: set[str] = set()  # requests a step has shown the workers
        self._finished_ids: list[str] = []  # shown requests that left since the last step
        self._removed_lora_ids: list[int] = []  # adapters unloaded since the last step
        # Speculative decoding: drafts verified, of which accepted, and request-steps verifying.
        self.num_draft_tokens = self.num_accepted_tokens = self.num_verify_steps = 0

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, request: Request, grammar: GrammarMatcher | None = None) -> None:
        """Queues a request (constrained by ``grammar`` when given); a prompt that cannot fit
        the context or the KV pool, or an id already in, is a ValueError for this request
        alone."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        length = len(request.prompt_token_ids)
        room = 0 if request.score_token_ids is not None else 1  # tokens left to generate
        if length + room > self.max_model_len:
            raise ValueError(f"request {request.request_id}: the prompt has {length} tokens, "
                             f"which leaves no room to generate under max_model_len="
                             f"{self.max_model_len}")
        block_size = self.kv_cache.spec.block_size
        blocks = math.ceil((length + room) / block_size)
        chunked = request.chunked_prompt
        if request.lora_request is not None:
            if self.config.max_loras is None:
                raise ValueError(f"request {request.request_id}: LoRA adapter "
                                 f"{request.lora_request.lora_name!r} asked of an engine "
                                 "without LoRA (LLM(..., enable_lora=True))")
            if chunked is not None:
                raise ValueError(f"request {request.request_id}: independent chunks are "
                                 "stored for the base model; a LoRA adapter's prompt is a plain "
                                 "one")
        if chunked is not None:
            if request.prompt_logprobs is not None:
                raise ValueError(f"request {request.request_id}: prompt_logprobs need a plain "
                                 "prompt, not independent chunks")
            if not self.kv_cache.pre_rope or self.chunk_index is None:
                raise ValueError(f"request {request.request_id}: independent chunks need a "
                                 "position-independent KV cache and a chunk store (LLM(..., "
                                 "chunk_store_memory=...))")
            # Each chunk may be encoded in a fork of the prefix while the request holds it.
            blocks += sum(math.ceil((len(chunked.prefix) + len(chunk)) / block_size)
                          for chunk in set(chunked.chunks))
        if blocks > self.kv_cache.num_blocks:
            raise ValueError(f"request {request.request_id}: the prompt needs {blocks} KV "
                             f"blocks but the pool has {self.kv_cache.num_blocks}")
        if chunked is not None:
            self._chunk_jobs[request] = _ChunkJob()
        request.grammar = grammar
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request: Request) -> None:
        """Ends a request now ("abort"): its KV blocks are freed at once."""
        self._remove(request)
        request.abort()

    def fail_request(self, request: Request, error: Exception) -> None:
        """Ends a request that cannot go on (finish_reason "error", ``error`` kept on it): its
        KV blocks are freed at once."""
        logger.warning("request %s failed: %s", request.request_id, error)
        self._remove(request)
        request.fail(error)

    def idle_step(self) -> SchedulerOutput | None:
        """With nothing to run: the step that tells the workers which requests left, which
        chunk encodings and which LoRA adapters to forget, if any."""
        finished = self.take_finished_ids()
        drops = self.chunk_index.take_drops() if self.chunk_index is not None else []
        removed, self._removed_lora_ids = self._removed_lora_ids, []
        if not (finished or drops or removed):
            return None
        return SchedulerOutput.empty(finished, drops, removed)

    def reset_prefix_cache(self) -> int:
        """Drops every cached block no request holds (the block manager forgets their KV);
        returns how many."""
        return self.block_manager.reset_prefix_cache()

    def record_cache_events(self) -> None:
        """Has the block manager record the prefix cache's changes for
        :meth:`take_cache_events` (a ValueError without a prefix cache)."""
        if not self.block_manager.enable_prefix_caching:
            raise ValueError("kv_events_config: KV-cache events report the prefix cache, which "
                             "enable_prefix_caching=False turns off")
        self.block_manager.record_cache_events(True)

    def take_cache_events(self) -> list[tuple[bool, int, int, list[int]]]:
        """The prefix cache's changes since the last call (``BlockManager.take_cache_events``),
        once :meth:`record_cache_events` asked for them."""
        return self.block_manager.take_cache_events()

    def remove_lora(self, lora_int_id: int) -> None:
        """Tells the workers, with the next step, to forget an unloaded adapter (requests
        still running with it load it again from its files)."""
        self._removed_lora_ids.append(lora_int_id)

    def take_finished_ids(self) -> list[str]:
        """The ids of requests that left since the last step and that a step showed the
        workers (what they keep of them can go)."""
        ids, self._finished_ids = self._finished_ids, []
        return ids

    def _finish(self, request: Request) -> None:
        """Takes out a request that finished in a step."""
        request.metrics.kv_usage = self.usage
        self._remove(request)

    def _remove(self, request: Request) -> None:
        """Takes a request out of the queues and frees its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        job = self._chunk_jobs.pop(request, None)
        if job is not None:
            for entry_id in job.found.values():
                self.chunk_index.release(entry_id)
        request.draft_token_ids = []
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]
        if request.request_id in self._shown:
            self._shown.discard(request.request_id)
            self._finished_ids.append(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def usage(self) -> float:
        """The fraction of KV blocks held by requests."""
        return self.block_manager.usage

    def prefix_cache_counters(self) -> dict[str, int]:
        """The block manager's prefix-cache counters ("hits", "queries", ...)."""
        return self.block_manager.stats()

    def _release(self, request: Request) -> None:
        job = self._chunk_jobs.get(request)
        if job is not None:
            for encoder in job.encoders.values():
                self._free(encoder)
            for entry_id in job.saving.values():  # never saved: abandoned
                self.chunk_index.release(entry_id)
            job.encoders.clear()
            job.saving.clear()
            job.started = job.placed = False
        if request.seq_id is not None:
            self._free(request.seq_id)
            request.seq_id = None

    def _free(self, seq_id: int) -> None:
        self.block_manager.free(seq_id)
        self._block_copies = [c for c in self._block_copies if c[0] != seq_id]
        self._chunk_loads.pop(seq_id, None)

    def _preempt(self, request: Request) -> None:
        """Frees the request's blocks and queues it first, to be recomputed."""
        self.running.remove(request)
        self._release(request)
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _with_blocks(self, request: Request, action: Callable[[], None]) -> bool:
        """Runs a block-manager action for ``request``, preempting the newest running requests
        while blocks lack; False when the request itself had to go."""
        while True:
            try:
                action()
                return True
            except KVCacheFullError:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    return False

    def _append(self, seq_id: int, tokens: Sequence[int], cacheable: bool = True) -> None:
        copies = self.block_manager.append_tokens(seq_id, list(tokens), cacheable=cacheable)
        self._block_copies += [(seq_id, src, dst) for src, dst in copies]

    # ---- scheduling --------------------------------------------------------------------------

    def _chunk(self, remaining: int, budget: int) -> int:
        limit = self.config.max_prefill_chunk or remaining
        return min(remaining, budget, limit)

    def _held_tokens(self, request: Request) -> list[int]:
        """The tokens the request's sequence holds in the block manager once it is admitted."""
        if request.chunked_prompt is not None:
            return list(request.chunked_prompt.prefix)
        return request.all_token_ids  # a preempted request recomputes its output too

    def _logit_ids(self, request: Request) -> None | str | tuple[int, ...]:
        if request.score_token_ids is None:
            return "all"
        return request.score_token_ids or None

    def _schedule_request(self, request: Request, budget: int) -> list[ScheduledSequence]:
        """The request's sequences this step (its own, or its chunk encoders)."""
        manager = self.block_manager
        job = self._chunk_jobs.get(request)
        if job is not None and not job.placed:
            if manager.num_computed_tokens(request.seq_id) < len(request.chunked_prompt.prefix):
                return [self._prefill(request.seq_id, request.chunked_prompt.prefix, budget,
                                      None)]
            if not job.started and not self._start_chunks(request, job):
                return []
            if not job.encoders:
                if not self._place_chunks(request, job):
                    return []
            else:
                scheduled = []
                for chunk, encoder in job.encoders.items():
                    if budget <= 0:
                        break
                    tokens = [*request.chunked_prompt.prefix, *chunk]
                    if manager.num_computed_tokens(encoder) < len(tokens):
                        scheduled.append(self._prefill(encoder, tokens, budget, None))
                        budget -= len(scheduled[-1].token_ids)
                        self._save_when_done(request, job, chunk, scheduled[-1], len(tokens))
                return scheduled
        sequence = self._prefill(request.seq_id, request.all_token_ids, budget,
                                 self._logit_ids(request))
        sequence.num_output_tokens = len(request.output_token_ids)
        wanted = request.next_prompt_logprob
        if wanted is not None:
            # Row p gives the logprob of token p + 1: the rows of this chunk from wanted - 1 on.
            end = min(sequence.start + len(sequence.token_ids), len(request.prompt_token_ids) - 1)
            first = max(sequence.start, wanted - 1)
            if end > first:
                sequence.prompt_logprob_row = first - sequence.start
                sequence.prompt_logprob_ids = request.prompt_token_ids[first + 1:end + 1]
                sequence.num_prompt_logprobs = request.params.prompt_logprobs
        if request.pooling is not None:
            end = sequence.start + len(sequence.token_ids)
            first = (max(sequence.start, request.num_pooled) if request.pooling == "mean"
                     else len(request.prompt_token_ids) - 1)
            if end > first >= sequence.start:
                sequence.pool_row, sequence.num_pool_rows = first - sequence.start, end - first
        drafts, request.draft_token_ids = request.draft_token_ids, []
        if drafts and len(sequence.token_ids) == 1 and sequence.samples:
            self._add_drafts(sequence, drafts[:budget - 1])
        return [sequence]

    def _add_drafts(self, sequence: ScheduledSequence, drafts: list[int]) -> None:
        """Makes a decode step a verification step: the drafts join the sequence (placed in
        the block manager, not yet computed) when there are blocks for them; they never
        preempt anyone."""
        if not drafts:
            return
        try:
            self._append(sequence.seq_id, drafts)
        except KVCacheFullError:
            return
        sequence.token_ids += drafts
        sequence.num_draft_tokens = len(drafts)

    def _save_when_done(self, request: Request, job: _ChunkJob, chunk: tuple[int, ...],
                        sequence: ScheduledSequence, end: int) -> None:
        """Has the workers save the chunk's encoding when ``sequence`` (its encoder's share of
        this step) completes it."""
        if sequence.start + len(sequence.token_ids) < end:
            return
        prefix = request.chunked_prompt.prefix
        entry_id = job.saving.get(chunk)
        if entry_id is None:
            entry_id = job.saving[chunk] = self.chunk_index.reserve(prefix, chunk)
        slots = cache_slots(self.block_manager.block_table(sequence.seq_id),
                            self.block_manager.block_size, len(prefix), end)
        sequence.chunk_save = (entry_id, torch.tensor(slots, dtype=torch.int64))

    def _prefill(self, seq_id: int, tokens: Sequence[int], budget: int,
                 logit_ids: None | str | tuple[int, ...]) -> ScheduledSequence:
        """The next tokens of ``seq_id`` not computed yet, within the budget; they give
        ``logit_ids`` when they reach the end of ``tokens``."""
        start = self.block_manager.num_computed_tokens(seq_id)
        n = self._chunk(len(tokens) - start, budget)
        return ScheduledSequence(seq_id, start, list(tokens[start:start + n]),
                                 logit_ids if start + n == len(tokens) else None)

    def _start_chunks(self, request: Request, job: _ChunkJob) -> bool:
        """Looks the chunks up in the store and forks an encoder of the prefix for each one
        missing; False when the request was preempted for blocks."""
        prompt = request.chunked_prompt
        for chunk in dict.fromkeys(prompt.chunks):
            if chunk in job.found:
                continue
            entry_id = self.chunk_index.find(prompt.prefix, chunk)
            if entry_id is not None:
                job.found[chunk] = entry_id
                continue
            encoder = next(self._encoder_ids)

            def fork_and_append(encoder: int = encoder, chunk: tuple[int, ...] = chunk) -> None:
                self.block_manager.fork(request.seq_id, encoder)
                try:
                    self._append(encoder, chunk, cacheable=False)
                except BaseException:
                    self._free(encoder)
                    raise

            if not self._with_blocks(request, fork_and_append):
                return False
            job.encoders[chunk] = encoder
        job.started = True
        return True

    def _place_chunks(self, request: Request, job: _ChunkJob) -> bool:
        """Has the workers load every chunk's K/V at the positions it occupies, then appends
        the rest of the request's tokens; False when the request was preempted for blocks."""
        prompt = request.chunked_prompt
        seq_id = request.seq_id
        all_chunks = list(itertools.chain.from_iterable(prompt.chunks))
        start = len(prompt.prefix)
        if all_chunks:
            if not self._with_blocks(request, lambda: self._append(seq_id, all_chunks,
                                                                  cacheable=False)):
                return False
            table = self.block_manager.block_table(seq_id)
            loads = self._chunk_loads.setdefault(seq_id, [])
            at = start
            for chunk in prompt.chunks:
                slots = cache_slots(table, self.block_manager.block_size, at, at + len(chunk))
                loads.append((job.found[chunk], torch.tensor(slots, dtype=torch.int64)))
                at += len(chunk)
            # Computed once loaded: the loads come before the model in the request's next step.
            self.block_manager.mark_computed(seq_id, start + len(all_chunks))
        rest = request.all_token_ids[start + len(all_chunks):]  # the suffix, then any output
        if not self._with_blocks(request, lambda: self._append(seq_id, rest, cacheable=False)):
            return False
        job.placed = True
        return True

    def _hold_new_tokens(self, request: Request) -> bool:
        """Gives the block manager the tokens the request sampled since its last step; False
        when the request had to go for blocks."""
        job = self._chunk_jobs.get(request)
        if job is not None and not job.placed:
            return True  # its sequence holds the prefix only, so far
        new = request.all_token_ids[self.block_manager.num_tokens(request.seq_id):]
        return not new or self._with_blocks(request, lambda: self._append(request.seq_id, new))

    def schedule(self) -> SchedulerOutput | None:
        """The next step; None when there is nothing to run."""
        manager = self.block_manager
        budget = self.config.max_num_batched_tokens
        sequences: list[ScheduledSequence] = []
        owners: list[Request] = []
        preempted = self.num_preemptions
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            scheduled = self._schedule_request(request, budget)
            if request not in self.running:
                continue  # preempted while setting up its chunks
            scheduled = [s for s in scheduled if s.token_ids]
            sequences += scheduled
            owners += [request] * len(scheduled)
            budget -= sum(len(s.token_ids) for s in scheduled)
            i += 1
        # New requests only when nothing was preempted this step (they would take the blocks).
        # A request whose LoRA adapter would be one too many in the step waits, and so does
        # every later one with an adapter: none keeps an adapter busy ahead of it.
        adapters = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        adapter_waits = False
        index = 0
        while (index < len(self.waiting) and budget > 0
               and len(self.running) < self.config.max_num_seqs
               and self.num_preemptions == preempted):
            request = self.waiting[index]
            lora = request.lora_request
            if lora is not None and (adapter_waits or (
                    lora.lora_int_id not in adapters and len(adapters) >= self.config.max_loras)):
                adapter_waits = True
                index += 1
                continue
            seq_id = next(self._seq_ids)
            try:
                # Prompt logprobs come from the prompt's own rows: none may come from the cache.
                # KV computed under an adapter serves only that adapter's prompts.
                cached = manager.allocate(seq_id, self._held_tokens(request),
                                          reuse_cached=not request.needs_every_prompt_row,
                                          cache_salt=0 if lora is None else lora.lora_int_id)
            except KVCacheFullError:
                break
            del self.waiting[index]
            if lora is not None:
                adapters.add(lora.lora_int_id)
            self.running.append(request)
            request.seq_id = seq_id
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.perf_counter()
                request.metrics.num_cached_tokens = cached
            scheduled = self._schedule_request(request, budget)
            if request not in self.running:
                break
            scheduled = [s for s in scheduled if s.token_ids]
            sequences += scheduled
            owners += [request] * len(scheduled)
            budget -= sum(len(s.token_ids) for s in scheduled)
        if not sequences:
            return None
        for sequence, request in zip(sequences, owners):
            sequence.request_id = request.request_id
            sequence.lora_request = request.lora_request
            sequence.chunk_loads = self._chunk_loads.pop(sequence.seq_id, [])
        return self._layout(sequences, self.take_finished_ids())

    def _layout(self, sequences: list[ScheduledSequence],
                finished_ids: list[str]) -> SchedulerOutput:
        """The step of ``sequences``, with what the workers need to sample them: the requests
        they see for the first time and the grammar masks of constrained ones."""
        step = layout_batch(self.block_manager, sequences)
        step.finished_request_ids = finished_ids
        # Every pending copy, scheduled sequence or not: a copy's source is read before any
        # later step can write it.
        step.block_copies = [(src, dst) for _, src, dst in self._block_copies]
        self._block_copies = []
        step.removed_lora_ids, self._removed_lora_ids = self._removed_lora_ids, []
        if self.chunk_index is not None:
            step.chunk_drops = self.chunk_index.take_drops()
        sampling = [self._requests[s.request_id] for s in sequences if s.samples]
        for request in sampling:
            if request.request_id not in self._shown:
                self._shown.add(request.request_id)
                step.new_requests.append(request.runner_record())
        constrained = [request for request in sampling if request.grammar is not None]
        if constrained:
            step.grammar_bitmask = grammar_bitmask([r.grammar for r in constrained])
            step.constrained_request_ids = [r.request_id for r in constrained]
        return step

    def split(self, step: SchedulerOutput) -> list[tuple[Request, SchedulerOutput]]:
        """The step's sequences grouped by request, each group laid out as a step of its own:
        a step that failed is run again request by request, so that only the culprit fails."""
        groups: dict[str, list[ScheduledSequence]] = {}
        for sequence in step.sequences:
            groups.setdefault(sequence.request_id, []).append(sequence)
        parts = []
        for request_id, sequences in groups.items():
            part = layout_batch(self.block_manager, sequences)
            part.finished_request_ids = step.finished_request_ids
            part.removed_lora_ids = step.removed_lora_ids
            # The first part copies again (the failed step copied before its model raised, and
            # nothing ran since); a later one must not, over what the parts before it wrote.
            if not parts:
                part.block_copies, part.chunk_drops = step.block_copies, step.chunk_drops
            part.new_requests = [r for r in step.new_requests if r.request_id == request_id]
            if request_id in step.constrained_request_ids:
                row = step.constrained_request_ids.index(request_id)
                part.grammar_bitmask = step.grammar_bitmask[row:row + 1]
                part.constrained_request_ids = [request_id]
            parts.append((self._requests[request_id], part))
        return parts

    # ---- after the step ----------------------------------------------------------------------

    def update_from_output(self, step: SchedulerOutput,
                           output: ModelRunnerOutput) -> list[Request]:
        """Takes what an executor made of ``step``: marks what was computed in the block
        manager, gives each sampling request its tokens (the accepted drafts kept, the rest
        dropped with their KV) and next drafts, ends prompt-only requests whose prompt is
        computed, stores finished chunk encodings (then frees their encoders), and has the
        block manager hold the new tokens. Returns the requests that got a token or ended."""
        manager = self.block_manager
        updated: list[Request] = []
        owners = [self._requests.get(s.request_id) for s in step.sequences]
        for index, (sequence, request) in enumerate(zip(step.sequences, owners)):
            if request is None or request.seq_id is None:
                continue  # it left the engine, or was preempted, while the step ran
            # Drafts' KV counts once they are accepted (_settle_drafts).
            end = sequence.start + len(sequence.token_ids) - sequence.num_draft_tokens
            manager.mark_computed(sequence.seq_id, end)
            if sequence.prompt_logprob_ids:
                request.add_prompt_logprobs(output.prompt_logprobs[index])
            if sequence.num_pool_rows:
                request.add_pooled(output.pooled[index], sequence.num_pool_rows)
            if (request.score_token_ids is not None and sequence.seq_id == request.seq_id
                    and end == request.num_tokens):
                request.scores = output.scores.get(index)
                request.finish_prompt()
                self._finish(request)
                updated.append(request)
        for request in dict.fromkeys(r for r in owners if r is not None):
            self._store_chunks(request)
        sampled = {}
        for sequence, request in zip(step.sequences, owners):
            if request is not None and sequence.samples and not request.finished:
                self._take_tokens(request, sequence, output)
                sampled[request] = None
        # Once every request took its tokens: holding them may preempt a request of this step.
        for request in list(self.running):
            if request in sampled and request in self.running:
                self._hold_new_tokens(request)
        return updated + list(sampled)

    def _take_tokens(self, request: Request, sequence: ScheduledSequence,
                     output: ModelRunnerOutput) -> None:
        """Gives a request the tokens its rows gave (failing it on its error) and the drafts
        for its next step; a verification step's rejected drafts leave the block manager."""
        error = output.errors.get(request.request_id)
        if error is not None:
            self.fail_request(request, error)
            return
        tokens = output.sampled_token_ids[request.request_id]
        logprobs = output.logprobs.get(request.request_id)
        accepted = len(tokens) - 1
        if sequence.num_draft_tokens:
            self.num_draft_tokens += sequence.num_draft_tokens
            self.num_accepted_tokens += accepted
            self.num_verify_steps += 1
            request.metrics.num_draft_tokens += sequence.num_draft_tokens
            request.metrics.num_accepted_tokens += accepted
            request.metrics.num_verify_steps += 1
        for j, token in enumerate(tokens):
            if not self._append_token(request, token, None if logprobs is None else logprobs[j]):
                return
            if request.finished:
                self._finish(request)
                return
        if sequence.num_draft_tokens:
            self._settle_drafts(request, sequence, accepted)
        request.draft_token_ids = output.draft_token_ids.get(request.request_id, [])

    def _append_token(self, request: Request, token: int,
                      logprobs: SampledLogprobs | None) -> bool:
        """Adds a token to the request; False when that failed the request."""
        if token < 0:  # how a GPU sampler under trusted_inputs marks a bad logits row
            self.fail_request(request, ValueError(
                "this request's logits (after its penalties and logit_bias) contain NaN or "
                "+inf, or no finite value"))
            return False
        try:
            request.append_token(token, logprobs)
        except Exception as error:  # e.g. its grammar refuses the token
            self.fail_request(request, request_error(
                f"this request's token {token} cannot be added", error))
            return False
        return True

    def _store_chunks(self, request: Request) -> None:
        """Commits the chunk encodings the workers saved in the step (the request's encoders
        that are now computed), then frees their encoders."""
        job = self._chunk_jobs.get(request)
        if job is None or not job.encoders:
            return
        prefix = request.chunked_prompt.prefix
        for chunk, encoder in list(job.encoders.items()):
            if self.block_manager.num_computed_tokens(encoder) < len(prefix) + len(chunk):
                continue
            entry_id = job.found[chunk] = job.saving.pop(chunk)
            self.chunk_index.commit(entry_id)
            self._free(encoder)
            del job.encoders[chunk]

    def _settle_drafts(self, request: Request, sequence: ScheduledSequence,
                       num_accepted: int) -> None:
        """After a verification step of a request still running: its first ``num_accepted``
        drafts are kept (their KV computed), the rest dropped from the block manager with any
        block that held only them. Rejected drafts were never marked computed, so no block
        holding their KV entered the prefix cache."""
        if request.seq_id != sequence.seq_id:
            return  # preempted and readmitted
        kept = sequence.start + len(sequence.token_ids) - sequence.num_draft_tokens + num_accepted
        self.block_manager.truncate(sequence.seq_id, kept)
        self.block_manager.mark_computed(sequence.seq_id, kept)

