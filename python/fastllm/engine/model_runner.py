"""The model runner: turns the scheduler's batch into the model's inputs and runs one step.

It builds the step's one :class:`fastllm.ops.DecoderStep` from a
:class:`~fastllm.engine.scheduler_output.SchedulerOutput` (its host tensors moved to the device
in one copy with whatever else the step reads, such as the sampler's parameters, without a
wait), hands it to the model as it is (or to a CUDA graph of a decode step, whose static inputs
are one) and computes logits on the rows that need them. :meth:`ModelRunner.execute` never
touches the block manager: the scheduler decided everything about KV placement before, and
learns what was computed after. A caller that places sequences in a block manager of its own
(the speculative draft model, whose cache the scheduler never sees; tests) runs them with
:meth:`ModelRunner.execute_placed_sequences`, which marks what it computed.
"""

from __future__ import annotations

import itertools

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fastllm import ops
from fastllm.engine.decode_graphs import DecodeGraphs
from fastllm.engine.scheduler_output import SchedulerOutput, batch_of_sequences
from fastllm.kv_cache import PagedKVCache
from fastllm.lora.slots import LoRASlots
from fastllm.models import DecoderLM
from fastllm.ops.host_to_device import StagingBuffer

__all__ = ["ModelRunner", "StepLogits", "decoder_step", "step_tensors"]


@dataclass
class StepLogits:
    """What one step gives back.

    Attributes:
        logits: ``[n, vocab]`` for the sequences with ``logit_token_ids == "all"``, in batch
            order, ``1 + num_draft_tokens`` rows each (None if there are none).
        scores: for each sequence that asked for some token ids (by its index in the batch),
            ``[len(ids)]`` logits of those ids.
        extra: the ``extra`` host tensors given to :meth:`ModelRunner.execute`, on the device
            (valid until the runner's next step).
        prompt_logprobs: for each sequence with ``prompt_logprob_ids`` (by its index in the
            batch), float32 ``[n]`` the ids' logprobs, int64 ``[n, k]`` the most likely
            tokens and float32 ``[n, k]`` their logprobs (k: the batch's largest
            ``num_prompt_logprobs``).
        pooled: for each sequence with ``num_pool_rows``, the float32 sum of those rows'
            final hidden states.
    """

    logits: Tensor | None
    scores: dict[int, Tensor]
    extra: dict[str, Tensor] = field(default_factory=dict)
    prompt_logprobs: dict[int, tuple[Tensor, Tensor, Tensor]] = field(default_factory=dict)
    pooled: dict[int, Tensor] = field(default_factory=dict)


# Rows of full-vocabulary logits computed at once for prompt logprobs: a long prompt's rows
# would otherwise take gigabytes (2048 rows of 151,936 float32 logits: 1.2 GB).
_PROMPT_LOGPROB_ELEMENTS = 16 << 20


def step_tensors(batch: SchedulerOutput) -> dict[str, Tensor]:
    """The host tensors of the batch's :class:`fastllm.ops.DecoderStep`, by field."""
    counts = [len(s.token_ids) for s in batch.sequences]
    return {"positions": batch.positions,
            "cu_seqlens_q": torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32),
            "seq_lens": batch.seq_lens, "block_tables": batch.block_tables,
            "slot_mapping": batch.slot_mapping}


def decoder_step(batch: SchedulerOutput, tensors: Mapping[str, Tensor]) -> ops.DecoderStep:
    """The batch's step over :func:`step_tensors`' tensors once they are on the device."""
    return ops.DecoderStep(
        **tensors, max_seqlen_q=max((len(s.token_ids) for s in batch.sequences), default=0),
        keys_are_new=all(s.start == 0 for s in batch.sequences))


class ModelRunner:
    """Runs ``model`` over scheduled batches whose K/V live in ``kv_cache``; with
    ``decode_graphs``, plain decode steps replay CUDA graphs. Each step's host data reach the
    device in one copy, through the runner's :class:`StagingBuffer`."""

    def __init__(self, model: DecoderLM, kv_cache: PagedKVCache,
                 decode_graphs: DecodeGraphs | None = None, lora: LoRASlots | None = None
                 ) -> None:
        self.model, self.kv_cache, self.decode_graphs = model, kv_cache, decode_graphs
        self.lora = lora
        self.device = kv_cache.k_cache.device
        self.staging = StagingBuffer(self.device)

    def execute(self, batch: SchedulerOutput,
                extra: Mapping[str, Tensor] | None = None) -> StepLogits:
        """Runs the step: writes every new token's K/V and returns the logits asked for.
        ``extra`` host tensors (what the caller reads next, such as the sampler's parameters)
        travel in the step's one host-to-device copy and come back in ``StepLogits.extra``."""
        extra = {} if extra is None else extra
        input_ids = [t for s in batch.sequences for t in s.token_ids]
        tensors = step_tensors(batch)
        lora_slots = self._lora_slots(batch)
        if lora_slots is not None:
            tensors["lora_slots"] = lora_slots
        graphs = self.decode_graphs
        if (graphs is not None and batch.is_decode and lora_slots is None
                and graphs.supports(len(batch.sequences), batch.block_tables.shape[1])):
            packed = graphs.pack(input_ids, tensors)
            staged, staged_extra = self.staging.send({"packed": packed}, extra)
            # The metadata come from the block manager, checked on the host: GPU ops need not
            # copy them back to check them again.
            with ops.trusted_inputs():
                logits = graphs.run(staged["packed"], len(batch.sequences))
            return StepLogits(logits, {}, staged_extra)
        # Each sequence's last packed row, found on the host (a device mask would sync).
        sampling_rows: list[int] = []
        score_rows: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # ids -> (index, row)
        end = 0
        for index, sequence in enumerate(batch.sequences):
            end += len(sequence.token_ids)
            wanted = sequence.logit_token_ids
            if sequence.samples:
                sampling_rows.extend(range(end - 1 - sequence.num_draft_tokens, end))
            elif wanted is not None:
                score_rows.setdefault(wanted, []).append((index, end - 1))
        prompt_rows: dict[int, range] = {}  # index -> its rows in the packed batch
        pool_rows: dict[int, slice] = {}
        start = 0
        for index, sequence in enumerate(batch.sequences):
            if sequence.prompt_logprob_ids:
                first = start + sequence.prompt_logprob_row
                prompt_rows[index] = range(first, first + len(sequence.prompt_logprob_ids))
            if sequence.num_pool_rows:
                first = start + sequence.pool_row
                pool_rows[index] = slice(first, first + sequence.num_pool_rows)
            start += len(sequence.token_ids)
        inputs = {"input_ids": torch.tensor(input_ids, dtype=torch.long)}
        if prompt_rows:
            inputs["prompt_rows"] = torch.tensor([r for rows in prompt_rows.values()
                                                  for r in rows], dtype=torch.long)
            inputs["prompt_ids"] = torch.tensor([t for i in prompt_rows for t in
                                                 batch.sequences[i].prompt_logprob_ids],
                                                dtype=torch.long)
        gather = 0 < len(sampling_rows) < len(input_ids)  # every row samples (decode): no gather
        if gather:
            inputs["sampling_rows"] = torch.tensor(sampling_rows, dtype=torch.long)
        for i, (token_ids, entries) in enumerate(score_rows.items()):
            inputs[f"score_rows{i}"] = torch.tensor([row for _, row in entries], dtype=torch.long)
            inputs[f"score_ids{i}"] = torch.tensor(token_ids, dtype=torch.long)
        staged_step, staged, staged_extra = self.staging.send(tensors, inputs, extra)
        with ops.trusted_inputs():
            hidden = self.model(staged["input_ids"], decoder_step(batch, staged_step),
                                self.kv_cache, None if lora_slots is None else self.lora)
        logits = None
        if sampling_rows:
            logits = self.model.compute_logits(
                hidden[staged["sampling_rows"]] if gather else hidden)  # [n, vocab]
        scores: dict[int, Tensor] = {}
        for i, entries in enumerate(score_rows.values()):
            group = self.model.compute_logits(hidden[staged[f"score_rows{i}"]],
                                              staged[f"score_ids{i}"])  # [n, len(ids)]
            for (index, _), row_logits in zip(entries, group):
                scores[index] = row_logits
        prompt_logprobs = {}
        if prompt_rows:
            k = max(batch.sequences[i].num_prompt_logprobs for i in prompt_rows)
            every = self._prompt_logprobs(hidden[staged["prompt_rows"]], staged["prompt_ids"], k)
            start = 0
            for index, rows in prompt_rows.items():
                part = slice(start, start + len(rows))
                prompt_logprobs[index] = tuple(t[part] for t in every)
                start += len(rows)
        pooled = {index: hidden[rows].float().sum(0) for index, rows in pool_rows.items()}
        return StepLogits(logits, scores, staged_extra, prompt_logprobs, pooled)

    def execute_placed_sequences(self, seq_ids: Sequence[int],
                                 new_tokens: Sequence[Sequence[int]],
                                 extra: Mapping[str, Tensor] | None = None, *,
                                 starts: Sequence[int] | None = None,
                                 logits: bool | Sequence[bool] = True) -> StepLogits:
        """One step over sequences the caller placed in this runner's cache's block manager
        itself (``allocate`` / ``append_tokens`` done, copy-on-write copies applied), laid out
        as the scheduler lays out a step (:func:`batch_of_sequences`: ``new_tokens[b]`` at
        ``starts[b]``, by default ``seq_ids[b]``'s last tokens; logits at the last new token of
        each sequence with ``logits[b]``), run by :meth:`execute` and then marked computed.
        """
        manager = self.kv_cache.block_manager
        batch = batch_of_sequences(manager, seq_ids, new_tokens, starts=starts, logits=logits)
        output = self.execute(batch, extra)
        for sequence in batch.sequences:
            manager.mark_computed(sequence.seq_id, sequence.start + len(sequence.token_ids))
        return output

    def _lora_slots(self, batch: SchedulerOutput) -> Tensor | None:
        """int32 ``[T]`` each token's LoRA slot (-1: none), its adapters put in slots; None
        for a step without adapters."""
        requests = [s.lora_request for s in batch.sequences if s.lora_request is not None]
        if not requests:
            return None
        if self.lora is None:
            raise ValueError(f"LoRA adapter {requests[0].lora_name!r} asked of an engine "
                             "without LoRA (LLM(..., enable_lora=True))")
        slot_of = self.lora.slots(requests)
        slots = [-1 if s.lora_request is None else slot_of[s.lora_request.lora_int_id]
                 for s in batch.sequences]
        return torch.tensor([slot for s, slot in zip(batch.sequences, slots)
                             for _ in s.token_ids], dtype=torch.int32)

    def _prompt_logprobs(self, hidden: Tensor, token_ids: Tensor, k: int
                         ) -> tuple[Tensor, Tensor, Tensor]:
        """The logprobs of ``token_ids`` at rows ``hidden`` under the raw logits, and the ``k``
        most likely tokens', a slice of rows at a time."""
        per_slice = max(1, _PROMPT_LOGPROB_ELEMENTS // self.model.config.vocab_size)
        parts = []
        for start in range(0, hidden.shape[0], per_slice):
            rows = slice(start, start + per_slice)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows]).float(), dim=-1)
            top = logprobs.topk(k, dim=-1)
            parts.append((logprobs.gather(1, token_ids[rows, None]).squeeze(1), top.indices,
                          top.values))
        return tuple(torch.cat(column) for column in zip(*parts))
