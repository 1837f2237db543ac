"""The step contract: what the scheduler hands an executor (:class:`SchedulerOutput`) and what
comes back (:class:`ModelRunnerOutput`), as vLLM v1 shapes them.

Both are plain data (host tensors, lists, sampling parameters), so an executor may send a
step to worker processes as it is. The scheduler never sees the model runner, and the runner
never sees a :class:`~fastllm.engine.request.Request`: it knows a request by its id, from the
:class:`NewRequest` record of its first step until its id is among a step's
``finished_request_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fastllm.kv_cache import BlockManager, cache_slots
from fastllm.lora.adapter import LoRARequest
from fastllm.sampling import SamplingParams

__all__ = ["ModelRunnerOutput", "NewRequest", "SampledLogprobs", "ScheduledSequence",
           "SchedulerOutput", "batch_of_sequences", "layout_batch", "request_error"]


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
        request_id: the request it belongs to ("" for a sequence run by hand).
        num_output_tokens: tokens the request had generated before this step (a sampling
            sequence's position in its random stream).
        prompt_logprob_ids: prompt tokens whose logprobs its rows give (the rows from
            ``prompt_logprob_row`` on, each the logprob of the token after it), with the
            ``num_prompt_logprobs`` most likely alternatives.
        num_pool_rows: rows from ``pool_row`` on whose final hidden states are summed for a
            pooled embedding.
        chunk_loads: ``(entry id, int64 slots)`` stored chunk encodings
            (:class:`~fastllm.kv_cache.ChunkIndex`) the workers write at these cache slots before
            the step.
        chunk_save: ``(entry id, int64 slots)``: the K/V at these slots, which this step
            completes, the workers keep under the id once it ran.
        lora_request: the LoRA adapter its tokens run with, or None (the base model).
    """

    seq_id: int
    start: int
    token_ids: list[int]
    logit_token_ids: None | str | tuple[int, ...] = None
    num_draft_tokens: int = 0
    request_id: str = ""
    num_output_tokens: int = 0
    prompt_logprob_ids: list[int] = field(default_factory=list)
    prompt_logprob_row: int = 0
    num_prompt_logprobs: int = 0
    pool_row: int = 0
    num_pool_rows: int = 0
    chunk_loads: list[tuple[int, Tensor]] = field(default_factory=list)
    chunk_save: tuple[int, Tensor] | None = None
    lora_request: LoRARequest | None = None

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]

    @property
    def samples(self) -> bool:
        return self.logit_token_ids == "all"


@dataclass
class NewRequest:
    """What the runner side keeps of a sampling request, from its first step to its end."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    end_token_ids: list[int]  # the tokens that end it (stop token ids, and EOS unless ignored)


@dataclass
class SchedulerOutput:
    """One step: the scheduler's batch, on the host.

    Attributes:
        sequences: each sequence's new tokens, in packed order.
        block_tables: int32 ``[B, max_blocks]`` each sequence's cache blocks, in token order.
        slot_mapping: int64 ``[T]`` the cache slot of each new token.
        positions: int64 ``[T]`` each new token's position in its sequence.
        seq_lens: int32 ``[B]`` keys per sequence once this step's tokens are written.
        new_requests: the sampling requests this step shows the runner for the first time.
        finished_request_ids: requests that left since the last step (the runner drops what
            it kept of them).
        grammar_bitmask: int32 ``[n, words]`` the allowed tokens of each constrained request
            in ``constrained_request_ids`` (its row of this step), or None.
        constrained_request_ids: the requests ``grammar_bitmask``'s rows belong to.
        block_copies: ``(src, dst)`` blocks the workers copy on every layer's K and V before the
            step (copy-on-write: a sequence appended into a block it shared).
        chunk_drops: stored chunk encodings the workers forget (evicted from the index).
        removed_lora_ids: LoRA adapters unloaded since the last step (the workers forget them).
        started: when the engine began the step (``time.perf_counter()`` in the process that
            samples; 0 unknown): speculative decoding's step costs count the scheduling too,
            as a step costs its caller.

    Every move of KV tensors is here, for each worker to run on its own cache: ``chunk_drops``,
    ``block_copies`` and the sequences' ``chunk_loads`` before the model, their ``chunk_save``
    after it. The scheduler moves none itself.
    """

    sequences: list[ScheduledSequence]
    block_tables: Tensor
    slot_mapping: Tensor
    positions: Tensor
    seq_lens: Tensor
    new_requests: list[NewRequest] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Tensor | None = None
    constrained_request_ids: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    chunk_drops: list[int] = field(default_factory=list)
    removed_lora_ids: list[int] = field(default_factory=list)
    started: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, each sampling from the whole vocabulary (and no other
        logprob)."""
        return all(len(s.token_ids) == 1 and s.samples and not s.prompt_logprob_ids
                   for s in self.sequences)

    @property
    def num_logit_rows(self) -> int:
        """Rows of the step's full-vocabulary logits."""
        return sum(1 + s.num_draft_tokens for s in self.sequences if s.samples)

    @classmethod
    def empty(cls, finished_request_ids: Sequence[str], chunk_drops: Sequence[int] = (),
              removed_lora_ids: Sequence[int] = ()) -> SchedulerOutput:
        """A step that runs nothing and only tells the workers which requests left, which
        chunk encodings and which LoRA adapters to forget."""
        return cls([], torch.zeros(0, 0, dtype=torch.int32), torch.zeros(0, dtype=torch.int64),
                   torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32),
                   finished_request_ids=list(finished_request_ids),
                   chunk_drops=list(chunk_drops), removed_lora_ids=list(removed_lora_ids))


@dataclass
class SampledLogprobs:
    """One sampled position's log-probabilities: the sampled token's, then the most likely
    tokens' (``top_ids`` / ``top_logprobs``, most likely first; an id < 0 is no token)."""

    token_logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    """What one step gives back, on the host.

    Attributes:
        sampled_token_ids: per sampling request, the tokens of its rows up to the first that
            differs from its draft: the accepted drafts, then the step's own token (one token
            without drafts). A token < 0 marks a row whose logits could not be sampled.
        logprobs: per request that asked for logprobs, an entry per sampled token.
        scores: per scoring sequence (its index in the step), the logits of its token ids.
        prompt_logprobs: per sequence with ``prompt_logprob_ids`` (its index in the step), an
            entry per id.
        pooled: per sequence with ``num_pool_rows`` (its index in the step), the float32 sum
            of those rows' final hidden states (on the device).
        draft_token_ids: per request that speculates, the drafts for its next step.
        errors: requests whose logits could not be sampled, and why.
        propose_s: seconds spent drafting.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[SampledLogprobs]] = field(default_factory=dict)
    scores: dict[int, Tensor] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[SampledLogprobs]] = field(default_factory=dict)
    pooled: dict[int, Tensor] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    errors: dict[str, Exception] = field(default_factory=dict)
    propose_s: float = 0.0


def layout_batch(block_manager: BlockManager,
                 sequences: list[ScheduledSequence]) -> SchedulerOutput:
    """The step of ``sequences`` (which hold their new tokens in the block manager): block
    tables, slot mapping, positions and key counts."""
    block_tables = block_manager.block_tables([s.seq_id for s in sequences])  # [B, W]
    positions: list[int] = []
    slots: list[int] = []
    for table, sequence in zip(block_tables.tolist(), sequences):
        end = sequence.start + len(sequence.token_ids)
        positions.extend(range(sequence.start, end))
        slots.extend(cache_slots(table, block_manager.block_size, sequence.start, end))
    seq_lens = [s.start + len(s.token_ids) for s in sequences]
    return SchedulerOutput(sequences=sequences, block_tables=block_tables,
                           slot_mapping=torch.tensor(slots, dtype=torch.int64),
                           positions=torch.tensor(positions, dtype=torch.int64),
                           seq_lens=torch.tensor(seq_lens, dtype=torch.int32))


def batch_of_sequences(block_manager: BlockManager, seq_ids: Sequence[int],
                       new_tokens: Sequence[Sequence[int]], *,
                       starts: Sequence[int] | None = None,
                       logits: bool | Sequence[bool] = True) -> SchedulerOutput:
    """The step the scheduler would give sequences a caller placed in the block manager by
    hand (``allocate`` / ``append_tokens`` done, copy-on-write copies applied).

    ``new_tokens[b]`` sit at positions ``[starts[b], starts[b] + len)`` of ``seq_ids[b]``, by
    default its last tokens. Sequence ``b`` gives the whole vocabulary's logits at its last new
    token when ``logits[b]`` (all by default).
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
    sequences = []
    for seq_id, tokens, start, want in zip(seq_ids, new_tokens, starts, wants):
        held = block_manager.num_tokens(seq_id)
        if not (0 <= start and start + len(tokens) <= held):
            raise ValueError(f"sequence {seq_id} holds {held} tokens, so it cannot have "
                             f"{len(tokens)} new ones from position {start}")
        if want and not tokens:
            raise ValueError(f"sequence {seq_id} has no new token to give logits")
        sequences.append(ScheduledSequence(seq_id, start, list(tokens), "all" if want else None))
    return layout_batch(block_manager, sequences)


def request_error(what: str, error: Exception) -> Exception:
    """``error`` with what failed said first (a ValueError stays one), chained to it: how a
    step reports the error that failed one request."""
    said = (ValueError if isinstance(error, ValueError) else RuntimeError)(f"{what}: {error}")
    said.__cause__ = error
    return said
