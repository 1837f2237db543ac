"""Pre-RoPE K/V of independently encoded prompt chunks, reusable at any offset (see
:mod:`fastllm.engine.chunked_prompt`), kept as vLLM keeps offloaded KV: the scheduler holds the
index (:class:`ChunkIndex`: which chunks are stored, under which entry id, what they weigh,
which to evict) and every worker holds the tensors of its own KV heads (:class:`ChunkKVStore`),
saving, loading and dropping entries only as a step's
:class:`~fastllm.engine.scheduler_output.SchedulerOutput` says. Each rank's entries hold its
share of the heads, so the index's byte count is the same on every rank."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from torch import Tensor

__all__ = ["ChunkIndex", "ChunkKVStore"]

ChunkKey = tuple[tuple[int, ...], tuple[int, ...]]  # (prefix, chunk) token ids


@dataclass
class _Entry:
    key: ChunkKey
    nbytes: int
    pins: int = 1  # jobs using it; a pinned entry is never evicted
    findable: bool = False  # committed, and the first entry of its key


class ChunkIndex:
    """Which chunk encodings the workers hold, by entry id: an explicit cache bounded by
    ``max_bytes`` (at ``bytes_per_token`` per chunk token), evicted least recently used.

    An entry is reserved (pinned) for the step that encodes its chunk, committed once that
    step ran, and found by later prompts after the same prefix (each find pins it for the
    finder). Pinned entries may take the store past its bound for as long as they are pinned
    (a chunk bigger than the bound is used once and not kept); unpinned ones are evicted while
    it is past the bound. The ids of entries evicted or abandoned wait in :meth:`take_drops`
    for the next step to tell the workers.
    """

    def __init__(self, max_bytes: int, bytes_per_token: int) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"chunk store max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.bytes_per_token = bytes_per_token
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: dict[int, _Entry] = {}
        self._by_key: OrderedDict[ChunkKey, int] = OrderedDict()  # findable, least recent first
        self._next_id = 0
        self._drops: list[int] = []

    def __len__(self) -> int:
        """Entries the workers hold (pinned ones included)."""
        return len(self._entries)

    def find(self, prefix: tuple[int, ...], chunk: tuple[int, ...]) -> int | None:
        """The id of the stored encoding of ``chunk`` after ``prefix``, pinned for the caller,
        or None; counts a hit or a miss."""
        entry_id = self._by_key.get((prefix, chunk))
        if entry_id is None:
            self.misses += 1
            return None
        self.hits += 1
        self._by_key.move_to_end((prefix, chunk))
        self._entries[entry_id].pins += 1
        return entry_id

    def reserve(self, prefix: tuple[int, ...], chunk: tuple[int, ...]) -> int:
        """A new entry for an encoding of ``chunk`` about to be saved, pinned for the caller."""
        entry_id, self._next_id = self._next_id, self._next_id + 1
        entry = _Entry((prefix, chunk), len(chunk) * self.bytes_per_token)
        self._entries[entry_id] = entry
        self.nbytes += entry.nbytes
        self._evict()
        return entry_id

    def commit(self, entry_id: int) -> None:
        """Makes a reserved entry findable, once the workers saved it (unless its key already
        has an entry: then it serves its pins only)."""
        entry = self._entries[entry_id]
        if entry.key not in self._by_key:
            self._by_key[entry.key] = entry_id
            entry.findable = True

    def release(self, entry_id: int) -> None:
        """Unpins an entry; one no longer findable goes, and the store is brought back within
        its bound."""
        entry = self._entries[entry_id]
        entry.pins -= 1
        if entry.pins == 0 and not entry.findable:
            self._drop(entry_id)
        self._evict()

    def take_drops(self) -> list[int]:
        """The ids evicted or abandoned since the last call."""
        drops, self._drops = self._drops, []
        return drops

    def _evict(self) -> None:
        for key, entry_id in list(self._by_key.items()):
            if self.nbytes <= self.max_bytes:
                return
            if self._entries[entry_id].pins == 0:
                del self._by_key[key]
                self._drop(entry_id)

    def _drop(self, entry_id: int) -> None:
        self.nbytes -= self._entries.pop(entry_id).nbytes
        self._drops.append(entry_id)


class ChunkKVStore:
    """A worker's chunk encodings by entry id: each ``[num_layers, len(chunk), n_kv_heads,
    head_dim]`` K and V of its own KV heads, as :meth:`PagedKVCache.read_rows` gives them. It
    keeps what it is told to save until told to drop it (:class:`ChunkIndex` decides)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Tensor, Tensor]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._entries.values())

    def save(self, entry_id: int, k: Tensor, v: Tensor) -> None:
        self._entries[entry_id] = (k, v)

    def load(self, entry_id: int) -> tuple[Tensor, Tensor]:
        return self._entries[entry_id]

    def drop(self, entry_ids: list[int]) -> None:
        """Forgets the entries (ids it never saved, as of a step that failed, are no error)."""
        for entry_id in entry_ids:
            self._entries.pop(entry_id, None)

