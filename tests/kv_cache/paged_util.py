"""Helpers shared by the paged-KV op tests: random paged pools with shuffled block tables and NaN
in every slot no sequence owns, and the tolerance rules of tests/ops/test_attention.py."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from conftest import num_threads

F32_TOL = 2e-5  # float32 kernel vs the float64 reference, atol and rtol
SOFTCAPS = [0.0, 5.0]  # logit soft-cap: off, and a cap that bends the scores (test_attention.py)

# Block table entries past a sequence's blocks are never read: fill them with ids that would
# crash (out of range) or poison (a NaN block of the pool) any kernel that did.
INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)


def i32(*values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


def cu_seqlens(lengths, device="cpu"):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def blocks_needed(length: int, block_size: int) -> int:
    return -(-length // block_size)


def slots(table_row: list[int], positions, block_size: int) -> list[int]:
    """Cache slots of a sequence's key positions under its block table row."""
    return [table_row[p // block_size] * block_size + p % block_size for p in positions]


@dataclass
class PagedCase:
    """One paged_attention call plus the packed K/V its pool holds."""
    q: Tensor  # [total_q, n_heads, head_dim]
    k_cache: Tensor  # [num_blocks, block_size, n_kv_heads, head_dim], NaN where unowned
    v_cache: Tensor
    block_tables: Tensor  # int32 [batch, max_blocks], junk past each sequence's blocks
    seq_lens: Tensor  # int32 [batch]
    cu_seqlens_q: Tensor  # int32 [batch + 1]
    max_seqlen_q: int
    k: Tensor  # the packed keys [sum(seq_lens), n_kv_heads, head_dim] k_cache holds (its dtype)
    v: Tensor

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.cu_seqlens_q, self.max_seqlen_q)


def random_block_tables(seq_lens, block_size, *, extra_blocks=3, extra_columns=2):
    """Block table rows (lists) with each sequence's blocks drawn from a shuffled pool of
    ``sum(blocks needed) + extra_blocks`` blocks, and junk in the columns past them.

    Returns (rows, num_blocks)."""
    needed = [blocks_needed(n, block_size) for n in seq_lens]
    num_blocks = sum(needed) + extra_blocks
    ids = torch.randperm(num_blocks).tolist()  # owned blocks scattered among the unowned ones
    unowned = ids[sum(needed):]
    junk = [-1, INT32_MAX, INT32_MIN, *unowned]
    width = max(needed, default=0) + extra_columns
    rows, taken = [], 0
    for n in needed:
        row = ids[taken:taken + n]
        taken += n
        row += [junk[int(i)] for i in torch.randint(0, len(junk), (width - n,))]
        rows.append(row)
    return rows, num_blocks


def make_case(lens_q, seq_lens, n_heads, n_kv_heads, head_dim, block_size, *,
              dtype=torch.float32, cache_dtype=None, device="cpu", extra_blocks=3,
              extra_columns=2) -> PagedCase:
    """Random q and a NaN-filled pool whose owned slots hold random K/V rows; the last block of
    a sequence is partial unless its length is a multiple of block_size. The pool is in
    ``cache_dtype`` (default: q's ``dtype``), its rows random values of ``dtype`` rounded."""
    # Small ops: on one thread they do not wait on descheduled workers when cores are shared.
    with num_threads(1):
        return _make_case(lens_q, seq_lens, n_heads, n_kv_heads, head_dim, block_size, dtype,
                          cache_dtype or dtype, device, extra_blocks, extra_columns)


def _make_case(lens_q, seq_lens, n_heads, n_kv_heads, head_dim, block_size, dtype, cache_dtype,
               device, extra_blocks, extra_columns):
    rows, num_blocks = random_block_tables(seq_lens, block_size, extra_blocks=extra_blocks,
                                           extra_columns=extra_columns)
    q = torch.randn(sum(lens_q), n_heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(sum(seq_lens), n_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    k, v = k.to(cache_dtype), v.to(cache_dtype)
    shape = (num_blocks, block_size, n_kv_heads, head_dim)
    k_cache = torch.full(shape, math.nan, dtype=cache_dtype, device=device)
    v_cache = torch.full(shape, math.nan, dtype=cache_dtype, device=device)
    owned = torch.tensor([s for row, n in zip(rows, seq_lens) for s in slots(row, range(n),
                                                                                block_size)],
                         dtype=torch.long, device=device)
    k_cache.view(-1, n_kv_heads, head_dim)[owned] = k
    v_cache.view(-1, n_kv_heads, head_dim)[owned] = v
    width = max((len(r) for r in rows), default=extra_columns)
    tables = torch.tensor(rows, dtype=torch.int32, device=device).view(len(rows), width)
    return PagedCase(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32,
                                                                device=device),
                     cu_seqlens(lens_q, device), max(lens_q, default=0), k, v)


