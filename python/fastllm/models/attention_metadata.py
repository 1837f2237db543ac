"""What a model reads about one step's batch: where its tokens sit in the packed batch and in
the paged KV cache. The engine's model runner builds it from the scheduler's batch; models only
read it."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["AttentionMetadata"]


@dataclass(frozen=True)
class AttentionMetadata:
    """Where one step's tokens sit in the batch and in the paged cache.

    Attributes:
        cu_seqlens_q: int32 ``[B + 1]`` offsets of each sequence's new tokens in the packed batch.
        max_seqlen_q: the most new tokens of any sequence.
        seq_lens: int32 ``[B]`` keys per sequence once this step's tokens are written.
        block_tables: int32 ``[B, max_blocks]`` each sequence's cache blocks, in token order.
        slot_mapping: int64 ``[T]`` cache slot (``block * block_size + offset``) of each new token.
        positions: int64 ``[T]`` each new token's position in its sequence (the ``positions``
            argument of :meth:`DecoderLM.forward`).
    """

    cu_seqlens_q: Tensor
    max_seqlen_q: int
    seq_lens: Tensor
    block_tables: Tensor
    slot_mapping: Tensor
    positions: Tensor
    # Every sequence's keys are exactly its new tokens (a prefill with nothing cached): attention
    # can then run on the step's own K/V, packed, without reading them back through the cache.
    keys_are_new: bool = False
