"""The scheduler: the one owner of KV state.

Each step it decides which requests run and which of their tokens, drives the block manager
(allocations, appends, forks, frees, preemption) and lays the step out as a
:class:`~fastllm.engine.model_runner.ScheduledBatch` (tokens, positions, block tables, slot
mapping, which rows give logits). After the model ran, :meth:`Scheduler.update_from_output`
learns what was computed: the block manager marks it (only then may full blocks serve other
sequences), and independent-chunk prompts move on.

Policy: first the running requests (one decode token each, or the next chunk of a prompt still
being prefilled), then waiting requests in arrival order while sequences, tokens and KV blocks
last. A prompt whose prefix is cached starts after it. When KV blocks run out, the newest running
request is preempted: its blocks are freed and it waits at the front of the queue to be
recomputed (its prompt and the tokens it had generated, often from the prefix cache).

A :class:`~fastllm.engine.chunked_prompt.ChunkedPrompt` request runs in three phases: its prefix
(ordinary prefill, through the prefix cache), then the chunks the
:class:`~fastllm.kv_cache.ChunkKVStore` lacks, each encoded in a fork of the prefix (a short-lived
sequence of its own, batched like any other), then every chunk's K/V copied into the request's
blocks and the rest (suffix, and output after a preemption) prefilled over them.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fastllm.engine.decode_graphs import DecodeGraphs
from fastllm.engine.model_runner import ModelRunner, ScheduledBatch, ScheduledSequence, StepLogits
from fastllm.engine.request import Request
from fastllm.kv_cache import BlockManager, ChunkKVStore, KVCacheFullError, PagedKVCache
from fastllm.models import DecoderLM

__all__ = ["Scheduler", "SchedulerConfig", "batch_of_sequences", "layout_batch", "run_step"]


@dataclass
class SchedulerConfig:
    """Scheduling limits (see :class:`fastllm.engine.EngineConfig`)."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int | None = None


@dataclass
class _ChunkJob:
    """Where a chunked-prompt request stands. ``encoders``: chunk -> the sequence encoding it;
    ``found``: chunk -> its (K, V); ``placed``: the chunks' K/V sit in the request's blocks."""

    encoders: dict[tuple[int, ...], int] = field(default_factory=dict)
    found: dict[tuple[int, ...], tuple[Tensor, Tensor]] = field(default_factory=dict)
    started: bool = False  # encoders were set up (or every chunk was found) since admission
    placed: bool = False


class Scheduler:
    """Owns the waiting and running requests, the paged KV cache's block manager and the chunk
    store; not thread-safe (the engine's caller holds a lock)."""

    def __init__(self, kv_cache: PagedKVCache, config: SchedulerConfig, max_model_len: int,
                 chunk_store: ChunkKVStore | None = None) -> None:
        self.kv_cache = kv_cache
        self.block_manager = kv_cache.block_manager
        self.config = config
        self.max_model_len = max_model_len
        self.chunk_store = chunk_store
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._seq_ids = itertools.count()
        self._encoder_ids = itertools.count(-1, -1)  # never meet a request's (>= 0) ids
        self._chunk_jobs: dict[Request, _ChunkJob] = {}

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues a request; a prompt that cannot fit the context or the KV pool is a
        ValueError for this request alone."""
        length = len(request.prompt_token_ids)
        room = 0 if request.score_token_ids is not None else 1  # tokens left to generate
        if length + room > self.max_model_len:
            raise ValueError(f"request {request.request_id}: the prompt has {length} tokens, "
                             f"which leaves no room to generate under max_model_len="
                             f"{self.max_model_len}")
        block_size = self.kv_cache.spec.block_size
        blocks = math.ceil((length + room) / block_size)
        chunked = request.chunked_prompt
        if chunked is not None:
            if not self.kv_cache.pre_rope or self.chunk_store is None:
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
        self.waiting.append(request)

    def finish_request(self, request: Request) -> None:
        """Takes a request out (finished, or aborted by its caller); frees its blocks at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        self._chunk_jobs.pop(request, None)

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
                self.block_manager.free(encoder)
            job.encoders.clear()
            job.started = job.placed = False
        if request.seq_id is not None:
            self.block_manager.free(request.seq_id)
            request.seq_id = None

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
        self.kv_cache.copy_blocks(self.block_manager.append_tokens(seq_id, list(tokens),
                                                                   cacheable=cacheable))

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
                return scheduled
        sequence = self._prefill(request.seq_id, request.all_token_ids, budget,
                                 self._logit_ids(request))
        drafts, request.draft_token_ids = request.draft_token_ids, []
        if drafts and len(sequence.token_ids) == 1 and sequence.logit_token_ids == "all":
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
            kv = self.chunk_store.get(prompt.prefix, chunk)
            if kv is not None:
                job.found[chunk] = kv
                continue
            encoder = next(self._encoder_ids)

            def fork_and_append(encoder: int = encoder, chunk: tuple[int, ...] = chunk) -> None:
                self.block_manager.fork(request.seq_id, encoder)
                try:
                    self._append(encoder, chunk, cacheable=False)
                except BaseException:
                    self.block_manager.free(encoder)
                    raise

            if not self._with_blocks(request, fork_and_append):
                return False
            job.encoders[chunk] = encoder
        job.started = True
        return True

    def _place_chunks(self, request: Request, job: _ChunkJob) -> bool:
        """Copies every chunk's K/V to the positions it occupies, then appends the rest of the
        request's tokens; False when the request was preempted for blocks."""
        prompt = request.chunked_prompt
        seq_id = request.seq_id
        all_chunks = list(itertools.chain.from_iterable(prompt.chunks))
        start = len(prompt.prefix)
        if all_chunks:
            if not self._with_blocks(request, lambda: self._append(seq_id, all_chunks,
                                                                  cacheable=False)):
                return False
            slots = self.kv_cache.slots(seq_id, start, start + len(all_chunks))
            k = torch.cat([job.found[chunk][0] for chunk in prompt.chunks], dim=1)
            v = torch.cat([job.found[chunk][1] for chunk in prompt.chunks], dim=1)
            self.kv_cache.write_rows(slots, k, v)
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

    def schedule(self) -> tuple[ScheduledBatch, list[Request]] | None:
        """The next step's batch and the request owning each of its sequences; None when there
        is nothing to run."""
        manager = self.block_manager
        budget = self.config.max_num_batched_tokens
        sequences: list[ScheduledSequence] = []
        owners: list[Request] = []
        preempted = self.num_preemptions
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if not self._hold_new_tokens(request):
                continue  # it left the running list
            scheduled = self._schedule_request(request, budget)
            if request not in self.running:
                continue  # preempted while setting up its chunks
            scheduled = [s for s in scheduled if s.token_ids]
            sequences += scheduled
            owners += [request] * len(scheduled)
            budget -= sum(len(s.token_ids) for s in scheduled)
            i += 1
        # New requests only when nothing was preempted this step (they would take the blocks).
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and self.num_preemptions == preempted):
            request = self.waiting[0]
            seq_id = next(self._seq_ids)
            try:
                cached = manager.allocate(seq_id, self._held_tokens(request))
            except KVCacheFullError:
                break
            self.waiting.popleft()
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
        return layout_batch(self.block_manager, sequences), owners

    def split_batch(self, batch: ScheduledBatch, owners: list[Request]
                    ) -> list[tuple[ScheduledBatch, list[Request]]]:
        """The batch's sequences grouped by request, each group laid out as a batch of its own:
        a step that failed is run again request by request, so that only the culprit fails."""
        groups: dict[Request, list[ScheduledSequence]] = {}
        for sequence, request in zip(batch.sequences, owners):
            groups.setdefault(request, []).append(sequence)
        return [(layout_batch(self.block_manager, sequences), [request] * len(sequences))
                for request, sequences in groups.items()]

    # ---- after the step ----------------------------------------------------------------------

    def update_from_output(self, batch: ScheduledBatch, owners: list[Request],
                           output: StepLogits) -> list[Request]:
        """Learns what the step computed: marks it in the block manager, stores finished chunk
        encodings (then frees their encoders) and records prompt-only requests' scores.
        Returns the prompt-only requests whose prompt is now computed (they are done)."""
        manager = self.block_manager
        done = []
        for index, (sequence, request) in enumerate(zip(batch.sequences, owners)):
            # Drafts' KV counts once they are accepted (settle_drafts).
            end = sequence.start + len(sequence.token_ids) - sequence.num_draft_tokens
            manager.mark_computed(sequence.seq_id, end)
            if (request.score_token_ids is not None and sequence.seq_id == request.seq_id
                    and end == request.num_tokens):
                request.scores = output.scores.get(index)
                done.append(request)
        for request in dict.fromkeys(owners):
            job = self._chunk_jobs.get(request)
            if job is None or not job.encoders:
                continue
            prefix = request.chunked_prompt.prefix
            for chunk, encoder in list(job.encoders.items()):
                end = len(prefix) + len(chunk)
                if manager.num_computed_tokens(encoder) < end:
                    continue
                k, v = self.kv_cache.read_rows(self.kv_cache.slots(encoder, len(prefix), end))
                job.found[chunk] = (k, v)
                self.chunk_store.put(prefix, chunk, k, v)
                manager.free(encoder)
                del job.encoders[chunk]
        return done

    def settle_drafts(self, request: Request, sequence: ScheduledSequence,
                      num_accepted: int) -> None:
        """After a verification step of a request still running: its first ``num_accepted``
        drafts are kept (their KV computed), the rest dropped from the block manager with any
        block that held only them. Rejected drafts were never marked computed, so no block
        holding their KV entered the prefix cache."""
        if request.seq_id != sequence.seq_id:
            return  # it left the engine, or was preempted and readmitted
        kept = sequence.start + len(sequence.token_ids) - sequence.num_draft_tokens + num_accepted
        self.block_manager.truncate(sequence.seq_id, kept)
        self.block_manager.mark_computed(sequence.seq_id, kept)


def layout_batch(block_manager: BlockManager,
                 sequences: list[ScheduledSequence]) -> ScheduledBatch:
    """The batch of ``sequences`` (which hold their new tokens in the block manager): block
    tables, slot mapping, positions and key counts."""
    block_tables = block_manager.block_tables([s.seq_id for s in sequences])  # [B, W]
    block_size = block_manager.block_size
    # Plain Python over the host lists: a decode step's batch is a few values, where each tensor
    # op would cost microseconds.
    positions: list[int] = []
    slots: list[int] = []
    for table, sequence in zip(block_tables.tolist(), sequences):
        span = range(sequence.start, sequence.start + len(sequence.token_ids))
        positions.extend(span)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
    seq_lens = [s.start + len(s.token_ids) for s in sequences]
    return ScheduledBatch(sequences=sequences, block_tables=block_tables,
                          slot_mapping=torch.tensor(slots, dtype=torch.int64),
                          positions=torch.tensor(positions, dtype=torch.int64),
                          seq_lens=torch.tensor(seq_lens, dtype=torch.int32))


def batch_of_sequences(block_manager: BlockManager, seq_ids: Sequence[int],
                       new_tokens: Sequence[Sequence[int]], *,
                       starts: Sequence[int] | None = None,
                       logits: bool | Sequence[bool] = True,
                       logit_token_ids: Sequence[int] | None = None) -> ScheduledBatch:
    """The batch the scheduler would give sequences a caller placed in the block manager by
    hand (``allocate`` / ``append_tokens`` done, copy-on-write copies applied).

    ``new_tokens[b]`` sit at positions ``[starts[b], starts[b] + len)`` of ``seq_ids[b]``, by
    default its last tokens. Sequence ``b`` gives logits at its last new token when
    ``logits[b]`` (all by default): the whole vocabulary's, or ``logit_token_ids``' only.
    """
    if len(seq_ids) != len(new_tokens):
        raise ValueError(f"{len(seq_ids)} seq_ids but {len(new_tokens)} token lists")
    wants = [logits] * len(seq_ids) if isinstance(logits, bool) else list(logits)
    if starts is None:
        starts = [block_manager.num_tokens(seq_id) - len(tokens)
                  for seq_id, tokens in zip(seq_ids, new_tokens)]
    if not len(wants) == len(starts) == len(seq_ids):
        raise ValueError(f"{len(seq_ids)} seq_ids but {len(wants)} logits flags and "
                         f"{len(starts)} starts")
    ids = "all" if logit_token_ids is None else tuple(int(t) for t in logit_token_ids)
    sequences = []
    for seq_id, tokens, start, want in zip(seq_ids, new_tokens, starts, wants):
        held = block_manager.num_tokens(seq_id)
        if not (0 <= start and start + len(tokens) <= held):
            raise ValueError(f"sequence {seq_id} holds {held} tokens, so it cannot have "
                             f"{len(tokens)} new ones from position {start}")
        if want and not tokens:
            raise ValueError(f"sequence {seq_id} has no new token to give logits")
        sequences.append(ScheduledSequence(seq_id, start, list(tokens), ids if want else None))
    return layout_batch(block_manager, sequences)


def run_step(model: DecoderLM, kv_cache: PagedKVCache, seq_ids: Sequence[int],
             new_tokens: Sequence[Sequence[int]], *, starts: Sequence[int] | None = None,
             logits: bool | Sequence[bool] = True,
             logit_token_ids: Sequence[int] | None = None,
             decode_graphs: DecodeGraphs | None = None) -> Tensor | None:
    """One step over sequences a caller placed in ``kv_cache``'s block manager by hand (see
    :func:`batch_of_sequences`): the model run, the computed tokens marked.

    Returns the logits asked for, ``[count, vocab]`` or ``[count, len(logit_token_ids)]``, or
    None when no sequence asks. With ``decode_graphs``, a decode step replays a CUDA graph.
    """
    manager = kv_cache.block_manager
    batch = batch_of_sequences(manager, seq_ids, new_tokens, starts=starts, logits=logits,
                               logit_token_ids=logit_token_ids)
    output = ModelRunner(model, kv_cache, decode_graphs).execute(batch)
    for sequence in batch.sequences:
        manager.mark_computed(sequence.seq_id, sequence.start + len(sequence.token_ids))
    if logit_token_ids is None:
        return output.logits
    if not output.scores:
        return None
    return torch.stack([output.scores[i] for i in sorted(output.scores)])
