"""Independent-chunk prefill: block attention over reusable, position-independent chunks.

A prompt given as ``[prefix][chunk 1]...[chunk n][suffix]`` (a system prompt, retrieved
documents, a question) is prefilled under *block attention*: the prefix is causal; each chunk
attends to the prefix and to itself only; the suffix, and every token decoded after it, attends
to everything before it. A chunk's K/V then depends only on the prefix and the chunk, not on
where the chunk sits or what precedes it, so it is computed once and reused by any later prompt
with the same prefix, at any offset.

Position independence comes from a pre-RoPE cache (``PagedKVCache(..., pre_rope=True)``): keys
are stored before rotary embedding and :func:`fastllm.ops.paged_attention` rotates key ``j`` of a
sequence by position ``j`` as it reads it. Each chunk is *encoded* as if it came right after the
prefix (positions ``len(prefix) + i``) and is *read* at the positions it occupies in the prompt,
so the cached rows are copied into a new prompt's blocks as they are, whatever their offset.

What is exact and what is not:

- exact: the result equals a reference with the same semantics computed independently (HF
  transformers: each ``prefix + chunk`` run causally, its chunk K/V re-rotated to the chunk's
  offset, the suffix run over that cache; see ``tests/models/test_chunk_prefill.py``), and a
  prompt with one chunk equals an ordinary causal prefill;
- approximate: with several chunks this is *not* causal attention over the whole prompt: a
  chunk does not see the chunks before it, and chunk ``i > 1`` is encoded at positions other
  than the ones it is read at. How far the logits move on a real model is measured in the README
  (stories260K).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fastllm.kv_cache import PagedKVCache
from fastllm.model_runner import run_step
from fastllm.models.llama import DecoderLM

__all__ = ["ChunkKVStore", "ChunkedPrompt", "prefill_independent_chunks"]


@dataclass(frozen=True)
class ChunkedPrompt:
    """A prompt under block attention: token ids of the prefix, each chunk and the suffix.

    The suffix must hold at least one token: its last one yields the next-token logits.
    """

    prefix: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    suffix: tuple[int, ...]

    def __init__(self, prefix: Sequence[int], chunks: Sequence[Sequence[int]],
                 suffix: Sequence[int]) -> None:
        object.__setattr__(self, "prefix", tuple(int(t) for t in prefix))
        object.__setattr__(self, "chunks", tuple(tuple(int(t) for t in c) for c in chunks))
        object.__setattr__(self, "suffix", tuple(int(t) for t in suffix))
        if not self.suffix:
            raise ValueError("ChunkedPrompt needs a non-empty suffix (its last token gives the "
                             "logits)")
        for i, chunk in enumerate(self.chunks):
            if not chunk:
                raise ValueError(f"ChunkedPrompt chunk {i} is empty")

    @property
    def token_ids(self) -> list[int]:
        """The whole prompt, in order."""
        return [*self.prefix, *itertools.chain.from_iterable(self.chunks), *self.suffix]


class ChunkKVStore:
    """Pre-RoPE K/V of encoded chunks, keyed by (prefix, chunk) token ids, evicted LRU.

    An entry holds ``[num_layers, len(chunk), n_kv_heads, head_dim]`` K and V. The store is an
    explicit cache with a bound: it never holds more than ``max_bytes`` (least recently used
    entries go first; a chunk bigger than the bound is used once and not kept).
    """

    def __init__(self, max_bytes: int) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"ChunkKVStore.max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple[tuple[int, ...], tuple[int, ...]],
                                   tuple[Tensor, Tensor]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, prefix: tuple[int, ...], chunk: tuple[int, ...]) -> tuple[Tensor, Tensor] | None:
        """The chunk's (K, V) after ``prefix``, or None; counts a hit or a miss."""
        entry = self._entries.get((prefix, chunk))
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end((prefix, chunk))
        return entry

    def put(self, prefix: tuple[int, ...], chunk: tuple[int, ...], k: Tensor, v: Tensor) -> None:
        """Keeps (K, V) of ``chunk`` after ``prefix``, evicting the least recently used."""
        size = k.nbytes + v.nbytes
        if size > self.max_bytes or (prefix, chunk) in self._entries:
            return
        while self.nbytes + size > self.max_bytes:
            _, (old_k, old_v) = self._entries.popitem(last=False)
            self.nbytes -= old_k.nbytes + old_v.nbytes
        self._entries[(prefix, chunk)] = (k, v)
        self.nbytes += size


# Sequence ids of the short-lived sequences that encode chunks: negative, so they never meet a
# caller's (non-negative) ids in the block manager.
_encoder_ids = itertools.count(-1, -1)


def _slots(kv_cache: PagedKVCache, seq_id: int, start: int, end: int) -> Tensor:
    """int64 cache slots of logical positions ``[start, end)`` of ``seq_id``."""
    table = torch.tensor(kv_cache.block_manager.block_table(seq_id), dtype=torch.long)
    positions = torch.arange(start, end)
    block_size = kv_cache.spec.block_size
    return (table[positions // block_size] * block_size + positions % block_size).to(
        kv_cache.k_cache.device)


def _append(kv_cache: PagedKVCache, seq_id: int, tokens: Sequence[int]) -> None:
    """Appends block-attention tokens: their KV must never serve as a causal prefill's."""
    kv_cache.copy_blocks(kv_cache.block_manager.append_tokens(seq_id, list(tokens),
                                                              cacheable=False))


def _encode_chunks(model: DecoderLM, kv_cache: PagedKVCache, seq_id: int,
                   prefix: tuple[int, ...], chunks: list[tuple[int, ...]],
                   store: ChunkKVStore) -> dict[tuple[int, ...], tuple[Tensor, Tensor]]:
    """Encodes ``chunks`` (distinct) after the prefix ``seq_id`` holds, in one batch: each in a
    fork of the prefix, so it attends to the prefix and itself. Returns their pre-RoPE K/V."""
    manager = kv_cache.block_manager
    encoders = []
    try:
        for chunk in chunks:
            encoder = next(_encoder_ids)
            manager.fork(seq_id, encoder)
            encoders.append(encoder)
            _append(kv_cache, encoder, chunk)
        run_step(model, kv_cache, encoders, chunks, logits=False)
        layers, rows = kv_cache.spec.num_layers, kv_cache.k_cache.shape[2:]
        k_rows = kv_cache.k_cache.view(layers, -1, *rows[1:])  # [layers, slots, kv_heads, dim]
        v_rows = kv_cache.v_cache.view(layers, -1, *rows[1:])
        encoded = {}
        for encoder, chunk in zip(encoders, chunks):
            slots = _slots(kv_cache, encoder, len(prefix), len(prefix) + len(chunk))
            encoded[chunk] = (k_rows[:, slots], v_rows[:, slots])  # copies
            store.put(prefix, chunk, *encoded[chunk])
        return encoded
    finally:
        for encoder in encoders:
            manager.free(encoder)


def prefill_independent_chunks(model: DecoderLM, kv_cache: PagedKVCache, seq_id: int,
                               prompt: ChunkedPrompt, store: ChunkKVStore) -> Tensor:
    """Prefills ``prompt`` into a new sequence ``seq_id`` under block attention.

    The prefix goes through the prefix cache (its blocks are shared and published as usual);
    chunks found in ``store`` are copied into the sequence, the others are encoded (all in one
    batch) and stored; then the suffix runs over everything. The sequence holds the whole
    prompt afterwards and decodes like any other (its blocks past the prefix never enter the
    prefix cache: their KV is not a causal prefill's).

    Returns the ``[vocab]`` logits after the last suffix token.
    """
    if not kv_cache.pre_rope:
        raise ValueError("independent chunks need a position-independent cache: "
                         "PagedKVCache(..., pre_rope=True)")
    if seq_id < 0:
        raise ValueError(f"seq_id must be >= 0 (negative ids are fastllm's own), got {seq_id}")
    manager = kv_cache.block_manager
    prefix = prompt.prefix
    cached = manager.allocate(seq_id, list(prefix))
    try:
        if cached < len(prefix):
            run_step(model, kv_cache, [seq_id], [prefix[cached:]], logits=False)
        found = {chunk: store.get(prefix, chunk) for chunk in dict.fromkeys(prompt.chunks)}
        missing = [chunk for chunk, kv in found.items() if kv is None]
        if missing:
            found.update(_encode_chunks(model, kv_cache, seq_id, prefix, missing, store))

        # Copy every chunk's rows to the positions it occupies, all layers at once.
        start = len(prefix)
        all_chunks = list(itertools.chain.from_iterable(prompt.chunks))
        if all_chunks:
            _append(kv_cache, seq_id, all_chunks)
            slots = _slots(kv_cache, seq_id, start, start + len(all_chunks))
            layers, rows = kv_cache.spec.num_layers, kv_cache.k_cache.shape[3:]
            k = torch.cat([found[chunk][0] for chunk in prompt.chunks], dim=1)
            v = torch.cat([found[chunk][1] for chunk in prompt.chunks], dim=1)
            kv_cache.k_cache.view(layers, -1, *rows)[:, slots] = k
            kv_cache.v_cache.view(layers, -1, *rows)[:, slots] = v

        _append(kv_cache, seq_id, prompt.suffix)
        return run_step(model, kv_cache, [seq_id], [prompt.suffix])[0]
    except BaseException:
        manager.free(seq_id)
        raise
