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
             new_tokens: Sequence[Sequence[int]], *, starts: Sequence[int] | None = None,
             logits: bool | Sequence[bool] = True,
             logit_token_ids: Tensor | None = None) -> Tensor | None:
    """Runs ``model`` over new tokens of each sequence, packed in one batch.

    ``new_tokens[b]`` are tokens sequence ``seq_ids[b]`` holds in the block manager
    (``allocate`` / ``append_tokens`` done, copy-on-write copies applied) at positions
    ``[starts[b], starts[b] + len)``, by default its last tokens: a prompt, a prefill chunk or
    one decoded token. Their K/V are written into ``kv_cache``, and the block manager is told
    so (``mark_computed``): only then may their full blocks serve other sequences.

    Returns the logits at the last new token of each sequence ``b`` with ``logits[b]`` true
    (``logits=True``: all of them), ``[count, vocab]`` (the LM head runs on those rows only),
    or ``[count, len(logit_token_ids)]``: those tokens' logits alone; None with
    ``logits=False``. A sequence that gives logits must have a new token.
    """
    if len(seq_ids) != len(new_tokens):
        raise ValueError(f"{len(seq_ids)} seq_ids but {len(new_tokens)} token lists")
    counts = [len(tokens) for tokens in new_tokens]
    wants = [logits] * len(seq_ids) if isinstance(logits, bool) else list(logits)
    if len(wants) != len(seq_ids):
        raise ValueError(f"{len(seq_ids)} seq_ids but {len(wants)} logits flags")
    for seq_id, count, want in zip(seq_ids, counts, wants):
        if want and count == 0:
            raise ValueError(f"sequence {seq_id} has no new token to give logits")
    device = kv_cache.k_cache.device
    meta = AttentionMetadata.build(kv_cache, seq_ids, counts, device, starts)
    input_ids = torch.tensor(list(itertools.chain.from_iterable(new_tokens)), dtype=torch.long,
                             device=device)
    hidden = model(input_ids, meta.positions, meta, kv_cache)  # [T, hidden]
    manager = kv_cache.block_manager
    for b, seq_id in enumerate(seq_ids):  # host-side counts: no device sync
        manager.mark_computed(seq_id, manager.num_tokens(seq_id) if starts is None
                              else starts[b] + counts[b])
    if not any(wants):
        return None
    last_rows = meta.cu_seqlens_q[1:].long() - 1  # [B]
    if not all(wants):
        last_rows = last_rows[torch.tensor(wants, device=last_rows.device)]
    return model.compute_logits(hidden[last_rows], logit_token_ids)  # [count, vocab or ids]
