"""The model runner: turns the scheduler's batch into the model's inputs and runs one step.

It builds :class:`~fastllm.models.AttentionMetadata` from a :class:`ScheduledBatch` (host
tensors, moved to the device in one copy with whatever else the step reads, such as the
sampler's parameters, without a wait), runs the model (or replays a CUDA graph of a decode step)
and computes logits on the rows that need them. It never touches the block manager:
the scheduler decided everything about KV placement before, and learns what was computed after.
"""

from __future__ import annotations

import itertools

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fastllm import ops
from fastllm.engine.decode_graphs import DecodeGraphs
from fastllm.kv_cache import PagedKVCache
from fastllm.models import AttentionMetadata, DecoderLM
from fastllm.ops.host_to_device import StagingBuffer

__all__ = ["ModelRunner", "ScheduledBatch", "ScheduledSequence", "StepLogits",
           "attention_metadata"]


@dataclass
class ScheduledSequence:
    """One sequence's share of a step.

    Attributes:
        seq_id: its id in the block manager.
        start: position of its first new token.
        token_ids: its new tokens (positions ``[start, start + len)``).
        logit_token_ids: what the step gives back at its last new token: None for nothing,
            ``"all"`` for the whole vocabulary's logits (it samples), or a tuple of token ids
            whose logits alone are computed (a scorer reads two logits, not 151,936).
        num_draft_tokens: its last new tokens that are speculative drafts being verified
            (with ``"all"``): the step gives logits at each of its last
            ``1 + num_draft_tokens`` rows.
    """

    seq_id: int
    start: int
    token_ids: list[int]
    logit_token_ids: None | str | tuple[int, ...] = None
    num_draft_tokens: int = 0

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]


@dataclass
class ScheduledBatch:
    """One step's work as the scheduler laid it out, on the host.

    Attributes:
        sequences: each sequence's new tokens, in packed order.
        block_tables: int32 ``[B, max_blocks]`` each sequence's cache blocks, in token order.
        slot_mapping: int64 ``[T]`` the cache slot of each new token.
        positions: int64 ``[T]`` each new token's position in its sequence.
        seq_lens: int32 ``[B]`` keys per sequence once this step's tokens are written.
    """

    sequences: list[ScheduledSequence]
    block_tables: Tensor
    slot_mapping: Tensor
    positions: Tensor
    seq_lens: Tensor

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, each sampling from the whole vocabulary."""
        return all(len(s.token_ids) == 1 and s.logit_token_ids == "all" for s in self.sequences)

    @property
    def num_logit_rows(self) -> int:
        """Rows of the step's full-vocabulary logits."""
        return sum(1 + s.num_draft_tokens for s in self.sequences if s.logit_token_ids == "all")


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
    """

    logits: Tensor | None
    scores: dict[int, Tensor]
    extra: dict[str, Tensor] = field(default_factory=dict)


def _metadata_inputs(batch: ScheduledBatch) -> dict[str, Tensor]:
    """The host tensors of the batch's metadata."""
    counts = [len(s.token_ids) for s in batch.sequences]
    return {"cu_seqlens_q": torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32),
            "seq_lens": batch.seq_lens, "block_tables": batch.block_tables,
            "slot_mapping": batch.slot_mapping, "positions": batch.positions}


def _metadata(batch: ScheduledBatch, staged: Mapping[str, Tensor]) -> AttentionMetadata:
    """The batch's metadata from :func:`_metadata_inputs`' tensors on the device."""
    return AttentionMetadata(
        cu_seqlens_q=staged["cu_seqlens_q"],
        max_seqlen_q=max((len(s.token_ids) for s in batch.sequences), default=0),
        seq_lens=staged["seq_lens"], block_tables=staged["block_tables"],
        slot_mapping=staged["slot_mapping"], positions=staged["positions"],
        keys_are_new=all(s.start == 0 for s in batch.sequences))


def attention_metadata(batch: ScheduledBatch, device: torch.device | str) -> AttentionMetadata:
    """The batch's metadata on ``device`` (one copy, without waiting for the device)."""
    return _metadata(batch, StagingBuffer(device).send(_metadata_inputs(batch))[0])


class ModelRunner:
    """Runs ``model`` over scheduled batches whose K/V live in ``kv_cache``; with
    ``decode_graphs``, plain decode steps replay CUDA graphs. Each step's host data reach the
    device in one copy, through the runner's :class:`StagingBuffer`."""

    def __init__(self, model: DecoderLM, kv_cache: PagedKVCache,
                 decode_graphs: DecodeGraphs | None = None) -> None:
        self.model, self.kv_cache, self.decode_graphs = model, kv_cache, decode_graphs
        self.device = kv_cache.k_cache.device
        self.staging = StagingBuffer(self.device)

    def execute(self, batch: ScheduledBatch,
                extra: Mapping[str, Tensor] | None = None) -> StepLogits:
        """Runs the step: writes every new token's K/V and returns the logits asked for.
        ``extra`` host tensors (what the caller reads next, such as the sampler's parameters)
        travel in the step's one host-to-device copy and come back in ``StepLogits.extra``."""
        extra = {} if extra is None else extra
        input_ids = [t for s in batch.sequences for t in s.token_ids]
        graphs = self.decode_graphs
        if (graphs is not None and batch.is_decode
                and graphs.supports(len(batch.sequences), batch.block_tables.shape[1])):
            packed = graphs.pack(input_ids, batch.positions, batch.slot_mapping, batch.seq_lens,
                                 batch.block_tables)
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
            if wanted == "all":
                sampling_rows.extend(range(end - 1 - sequence.num_draft_tokens, end))
            elif wanted is not None:
                score_rows.setdefault(wanted, []).append((index, end - 1))
        inputs = _metadata_inputs(batch)
        inputs["input_ids"] = torch.tensor(input_ids, dtype=torch.long)
        gather = 0 < len(sampling_rows) < len(input_ids)  # every row samples (decode): no gather
        if gather:
            inputs["sampling_rows"] = torch.tensor(sampling_rows, dtype=torch.long)
        for i, (token_ids, entries) in enumerate(score_rows.items()):
            inputs[f"score_rows{i}"] = torch.tensor([row for _, row in entries], dtype=torch.long)
            inputs[f"score_ids{i}"] = torch.tensor(token_ids, dtype=torch.long)
        staged, staged_extra = self.staging.send(inputs, extra)
        meta = _metadata(batch, staged)
        with ops.trusted_inputs():
            hidden = self.model(staged["input_ids"], meta.positions, meta,
                                self.kv_cache)  # [T, hidden]
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
        return StepLogits(logits, scores, staged_extra)
