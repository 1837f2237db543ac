"""One forward step of a model over sequences registered in a paged KV cache."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from fastllm import ops
from fastllm.decode_graphs import DecodeGraphs
from fastllm.host_to_device import device_tensor
from fastllm.kv_cache import PagedKVCache
from fastllm.models.llama import AttentionMetadata, DecoderLM

__all__ = ["run_step"]


def run_step(model: DecoderLM, kv_cache: PagedKVCache, seq_ids: Sequence[int],
             new_tokens: Sequence[Sequence[int]], *, starts: Sequence[int] | None = None,
             logits: bool | Sequence[bool] = True,
             logit_token_ids: Tensor | None = None,
             decode_graphs: DecodeGraphs | None = None) -> Tensor | None:
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

    With ``decode_graphs``, a decode step (one new token and logits for every sequence, whole
    vocabulary) replays a CUDA graph instead; the logits then live in the graph's buffer until
    the next replay.
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
    input_ids = device_tensor(list(itertools.chain.from_iterable(new_tokens)), torch.long, device)
    graphed = (decode_graphs is not None and logit_token_ids is None and all(wants)
               and all(count == 1 for count in counts)
               and decode_graphs.supports(len(seq_ids), meta.block_tables.shape[1]))
    # The metadata come from the block manager, checked on the host: GPU ops need not copy
    # them back to check them again.
    with ops.trusted_inputs():
        if graphed:
            graph_logits = decode_graphs.run(input_ids, meta)  # [B, vocab]
        else:
            hidden = model(input_ids, meta.positions, meta, kv_cache)  # [T, hidden]
    manager = kv_cache.block_manager
    for b, seq_id in enumerate(seq_ids):  # host-side counts: no device sync
        manager.mark_computed(seq_id, manager.num_tokens(seq_id) if starts is None
                              else starts[b] + counts[b])
    if graphed:
        return graph_logits
    if not any(wants):
        return None
    # Each wanted sequence's last packed row, found on the host (a mask on the device would
    # sync to count it).
    ends = itertools.accumulate(counts)
    last_rows = device_tensor([end - 1 for end, want in zip(ends, wants) if want], torch.long,
                              device)
    return model.compute_logits(hidden[last_rows], logit_token_ids)  # [count, vocab or ids]
