"""fastllm.BlockManager: allocation, prefix reuse, LRU eviction, copy-on-write and errors.

A full block enters the prefix cache only once ``mark_computed`` says its KV is written; tests
call it where their scenario has the KV computed (after the prefill or decode step).
"""

import pytest
import torch

import fastllm
from fastllm import BlockManager, KVCacheFullError


def snapshot(manager: BlockManager, seq_ids) -> tuple:
    """Everything observable about a manager, to check that a failed call changed nothing."""
    return (manager.stats(), manager.num_free_blocks,
            {s: (manager.block_table(s), manager.num_tokens(s), manager.num_computed_tokens(s))
             for s in seq_ids},
            [manager.ref_count(b) for b in range(manager.num_blocks)])


def test_construction_and_empty_state():
    manager = BlockManager(8, 4)
    assert (manager.num_blocks, manager.block_size, manager.enable_prefix_caching) == (8, 4, True)
    assert manager.num_free_blocks == 8 and manager.usage == 0.0
    assert manager.stats() == {"hits": 0, "queries": 0, "cached_blocks": 0,
                               "referenced_blocks": 0, "evictable_blocks": 0, "free_blocks": 8}
    assert repr(manager) == ("BlockManager(num_blocks=8, block_size=4, "
                             "enable_prefix_caching=True, num_free_blocks=8)")
    assert not BlockManager(8, 4, enable_prefix_caching=False).enable_prefix_caching


@pytest.mark.parametrize("num_blocks, block_size, match", [
    (0, 4, r"num_blocks must be in \[1, 2\*\*31 - 1\], got 0"),
    (-3, 4, "got -3"),
    (2**31, 4, f"got {2**31}"),
    (8, 0, "block_size must be positive, got 0"),
    (8, -16, "block_size must be positive, got -16"),
])
def test_bad_sizes(num_blocks, block_size, match):
    with pytest.raises(ValueError, match=match):
        BlockManager(num_blocks, block_size)


def test_allocate_takes_ceil_blocks_and_counts_tokens():
    manager = BlockManager(8, 4)
    assert manager.allocate(1, list(range(10))) == 0
    assert manager.block_table(1) == [0, 1, 2] and manager.num_tokens(1) == 10
    assert manager.allocate(2, []) == 0
    assert manager.block_table(2) == [] and manager.num_tokens(2) == 0
    assert manager.allocate(3, [7] * 4) == 0
    assert manager.block_table(3) == [3]
    assert [manager.ref_count(b) for b in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert manager.num_free_blocks == 4 and manager.usage == 0.5


def test_common_prefix_is_reused():
    manager = BlockManager(16, 4)
    prefix = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34]  # 3 full blocks
    assert manager.allocate(1, prefix + [1, 2]) == 0
    manager.mark_computed(1, 14)
    assert manager.stats()["hits"] == 0 and manager.stats()["queries"] == 3
    assert manager.allocate(2, prefix + [5, 6, 7]) == 12
    first, second = manager.block_table(1), manager.block_table(2)
    assert second[:3] == first[:3] and second[3] != first[3]
    assert [manager.ref_count(b) for b in first[:3]] == [2, 2, 2]
    assert manager.ref_count(first[3]) == manager.ref_count(second[3]) == 1
    stats = manager.stats()
    assert (stats["hits"], stats["queries"], stats["cached_blocks"]) == (3, 6, 3)
    assert stats["referenced_blocks"] == 5

    # A shorter shared prefix: the lookup stops at the first block that differs.
    assert manager.allocate(3, prefix[:4] + [0, 0, 0, 0, 9]) == 4
    assert manager.block_table(3)[0] == first[0] and manager.ref_count(first[0]) == 3
    assert manager.stats()["hits"] == 4 and manager.stats()["queries"] == 8


def test_reuse_is_capped_so_one_token_is_computed():
    manager = BlockManager(16, 4)
    prompt = list(range(12))
    manager.allocate(1, prompt)
    manager.mark_computed(1, 12)
    # Entirely cached: the last block is recomputed, so its last token yields logits.
    assert manager.allocate(2, prompt) == 8
    assert manager.block_table(2)[:2] == manager.block_table(1)[:2]
    assert manager.block_table(2)[2] != manager.block_table(1)[2]
    assert manager.stats()["hits"] == 2 and manager.stats()["queries"] == 2 + 2
    assert manager.allocate(3, prompt + [99]) == 12
    assert manager.allocate(4, prompt[:1]) == 0  # 1 token: nothing reusable
    assert manager.allocate(5, prompt[:5]) == 4


def test_equal_lengths_with_different_tokens_never_share():
    manager = BlockManager(32, 4)
    prompts = [
        [1, 2, 3, 4, 5],
        [4, 3, 2, 1, 5],          # same multiset, other order
        [1, 2, 3, 5, 5],
        [2**40 + 1, 2, 3, 4, 5],  # equal to the first in the low 32 bits
        [0, 0, 0, 0, 5],
        [0, 0, 0, 0, 0, 0, 0, 0, 5],
    ]
    for seq_id, prompt in enumerate(prompts):
        assert manager.allocate(seq_id, prompt) == (4 if seq_id == 5 else 0), prompt
        manager.mark_computed(seq_id, len(prompt))
    # The last reuses the previous prompt's [0, 0, 0, 0] block; its second [0, 0, 0, 0] block
    # follows another prefix, so it is new.
    tables = [manager.block_table(s) for s in range(len(prompts))]
    assert tables[5][0] == tables[4][0] and tables[5][1] not in sum(tables[:5], [])
    firsts = [t[0] for t in tables[:5]]
    assert len(set(firsts)) == 5


def test_block_is_identified_by_its_whole_prefix():
    # The same block content after different prefixes is different KV (positions, attention).
    manager = BlockManager(16, 4)
    manager.allocate(1, [1, 1, 1, 1, 5, 5, 5, 5, 9])
    manager.mark_computed(1, 9)
    assert manager.allocate(2, [2, 2, 2, 2, 5, 5, 5, 5, 9]) == 0
    manager.mark_computed(2, 9)
    assert set(manager.block_table(1)).isdisjoint(manager.block_table(2))
    assert manager.stats()["cached_blocks"] == 4


def test_prefix_caching_disabled():
    manager = BlockManager(8, 4, enable_prefix_caching=False)
    manager.allocate(1, list(range(9)))
    manager.mark_computed(1, 9)
    assert manager.allocate(2, list(range(9))) == 0
    assert set(manager.block_table(1)).isdisjoint(manager.block_table(2))
    manager.append_tokens(2, [1, 2, 3])
    manager.mark_computed(2, 12)
    assert manager.num_computed_tokens(2) == 12  # counted, though nothing is cached
    manager.free(1)
    manager.free(2)
    assert manager.stats() == {"hits": 0, "queries": 0, "cached_blocks": 0,
                               "referenced_blocks": 0, "evictable_blocks": 0, "free_blocks": 8}


def test_free_keeps_full_blocks_cached_and_frees_the_rest():
    manager = BlockManager(8, 4)
    prompt = list(range(10))  # 2 full blocks and a partial one
    manager.allocate(1, prompt)
    manager.mark_computed(1, 10)
    manager.free(1)
    assert [manager.ref_count(b) for b in range(8)] == [0] * 8
    assert manager.stats() == {"hits": 0, "queries": 2, "cached_blocks": 2,
                               "referenced_blocks": 0, "evictable_blocks": 2, "free_blocks": 6}
    assert manager.num_free_blocks == 8 and manager.usage == 0.0
    # The evictable blocks are reused by the same prompt.
    assert manager.allocate(2, prompt) == 8
    assert manager.block_table(2)[:2] == [0, 1]
    assert manager.stats()["evictable_blocks"] == 0 and manager.stats()["hits"] == 2


def test_reset_prefix_cache_drops_what_no_sequence_holds():
    manager = BlockManager(8, 4)
    held, dropped = list(range(10)), list(range(100, 110))
    for seq_id, prompt in ((1, held), (2, dropped)):
        manager.allocate(seq_id, prompt)
        manager.mark_computed(seq_id, 10)
    manager.free(2)
    assert manager.reset_prefix_cache() == 2  # sequence 2's two full blocks
    assert manager.stats()["cached_blocks"] == 2 and manager.stats()["evictable_blocks"] == 0
    assert manager.allocate(3, dropped) == 0  # forgotten
    assert manager.allocate(4, held) == 8  # sequence 1 still holds its blocks, cached
    assert manager.reset_prefix_cache() == 0


@pytest.mark.parametrize("salt", [-1, 2**63 - 1])
def test_a_bad_cache_salt_is_refused(salt):
    with pytest.raises(ValueError, match="cache_salt"):
        BlockManager(8, 4).allocate(1, [1, 2, 3], cache_salt=salt)


def test_cache_salts_keep_prefixes_apart():
    manager = BlockManager(16, 4)
    prompt = list(range(10))
    manager.allocate(1, prompt, cache_salt=7)
    manager.mark_computed(1, 10)
    assert manager.allocate(2, prompt) == 0
    assert manager.allocate(3, prompt, cache_salt=8) == 0
    assert manager.allocate(4, prompt, cache_salt=7) == 8


def test_blocks_filled_by_append_enter_the_prefix_cache():
    manager = BlockManager(8, 4)
    manager.allocate(1, [1, 2, 3])
    manager.mark_computed(1, 3)
    assert manager.stats()["cached_blocks"] == 0
    assert manager.append_tokens(1, [4]) == []
    assert manager.stats()["cached_blocks"] == 0  # full, but its last token's KV is not written
    manager.mark_computed(1, 4)
    assert manager.stats()["cached_blocks"] == 1
    manager.append_tokens(1, [5, 6, 7, 8, 9])  # fills a second block, starts a third
    assert manager.block_table(1) == [0, 1, 2] and manager.num_tokens(1) == 9
    manager.mark_computed(1, 9)
    assert manager.stats()["cached_blocks"] == 2
    assert manager.allocate(2, [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    assert manager.block_table(2)[:2] == [0, 1]
    assert manager.append_tokens(1, []) == [] and manager.num_tokens(1) == 9


def test_uncacheable_append_ends_the_cached_chain():
    # Independent chunks: their KV is not a causal prefill's, so from the first uncacheable
    # append on, no block of the sequence enters the prefix cache, not even the partial one the
    # append completes, nor blocks filled by later (cacheable) appends.
    manager = BlockManager(16, 4)
    manager.allocate(1, [1, 2, 3, 4, 5, 6])
    manager.mark_computed(1, 6)  # one full block cached, 2 tokens in the tail
    assert manager.stats()["cached_blocks"] == 1
    manager.append_tokens(1, [7, 8, 9, 10, 11], cacheable=False)  # completes block 2, fills 3
    manager.mark_computed(1, 11)
    manager.append_tokens(1, [12, 13, 14, 15, 16])
    manager.mark_computed(1, 16)
    assert manager.stats()["cached_blocks"] == 1
    assert manager.num_computed_tokens(1) == 16
    assert manager.allocate(2, list(range(1, 18))) == 4  # only the causal first block
    # The uncacheable sequence's blocks are freed, not kept as evictable cache.
    manager.free(1)
    assert manager.stats()["evictable_blocks"] == 0
    # The flag is per append: a fresh sequence caches normally.
    manager.append_tokens(2, [0, 0, 0])
    manager.mark_computed(2, 20)
    assert manager.stats()["cached_blocks"] == 5


def test_a_prefix_computed_twice_is_cached_once_and_chained_through():
    # Two sequences fill the same blocks before either is cached: the second's copies stay
    # uncached, and its later blocks chain onto the cached copies' prefix.
    manager = BlockManager(16, 2)
    manager.allocate(1, [1])
    manager.allocate(2, [1])
    for seq_id in (1, 2):
        manager.append_tokens(seq_id, [2, 3, 4])
    assert manager.stats()["cached_blocks"] == 0
    for seq_id in (1, 2):
        manager.mark_computed(seq_id, 4)
    assert manager.stats()["cached_blocks"] == 2  # seq 1's two blocks
    manager.append_tokens(2, [5, 6])
    manager.mark_computed(2, 6)
    assert manager.stats()["cached_blocks"] == 3  # seq 2's third block, after the same prefix
    assert manager.allocate(3, [1, 2, 3, 4, 5, 6, 7]) == 6
    table = manager.block_table(3)
    assert table[:2] == manager.block_table(1)[:2] and table[2] == manager.block_table(2)[2]
    manager.free(1)
    manager.free(2)
    manager.free(3)
    stats = manager.stats()
    assert stats["evictable_blocks"] == stats["cached_blocks"] == 3
    assert stats["free_blocks"] == 13


def test_blocks_not_marked_computed_are_never_hits():
    # Chunked prefill: the second chunk's blocks are allocated before its forward runs, and the
    # step fails. Another sequence with the same prompt must not reuse KV that was never written.
    manager = BlockManager(8, 4)
    prompt = list(range(17))
    assert manager.allocate(1, prompt[:8]) == 0
    assert manager.stats()["cached_blocks"] == 0  # allocated, not computed
    manager.mark_computed(1, 8)  # the first chunk ran
    manager.append_tokens(1, prompt[8:16])  # the second chunk, never run
    assert manager.stats()["cached_blocks"] == 2
    assert manager.allocate(2, prompt) == 8  # only the computed chunk's blocks
    assert manager.block_table(2)[:2] == manager.block_table(1)[:2]
    assert set(manager.block_table(2)[2:]).isdisjoint(manager.block_table(1))
    assert manager.num_computed_tokens(2) == 8
    assert (manager.stats()["hits"], manager.stats()["queries"]) == (2, 1 + 4)
    manager.free(2)
    manager.free(1)  # the failed step: its uncomputed blocks go back to the free list
    assert manager.stats() == {"hits": 2, "queries": 5, "cached_blocks": 2,
                               "referenced_blocks": 0, "evictable_blocks": 2, "free_blocks": 6}
    assert manager.allocate(3, prompt) == 8


def test_free_without_mark_computed_frees_every_block():
    manager = BlockManager(8, 4)
    prompt = list(range(10))  # 2 full blocks and a partial one
    manager.allocate(1, prompt)
    assert manager.allocate(2, prompt) == 0  # seq 1's KV is not written yet
    assert set(manager.block_table(1)).isdisjoint(manager.block_table(2))
    manager.free(1)
    manager.free(2)
    assert manager.stats() == {"hits": 0, "queries": 4, "cached_blocks": 0,
                               "referenced_blocks": 0, "evictable_blocks": 0, "free_blocks": 8}
    assert manager.allocate(3, prompt) == 0
    assert manager.stats()["hits"] == 0


def test_partial_mark_computed_caches_only_the_full_blocks_below_the_count():
    manager = BlockManager(16, 4)
    prompt = list(range(12))
    manager.allocate(1, prompt)
    manager.mark_computed(1, 3)  # inside block 0
    assert manager.stats()["cached_blocks"] == 0 and manager.num_computed_tokens(1) == 3
    manager.mark_computed(1, 7)  # block 0 full, block 1 not
    assert manager.stats()["cached_blocks"] == 1 and manager.num_computed_tokens(1) == 7
    assert manager.allocate(2, prompt) == 4
    manager.mark_computed(1, 8)  # exactly at the end of block 1
    assert manager.stats()["cached_blocks"] == 2
    assert manager.allocate(3, prompt) == 8
    manager.mark_computed(1, 12)
    assert manager.stats()["cached_blocks"] == 3
    assert manager.allocate(4, prompt + [0]) == 12
    table = manager.block_table(1)
    assert manager.block_table(2)[0] == manager.block_table(3)[0] == table[0]
    assert manager.block_table(3)[1] == table[1] and manager.block_table(4)[:3] == table


def test_num_computed_tokens():
    manager = BlockManager(16, 4)
    prompt = list(range(10))
    assert manager.allocate(1, prompt) == 0
    assert manager.num_computed_tokens(1) == 0
    manager.mark_computed(1, 10)
    assert manager.num_computed_tokens(1) == 10
    manager.append_tokens(1, [5, 6])  # a decode step's tokens: not computed until marked
    assert (manager.num_tokens(1), manager.num_computed_tokens(1)) == (12, 10)
    manager.mark_computed(1, 12)
    assert manager.num_computed_tokens(1) == 12
    # Prefix-cache hits count as computed.
    assert manager.allocate(2, prompt + [7, 7, 7]) == 8
    assert manager.num_computed_tokens(2) == 8
    assert manager.allocate(3, []) == 0 and manager.num_computed_tokens(3) == 0
    manager.mark_computed(3, 0)
    assert manager.num_computed_tokens(3) == 0
    # A fork starts where its parent is.
    manager.fork(2, 4)
    assert manager.num_computed_tokens(4) == 8
    manager.mark_computed(4, 13)
    assert (manager.num_computed_tokens(4), manager.num_computed_tokens(2)) == (13, 8)


@pytest.mark.parametrize("num_tokens", [11, 100, -1, -10])
def test_mark_computed_out_of_range(num_tokens):
    manager = BlockManager(8, 4)
    manager.allocate(1, list(range(10)))
    manager.mark_computed(1, 4)
    before = snapshot(manager, [1])
    with pytest.raises(ValueError, match=rf"mark_computed\(seq_id=1\): num_tokens={num_tokens} "
                                         r"is not in \[0, 10\]"):
        manager.mark_computed(1, num_tokens)
    assert snapshot(manager, [1]) == before
    manager.mark_computed(1, 10)  # the bounds themselves are fine
    assert manager.num_computed_tokens(1) == 10


def test_mark_computed_below_the_current_count_is_a_no_op():
    manager = BlockManager(8, 4)
    prompt = list(range(10))
    manager.allocate(1, prompt)
    manager.mark_computed(1, 8)
    before = snapshot(manager, [1])
    for num_tokens in (8, 5, 4, 0):
        manager.mark_computed(1, num_tokens)
        assert snapshot(manager, [1]) == before
    assert manager.num_computed_tokens(1) == 8
    # A hit sequence starts computed through its hits; lower counts do not take them back.
    assert manager.allocate(2, prompt) == 8
    manager.mark_computed(2, 3)
    assert manager.num_computed_tokens(2) == 8
    assert manager.stats()["cached_blocks"] == 2


@pytest.mark.parametrize("prompt_len", [6, 8])  # the uncacheable append: mid-block, on a boundary
def test_uncacheable_append_then_mark_computed(prompt_len):
    # Marked only after the uncacheable append: the blocks wholly before its first token are
    # cached, the block holding that token and every later one are not.
    manager = BlockManager(16, 4)
    prompt = list(range(1, prompt_len + 1))
    chunk = [50, 51, 52, 53, 54, 55]
    manager.allocate(1, prompt)
    manager.append_tokens(1, chunk, cacheable=False)
    manager.append_tokens(1, [60, 61, 62, 63])
    manager.mark_computed(1, manager.num_tokens(1))
    num_before = prompt_len // 4  # blocks wholly before the uncacheable tokens
    assert manager.stats()["cached_blocks"] == num_before
    assert manager.allocate(2, prompt + chunk + [60, 61, 62, 63, 0]) == 4 * num_before
    manager.free(1)
    assert manager.stats()["evictable_blocks"] == 0  # only its cached blocks, held by seq 2


def test_fork_child_marking_blocks_the_parent_cached_keeps_the_chain():
    manager = BlockManager(16, 4)
    prompt = list(range(10))
    manager.allocate(1, prompt)
    manager.fork(1, 2)  # before the prompt's step ran
    manager.mark_computed(1, 10)  # the parent caches blocks 0 and 1, shared with the child
    assert manager.stats()["cached_blocks"] == 2
    # The child writes its own tokens (copy-on-write of the partial block), then marks its whole
    # sequence: its first two blocks are the parent's cached ones, and its chain goes through them.
    assert manager.append_tokens(2, [20, 21, 22, 23, 24, 25]) != []
    manager.mark_computed(2, 16)
    assert manager.stats()["cached_blocks"] == 4
    longer = prompt + [20, 21, 22, 23, 24, 25, 30]
    assert manager.allocate(3, longer) == 16
    assert manager.block_table(3)[:4] == manager.block_table(2)
    # The other order: the child marks the shared blocks first, then the parent, whose chain
    # goes through them just as well.
    manager = BlockManager(16, 4)
    manager.allocate(1, prompt)
    manager.fork(1, 2)
    manager.mark_computed(2, 10)
    manager.mark_computed(1, 10)
    assert manager.stats()["cached_blocks"] == 2
    manager.append_tokens(1, [40, 41, 42, 43, 44, 45])
    manager.mark_computed(1, 16)
    assert manager.stats()["cached_blocks"] == 4
    assert manager.allocate(3, prompt + [40, 41, 42, 43, 44, 45, 0]) == 16
    assert manager.block_table(3)[:4] == manager.block_table(1)


def test_fork_of_a_computed_parent_caches_the_childs_new_blocks():
    manager = BlockManager(16, 4)
    prompt = list(range(10))
    manager.allocate(1, prompt)
    manager.mark_computed(1, 10)
    manager.fork(1, 2)
    assert manager.num_computed_tokens(2) == 10
    manager.append_tokens(2, [20, 21, 22, 23, 24, 25])
    manager.mark_computed(2, 16)
    assert manager.stats()["cached_blocks"] == 4
    assert manager.allocate(3, prompt + [20, 21, 22, 23, 24, 25, 0]) == 16


def test_fork_child_recaching_a_shared_block_leaks_no_index_entry():
    """The parent cached block 1 after another copy of its prefix (block 3), since evicted; the
    child re-keys block 1 under its own copy (block 0) instead of indexing it twice, and a new
    prompt then reaches block 1 through block 0."""
    manager = BlockManager(5, 2)
    manager.allocate(1, [1, 1, 2, 2, 3])  # blocks 0, 1, 2
    manager.allocate(2, [1, 1, 9])  # blocks 3, 4
    manager.mark_computed(2, 3)  # block 3 cached: [1, 1]
    manager.fork(1, 3)  # shares blocks 0, 1, 2
    manager.mark_computed(1, 5)  # block 0 chains through block 3, block 1 is cached after it
    assert manager.stats()["cached_blocks"] == 2
    manager.free(2)
    manager.allocate(4, [7, 7, 7, 7])  # evicts block 3
    assert manager.block_table(4) == [4, 3] and manager.stats()["cached_blocks"] == 1
    manager.mark_computed(3, 5)  # caches block 0; block 1 is cached already
    assert manager.stats()["cached_blocks"] == 2
    for seq_id in (1, 3, 4):
        manager.free(seq_id)
    stats = manager.stats()
    assert stats["evictable_blocks"] == stats["cached_blocks"] == 2
    assert manager.allocate(5, [1, 1, 2, 2, 5]) == 4
    assert manager.block_table(5)[:2] == [0, 1]


def test_lru_eviction_order():
    manager = BlockManager(6, 2)
    manager.allocate(1, [1, 1, 2, 2])  # blocks 0, 1
    manager.allocate(2, [3, 3, 4, 4])  # blocks 2, 3
    manager.mark_computed(1, 4)
    manager.mark_computed(2, 4)
    manager.free(2)  # evictable, least recently used first: 3, 2 (a sequence's last block first)
    manager.free(1)  # then 1, 0
    assert manager.stats()["evictable_blocks"] == 4 and manager.stats()["free_blocks"] == 2
    # 4 new blocks: the free list (4, 5) first, then evict 3 ([3, 3, 4, 4]) and 2 ([3, 3]).
    assert manager.allocate(3, [5, 5, 6, 6, 7, 7, 8, 8]) == 0
    assert manager.block_table(3) == [4, 5, 3, 2]
    manager.mark_computed(3, 8)
    stats = manager.stats()
    assert stats["evictable_blocks"] == 2 and stats["cached_blocks"] == 2 + 4
    manager.free(3)  # evictable: 1, 0, then 2, 3, 5, 4
    assert manager.allocate(4, [1, 1, 2, 2, 0]) == 4  # still cached; evicts 2 ([.., 8, 8])
    assert manager.block_table(4) == [0, 1, 2]
    assert manager.allocate(5, [3, 3, 4, 4, 0]) == 0  # evicted earlier: computed again
    assert manager.block_table(5) == [3, 5, 4]
    assert manager.num_free_blocks == 0


def test_reuse_makes_a_block_recently_used():
    manager = BlockManager(4, 2)
    manager.allocate(1, [1, 1, 2])  # blocks 0 (full, cached) and 1
    manager.allocate(2, [3, 3, 4])  # blocks 2 (full, cached) and 3
    manager.mark_computed(1, 3)
    manager.mark_computed(2, 3)
    manager.free(1)
    manager.free(2)  # evictable: 0, then 2; partial blocks 1 and 3 on the free list
    assert manager.stats()["evictable_blocks"] == 2 and manager.stats()["free_blocks"] == 2
    assert manager.allocate(3, [1, 1, 5]) == 2  # reuses 0
    manager.mark_computed(3, 3)
    manager.free(3)  # evictable: 2, then 0
    assert manager.allocate(4, [7, 7, 8, 8, 9, 9]) == 0
    assert manager.block_table(4) == [3, 1, 2]  # the free list, then the older block 2
    manager.mark_computed(4, 6)
    manager.free(4)
    assert manager.allocate(5, [1, 1, 0]) == 2 and manager.block_table(5)[0] == 0


def test_hits_are_claimed_before_eviction():
    # The only evictable blocks are this prompt's hits and one more: the new block must evict
    # that one, never a hit.
    manager = BlockManager(3, 2)
    manager.allocate(1, [1, 1, 2, 2, 3, 3])
    manager.mark_computed(1, 6)
    manager.free(1)  # evictable: 2, 1, 0
    assert manager.allocate(2, [1, 1, 2, 2, 9]) == 4
    assert manager.block_table(2) == [0, 1, 2]
    assert [manager.ref_count(b) for b in range(3)] == [1, 1, 1]
    assert manager.stats()["cached_blocks"] == 2


def test_fork_shares_every_block():
    manager = BlockManager(8, 4)
    manager.allocate(1, list(range(6)))
    manager.fork(1, 2)
    assert manager.block_table(2) == manager.block_table(1) == [0, 1]
    assert manager.num_tokens(2) == 6
    assert [manager.ref_count(b) for b in (0, 1)] == [2, 2]
    assert manager.num_free_blocks == 6  # forking takes no block
    manager.free(1)
    assert [manager.ref_count(b) for b in (0, 1)] == [1, 1]
    assert manager.block_table(2) == [0, 1]


def test_copy_on_write_of_a_shared_partial_block():
    manager = BlockManager(8, 4)
    manager.allocate(1, [1, 2, 3, 4, 5, 6])  # blocks 0 (full) and 1 (2 of 4 tokens)
    manager.fork(1, 2)
    assert manager.append_tokens(2, [7]) == [(1, 2)]  # copy block 1 into a fresh block 2
    assert manager.block_table(2) == [0, 2] and manager.block_table(1) == [0, 1]
    assert [manager.ref_count(b) for b in (0, 1, 2)] == [2, 1, 1]
    # Both now own their partial blocks: no more copies.
    assert manager.append_tokens(1, [8]) == []
    assert manager.append_tokens(2, [9, 10, 11]) == []
    assert manager.block_table(1) == [0, 1] and manager.block_table(2) == [0, 2, 3]
    assert (manager.num_tokens(1), manager.num_tokens(2)) == (7, 10)


def test_copy_on_write_also_takes_the_following_blocks():
    manager = BlockManager(8, 4)
    manager.allocate(1, [1, 2, 3])
    manager.fork(1, 2)
    manager.fork(1, 3)
    assert manager.ref_count(0) == 3
    assert manager.append_tokens(3, [4, 5, 6, 7, 8, 9]) == [(0, 1)]
    assert manager.block_table(3) == [1, 2, 3] and manager.ref_count(0) == 2


def test_no_copy_when_the_shared_last_block_is_full():
    manager = BlockManager(8, 4)
    manager.allocate(1, [1, 2, 3, 4])
    manager.fork(1, 2)
    assert manager.append_tokens(2, [5]) == []
    assert manager.block_table(2) == [0, 1] and manager.block_table(1) == [0]
    assert manager.ref_count(0) == 2


def test_full_allocate_changes_nothing():
    manager = BlockManager(4, 4)
    manager.allocate(1, list(range(12)))
    before = snapshot(manager, [1])
    assert not manager.can_allocate(8) and manager.can_allocate(4)
    with pytest.raises(KVCacheFullError,
                       match=r"allocate\(seq_id=2\) needs 2 new blocks but only 1 are free "
                             r"\(1 on the free list, 0 evictable cached, of 4\)"):
        manager.allocate(2, [50] * 8)
    assert snapshot(manager, [1]) == before
    with pytest.raises(ValueError, match="unknown sequence 2"):
        manager.block_table(2)
    assert manager.allocate(2, [50] * 4) == 0  # what fits still fits


def test_full_allocate_with_hits_changes_nothing():
    # The hits are evictable blocks: they cannot also serve as new blocks, and a failed call must
    # neither claim them nor count them.
    manager = BlockManager(3, 2)
    manager.allocate(1, [1, 1, 2, 2, 3])
    manager.mark_computed(1, 5)
    manager.free(1)  # 2 cached blocks evictable, 1 free
    before = snapshot(manager, [])
    with pytest.raises(KVCacheFullError, match="needs 2 new blocks but only 1 are free"):
        manager.allocate(2, [1, 1, 2, 2, 3, 3, 4])
    assert snapshot(manager, []) == before
    assert manager.allocate(2, [1, 1, 2, 2, 5]) == 4


def test_full_append_changes_nothing():
    manager = BlockManager(4, 4)
    manager.allocate(1, list(range(12)))
    before = snapshot(manager, [1])
    with pytest.raises(KVCacheFullError, match=r"append_tokens\(seq_id=1\) needs 2 new blocks "
                                               r"but only 1 are free"):
        manager.append_tokens(1, [0] * 5)
    assert snapshot(manager, [1]) == before
    assert manager.append_tokens(1, [0] * 4) == [] and manager.num_tokens(1) == 16


def test_full_copy_on_write_changes_nothing():
    manager = BlockManager(2, 4)
    manager.allocate(1, [1, 2, 3, 4, 5, 6])
    manager.fork(1, 2)
    before = snapshot(manager, [1, 2])
    with pytest.raises(KVCacheFullError, match=r"append_tokens\(seq_id=2\) needs 1 new blocks "
                                               r"but only 0 are free"):
        manager.append_tokens(2, [7])
    assert snapshot(manager, [1, 2]) == before


def test_kv_cache_full_error_is_a_runtime_error():
    assert issubclass(KVCacheFullError, RuntimeError)
    assert fastllm.KVCacheFullError is fastllm.kv_cache.KVCacheFullError
    assert "left exactly as it was" in KVCacheFullError.__doc__


def test_unknown_and_duplicate_sequences():
    manager = BlockManager(8, 4)
    manager.allocate(1, [1, 2])
    with pytest.raises(ValueError, match="allocate: sequence 1 already exists"):
        manager.allocate(1, [3])
    with pytest.raises(ValueError, match="fork: sequence 1 already exists"):
        manager.fork(1, 1)
    for call, name in [(lambda: manager.append_tokens(7, [1]), "append_tokens"),
                       (lambda: manager.fork(7, 8), "fork"),
                       (lambda: manager.free(7), "free"),
                       (lambda: manager.block_table(7), "block_table"),
                       (lambda: manager.block_tables([1, 7]), "block_tables"),
                       (lambda: manager.num_tokens(7), "num_tokens"),
                       (lambda: manager.mark_computed(7, 0), "mark_computed"),
                       (lambda: manager.num_computed_tokens(7), "num_computed_tokens")]:
        with pytest.raises(ValueError, match=f"BlockManager.{name}: unknown sequence 7"):
            call()
    manager.free(1)
    with pytest.raises(ValueError, match="free: unknown sequence 1"):
        manager.free(1)  # no double free
    assert manager.num_free_blocks == 8 and manager.stats()["free_blocks"] == 8


def test_negative_tokens_and_bad_arguments():
    manager = BlockManager(8, 4)
    with pytest.raises(ValueError, match=r"allocate\(seq_id=3\): token_ids\[2\] = -5 is negative"):
        manager.allocate(3, [1, 2, -5])
    manager.allocate(1, [1, 2])
    before = snapshot(manager, [1])
    with pytest.raises(ValueError, match=r"append_tokens\(seq_id=1\): token_ids\[0\] = -1"):
        manager.append_tokens(1, [-1])
    assert snapshot(manager, [1]) == before
    with pytest.raises(ValueError, match=r"ref_count: block 8 is not in \[0, 8\)"):
        manager.ref_count(8)
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -1"):
        manager.can_allocate(-1)


def test_block_tables_are_zero_padded_int32():
    manager = BlockManager(8, 2)
    manager.allocate(1, [1, 2, 3, 4, 5])  # blocks 0, 1, 2
    manager.allocate(2, [6])  # block 3
    manager.allocate(3, [])
    tables = manager.block_tables([2, 1, 3, 2])
    assert tables.dtype == torch.int32 and tables.device.type == "cpu"
    assert tables.tolist() == [[3, 0, 0], [0, 1, 2], [0, 0, 0], [3, 0, 0]]
    assert manager.block_tables([]).shape == (0, 0)
    assert manager.block_tables([3]).shape == (1, 0)


def test_can_allocate_and_usage():
    manager = BlockManager(4, 4)
    assert manager.can_allocate(16) and not manager.can_allocate(17) and manager.can_allocate(0)
    manager.allocate(1, list(range(8)))
    assert manager.usage == 0.5 and manager.can_allocate(8) and not manager.can_allocate(9)
    manager.free(1)  # cached blocks are evictable: they count as free
    assert manager.usage == 0.0 and manager.can_allocate(16)
