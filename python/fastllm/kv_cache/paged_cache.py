"""KV caches: sizing, a static per-row cache and a paged cache with a block manager.

:class:`KVCacheSpec` describes what one token's K/V cost; :func:`plan_pool` turns a workload or
a memory budget into a pool size. :class:`StaticKVCache` preallocates ``[max_batch, max_len]``
rows (simple batched generation); :class:`PagedKVCache` preallocates pools of fixed-size blocks
that its :class:`BlockManager` (C++) hands out to sequences, with prefix caching and
copy-on-write forks.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fastllm import _C
from fastllm.ops.host_to_device import to_device

__all__ = ["BlockManager", "KVCacheFullError", "KVCacheSpec", "KVPoolPlan", "PagedKVCache",
           "StaticKVCache", "cache_dtype_serves", "cache_slots", "default_kv_cache_memory",
           "plan_pool", "zeros_pool"]

BlockManager = _C.BlockManager
KVCacheFullError = _C.KVCacheFullError


def cache_dtype_serves(cache_dtype: torch.dtype, activation_dtype: torch.dtype) -> bool:
    """Whether a KV cache stored in ``cache_dtype`` can serve activations of
    ``activation_dtype``: the same dtype, or bfloat16 / float16 under float32 activations
    (rounded as K/V are written, read back as float32: the rule of
    :func:`fastllm.ops.reshape_and_cache` and :func:`fastllm.ops.paged_attention`)."""
    return cache_dtype == activation_dtype or (
        activation_dtype == torch.float32 and cache_dtype in (torch.bfloat16, torch.float16))


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one model's KV cache.

    Attributes:
        num_layers: decoder layers, each with its own K and V.
        n_kv_heads: key/value heads per layer (fewer than query heads under GQA).
        head_dim: size of one head.
        dtype: storage dtype of the cache: the model's activations' dtype, or a narrower one
            (:func:`cache_dtype_serves`).
        block_size: tokens per block of a paged pool (unused by :class:`StaticKVCache`).
    """

    num_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("num_layers", "n_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KVCacheSpec.dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.n_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token


@dataclass(frozen=True)
class KVPoolPlan:
    """A paged pool size and what it costs.

    Attributes:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        nbytes: bytes of the K and V pools of all layers together.
        bytes_per_token: K and V of one token over all layers.
        max_tokens: tokens the pool holds, ``num_blocks * block_size``.
    """

    num_blocks: int
    block_size: int
    nbytes: int
    bytes_per_token: int
    max_tokens: int

    def describe(self) -> str:
        """One line: the pool's size in blocks and tokens and its memory cost."""
        return (f"{self.num_blocks:,} blocks x {self.block_size} tokens = {self.max_tokens:,} "
                f"tokens of KV at {self.bytes_per_token:,} bytes each: {_format_bytes(self.nbytes)}"
                f" ({self.nbytes:,} bytes)")


def _format_bytes(n: int) -> str:
    """1536 -> '1.50 KiB'."""
    exponent = min((n.bit_length() - 1) // 10, 4) if n > 0 else 0
    return f"{n / 1024**exponent:.2f} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[exponent]}"


def plan_pool(spec: KVCacheSpec, *, max_num_seqs: int | None = None,
              max_model_len: int | None = None, memory_bytes: int | None = None) -> KVPoolPlan:
    """Sizes a paged pool, one of two ways (passing both, or neither, is a ValueError).

    ``max_num_seqs`` and ``max_model_len`` together: room for that many sequences at full length,
    each rounded up to whole blocks. ``memory_bytes`` alone: as many blocks as fit in that budget
    (an explicit number: the pool never claims "all free memory" by itself).
    """
    by_workload = max_num_seqs is not None or max_model_len is not None
    if by_workload == (memory_bytes is not None):
        raise ValueError("plan_pool takes either max_num_seqs and max_model_len, or memory_bytes, "
                         f"got max_num_seqs={max_num_seqs}, max_model_len={max_model_len}, "
                         f"memory_bytes={memory_bytes}")
    if by_workload:
        if max_num_seqs is None or max_model_len is None:
            raise ValueError("plan_pool needs both max_num_seqs and max_model_len, got "
                             f"max_num_seqs={max_num_seqs}, max_model_len={max_model_len}")
        if max_num_seqs <= 0 or max_model_len <= 0:
            raise ValueError("plan_pool: max_num_seqs and max_model_len must be positive, got "
                             f"max_num_seqs={max_num_seqs}, max_model_len={max_model_len}")
        num_blocks = max_num_seqs * math.ceil(max_model_len / spec.block_size)
    else:
        num_blocks = memory_bytes // spec.bytes_per_block
        if num_blocks <= 0:
            raise ValueError(f"plan_pool: memory_bytes={memory_bytes} holds no block of "
                             f"{spec.bytes_per_block:,} bytes ({spec.block_size} tokens)")
    return KVPoolPlan(num_blocks=num_blocks, block_size=spec.block_size,
                      nbytes=num_blocks * spec.bytes_per_block,
                      bytes_per_token=spec.bytes_per_token,
                      max_tokens=num_blocks * spec.block_size)


# The default KV budget (vLLM's CPU backend likewise reserves a fixed KV space by default): a
# share of the memory free now, capped on the host, where the pool is touched page by page when
# allocated and shares the memory with everything else.
_HOST_KV_FRACTION = 0.25
_HOST_KV_CAP = 2 << 30
_GPU_KV_FRACTION = 0.5


def default_kv_cache_memory(device: torch.device | str) -> int:
    """Bytes for a KV pool when the caller gives no budget: on a GPU half of its free memory; on
    the host a quarter of the available memory, at most 2 GiB."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * _GPU_KV_FRACTION)
    return int(min(_available_host_memory() * _HOST_KV_FRACTION, _HOST_KV_CAP))


def _available_host_memory() -> int:
    """MemAvailable (free plus reclaimable caches) where Linux tells it, else free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class StaticKVCache:
    """K/V rows ``[max_batch, max_len]`` per layer, allocated once and written in place.

    ``k_cache[layer]`` / ``v_cache[layer]`` are ``[max_batch, max_len, n_kv_heads, head_dim]``.
    Each batch row fills from position 0 without gaps; ``lengths[b]`` is how far row b is
    written, and ``reset(b)`` makes the row reusable (its stale values are overwritten later).
    """

    def __init__(self, spec: KVCacheSpec, max_batch: int, max_len: int,
                 device: torch.device | str = "cpu") -> None:
        if max_batch <= 0 or max_len <= 0:
            raise ValueError("StaticKVCache: max_batch and max_len must be positive, got "
                             f"max_batch={max_batch}, max_len={max_len}")
        self.spec = spec
        self.max_batch = max_batch
        self.max_len = max_len
        shape = (spec.num_layers, max_batch, max_len, spec.n_kv_heads, spec.head_dim)
        self.k_cache = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=spec.dtype, device=device)
        self._lengths = [0] * max_batch

    @property
    def nbytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes

    @property
    def lengths(self) -> list[int]:
        """Positions written so far, per batch row (a copy)."""
        return list(self._lengths)

    def _check_row(self, layer: int, batch_index: int) -> None:
        if not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer {layer} is not in [0, {self.spec.num_layers})")
        self._check_batch_index(batch_index)

    def _check_batch_index(self, batch_index: int) -> None:
        if not 0 <= batch_index < self.max_batch:
            raise ValueError(f"batch_index {batch_index} is not in [0, {self.max_batch})")

    def write(self, layer: int, batch_index: int, start: int, k: Tensor, v: Tensor) -> None:
        """Copies ``k, v [n, n_kv_heads, head_dim]`` into positions ``[start, start + n)``,
        rounded to the cache's dtype where it is narrower (:func:`cache_dtype_serves`)."""
        self._check_row(layer, batch_index)
        expected = (self.spec.n_kv_heads, self.spec.head_dim)
        if k.dim() != 3 or k.shape[1:] != expected or v.shape != k.shape:
            raise ValueError(f"k and v must be [n, {expected[0]}, {expected[1]}] alike, got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if v.dtype != k.dtype or not cache_dtype_serves(self.spec.dtype, k.dtype):
            raise TypeError(f"k and v must share a dtype the {self.spec.dtype} cache serves (its "
                            f"own, or float32 for a 16-bit cache), got {k.dtype} and {v.dtype}")
        length = self._lengths[batch_index]
        if not 0 <= start <= length:
            raise ValueError(f"start={start} must be in [0, {length}] (row {batch_index} holds "
                             f"{length} positions; a gap would leave positions unwritten)")
        end = start + k.shape[0]
        if end > self.max_len:
            raise ValueError(f"writing {k.shape[0]} positions at {start} reaches {end}, past "
                             f"max_len={self.max_len}")
        self.k_cache[layer, batch_index, start:end].copy_(k)
        self.v_cache[layer, batch_index, start:end].copy_(v)
        self._lengths[batch_index] = max(length, end)

    def _view(self, cache: Tensor, layer: int, batch_index: int, length: int | None) -> Tensor:
        self._check_row(layer, batch_index)
        written = self._lengths[batch_index]
        if length is None:
            length = written
        if not 0 <= length <= written:
            raise ValueError(f"length={length} must be in [0, {written}], the positions written "
                             f"in row {batch_index}")
        return cache[layer, batch_index, :length]

    def keys(self, layer: int, batch_index: int, length: int | None = None) -> Tensor:
        """View ``[length, n_kv_heads, head_dim]`` of the row's keys (default: all written)."""
        return self._view(self.k_cache, layer, batch_index, length)

    def values(self, layer: int, batch_index: int, length: int | None = None) -> Tensor:
        """View ``[length, n_kv_heads, head_dim]`` of the row's values (default: all written)."""
        return self._view(self.v_cache, layer, batch_index, length)

    def reset(self, batch_index: int) -> None:
        """Marks row ``batch_index`` empty, for a new sequence."""
        self._check_batch_index(batch_index)
        self._lengths[batch_index] = 0


def cache_slots(block_table: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """The cache slots (``block * block_size + offset``) of positions ``[start, end)`` of a
    sequence whose blocks are ``block_table``: plain Python, for the few positions of a step,
    where each tensor op would cost microseconds."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def zeros_pool(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """A zeroed KV pool; on the CPU in transparent huge pages, since paged attention reads its
    blocks scattered (fewer TLB misses than with 4 KiB pages), and on Linux taking memory
    only as its blocks are first written."""
    if torch.device(device).type == "cpu":
        return _C.zeros_huge_pages(list(shape), dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


class PagedKVCache:
    """Paged K/V pools for all layers and the :class:`BlockManager` that hands out their blocks.

    ``k_cache[layer]`` / ``v_cache[layer]`` are the layer's pools
    ``[num_blocks, block_size, n_kv_heads, head_dim]`` (one allocation for all layers).

    ``pre_rope=True`` makes the cache position-independent: it holds keys *before* rotary
    embedding, and attention rotates each key by its position in its sequence as it reads it
    (``paged_attention(..., rotary_cos_sin_cache=...)``), so cached K/V can be placed at any
    offset (:mod:`fastllm.engine.chunked_prompt`). Attention results equal the default
    (post-RoPE) mode's; reading costs a rotation per key.
    """

    def __init__(self, spec: KVCacheSpec, pool: KVPoolPlan | int, *,
                 device: torch.device | str = "cpu", enable_prefix_caching: bool = True,
                 pre_rope: bool = False) -> None:
        """``pool`` is a :func:`plan_pool` result for ``spec`` or a number of blocks."""
        if isinstance(pool, KVPoolPlan):
            if pool.block_size != spec.block_size or pool.bytes_per_token != spec.bytes_per_token:
                raise ValueError(f"the pool plan {pool} was not made for {spec}")
            num_blocks = pool.num_blocks
        else:
            num_blocks = pool
        self.spec = spec
        self.pre_rope = bool(pre_rope)
        self.block_manager = BlockManager(num_blocks, spec.block_size, enable_prefix_caching)
        shape = (spec.num_layers, num_blocks, spec.block_size, spec.n_kv_heads, spec.head_dim)
        self.k_cache = zeros_pool(shape, spec.dtype, device)
        self.v_cache = zeros_pool(shape, spec.dtype, device)

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def nbytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copies each ``(src, dst)`` block on every layer's K and V pools (copy-on-write)."""
        if not copies:
            return
        for src, dst in copies:
            if not (0 <= src < self.num_blocks and 0 <= dst < self.num_blocks):
                raise ValueError(f"block copy {(src, dst)} is outside [0, {self.num_blocks})")
        src, dst = to_device(torch.tensor(list(zip(*copies)), dtype=torch.long),
                             self.k_cache.device)  # [2, copies]: one copy
        self.k_cache[:, dst] = self.k_cache[:, src]
        self.v_cache[:, dst] = self.v_cache[:, src]

    def read_rows(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        """Copies of the K and V rows at ``slots``, all layers:
        ``[num_layers, len(slots), n_kv_heads, head_dim]`` each."""
        rows = (self.spec.num_layers, -1, self.spec.n_kv_heads, self.spec.head_dim)
        return self.k_cache.view(rows)[:, slots], self.v_cache.view(rows)[:, slots]

    def write_rows(self, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Writes K and V rows (as :meth:`read_rows` returns them) at ``slots``, all layers."""
        rows = (self.spec.num_layers, -1, self.spec.n_kv_heads, self.spec.head_dim)
        self.k_cache.view(rows)[:, slots] = k
        self.v_cache.view(rows)[:, slots] = v
