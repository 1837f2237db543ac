"""Pre-RoPE K/V of independently encoded prompt chunks, reusable at any offset (see
:mod:`fastllm.engine.chunked_prompt`)."""

from __future__ import annotations

from collections import OrderedDict

from torch import Tensor

__all__ = ["ChunkKVStore"]


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
