"""The model runner: turns the scheduler's batch into the model's inputs and runs one step.

It builds :class:`~fastllm.models.AttentionMetadata` from a :class:`ScheduledBatch` (host
tensors, moved to the device once without a wait), runs the model (or replays a CUDA graph of a
decode step) and computes logits on the rows that need them. It never touches the block manager:
the scheduler decided everything about KV placement before, and learns what was computed after.
"""

from __future__ import annotations

import itertools

from dataclasses import dataclass

import torch
from torch import Tensor

from fastllm import ops
from fastllm.engine.decode_graphs import DecodeGraphs
from fastllm.kv_cache import PagedKVCache
from fastllm.models import AttentionMetadata, DecoderLM
from fastllm.ops.host_to_device import device_tensor, to_device

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
    """

    logits: Tensor | None
    scores: dict[int, Tensor]


def attention_metadata(batch: ScheduledBatch, device: torch.device | str) -> AttentionMetadata:
    """The batch's metadata on ``device`` (copied once, without waiting for the device)."""
    counts = [len(s.token_ids) for s in batch.sequences]
    cu_seqlens_q = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32)
    return AttentionMetadata(
        cu_seqlens_q=to_device(cu_seqlens_q, device),
        max_seqlen_q=max(counts, default=0),
        seq_lens=to_device(batch.seq_lens, device),
        block_tables=to_device(batch.block_tables, device),
        slot_mapping=to_device(batch.slot_mapping, device),
        positions=to_device(batch.positions, device),
        keys_are_new=all(s.start == 0 for s in batch.sequences))


class ModelRunner:
    """Runs ``model`` over scheduled batches whose K/V live in ``kv_cache``; with
    ``decode_graphs``, plain decode steps replay CUDA graphs."""

    def __init__(self, model: DecoderLM, kv_cache: PagedKVCache,
                 decode_graphs: DecodeGraphs | None = None) -> None:
        self.model, self.kv_cache, self.decode_graphs = model, kv_cache, decode_graphs
        self.device = kv_cache.k_cache.device

    def execute(self, batch: ScheduledBatch) -> StepLogits:
        """Runs the step: writes every new token's K/V and returns the logits asked for."""
        meta = attention_metadata(batch, self.device)
        input_ids = device_tensor([t for s in batch.sequences for t in s.token_ids], torch.long,
                                  self.device)
        graphs = self.decode_graphs
        # The metadata come from the block manager, checked on the host: GPU ops need not copy
        # them back to check them again.
        with ops.trusted_inputs():
            if (graphs is not None and batch.is_decode
                    and graphs.supports(len(batch.sequences), meta.block_tables.shape[1])):
                return StepLogits(graphs.run(input_ids, meta), {})
            hidden = self.model(input_ids, meta.positions, meta, self.kv_cache)  # [T, hidden]
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
        logits = None
        if sampling_rows:
            sampling = hidden  # every row samples (decode): no gather
            if len(sampling_rows) < hidden.shape[0]:
                sampling = hidden[device_tensor(sampling_rows, torch.long, self.device)]
            logits = self.model.compute_logits(sampling)  # [n, vocab]
        scores: dict[int, Tensor] = {}
        for token_ids, entries in score_rows.items():
            rows = device_tensor([row for _, row in entries], torch.long, self.device)
            ids = device_tensor(list(token_ids), torch.long, self.device)
            group = self.model.compute_logits(hidden[rows], ids)  # [n, len(ids)]
            for (index, _), row_logits in zip(entries, group):
                scores[index] = row_logits
        return StepLogits(logits, scores)
