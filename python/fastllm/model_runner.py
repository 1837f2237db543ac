"""One forward step of a model over sequences registered in a paged KV cache."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from fastllm.kv_cache import PagedKVCache
from fastllm.models.llama import AttentionMetadata, DecoderLM

__all__ = ["run_step"]


def run_step(model: DecoderLM, kv_cache: PagedKVCache, seq_ids: Sequence[int],
             new_tokens: Sequence[Sequence[int]], *, logits: bool = True) -> Tensor | None:
    """Runs ``model`` over the newest tokens of each sequence, packed in one batch.

    ``new_tokens[b]`` are the last tokens sequence ``seq_ids[b]`` holds in the block manager
    (``allocate`` / ``append_tokens`` done, copy-on-write copies applied): a prompt, a prefill
    chunk or one decoded token. Their K/V are written into ``kv_cache``, and the block manager is
    told so (``mark_computed``): only then may their full blocks serve other sequences.

    Returns ``[len(seq_ids), vocab]`` logits at each sequence's last new token (the LM head runs
    on those rows only), or None with ``logits=False`` (then sequences may have no new token).
    """
    if len(seq_ids) != len(new_tokens):
        raise ValueError(f"{len(seq_ids)} seq_ids but {len(new_tokens)} token lists")
    counts = [len(tokens) for tokens in new_tokens]
    if logits and 0 in counts:
        raise ValueError(f"sequence {seq_ids[counts.index(0)]} has no new token to give logits")
    device = kv_cache.k_cache.device
    meta = AttentionMetadata.build(kv_cache, seq_ids, counts, device)
    input_ids = torch.tensor(list(itertools.chain.from_iterable(new_tokens)), dtype=torch.long,
                             device=device)
    hidden = model(input_ids, meta.positions, meta, kv_cache)  # [T, hidden]
    manager = kv_cache.block_manager
    for seq_id in seq_ids:
        manager.mark_computed(seq_id, manager.num_tokens(seq_id))
    if not logits:
        return None
    return model.compute_logits(hidden[meta.cu_seqlens_q[1:].long() - 1])  # [B, vocab]
