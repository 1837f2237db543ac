"""fastllm.BlockManager against a pure-Python model, driven by random operation sequences.

The model is what a caller sees: each live sequence's tokens, and a simulated pool recording
whose KV each slot holds. The KV at position p depends on tokens 0..p, so a slot records that
whole prefix. After every step, every position of every live sequence must read back its own
prefix through the block table: a wrong prefix hit, a missed copy-on-write, or a referenced
block handed out again would all break that. A tiny vocabulary makes prompts share
prefixes often; a small pool makes eviction and KVCacheFullError common.
"""

import math
from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import fastllm

VOCAB = st.integers(0, 1)  # two tokens: equal blocks are common
MAX_PROMPT_LEN = 12  # short prompts keep the pool from filling up for good


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 16), block_size=st.sampled_from([1, 2, 3, 4]),
                enable_prefix_caching=st.booleans())
    def create(self, num_blocks, block_size, enable_prefix_caching):
        self.manager = fastllm.BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.tokens: dict[int, list[int]] = {}  # live sequences
        # pool[block][slot]: the tokens 0..p whose position-p KV the slot holds, as written.
        self.pool: list[list[tuple[int, ...] | None]] = [[None] * block_size
                                                         for _ in range(num_blocks)]
        self.next_seq_id = 0
        self.prompts: list[list[int]] = [[]]

    def snapshot(self) -> tuple:
        manager = self.manager
        return (manager.stats(),
                {s: (manager.block_table(s), manager.num_tokens(s)) for s in self.tokens},
                [manager.ref_count(b) for b in range(manager.num_blocks)])

    def write_kv(self, seq_id: int, start: int) -> None:
        """Does the caller's part: writes the KV of the sequence's tokens from ``start`` on."""
        table, block_size = self.manager.block_table(seq_id), self.manager.block_size
        tokens = self.tokens[seq_id]
        for position in range(start, len(tokens)):
            self.pool[table[position // block_size]][position % block_size] = \
                tuple(tokens[:position + 1])

    def new_seq_id(self) -> int:
        self.next_seq_id += 1
        return self.next_seq_id

    @rule(data=st.data(), suffix=st.lists(VOCAB, max_size=6))
    def allocate(self, data, suffix):
        # Mostly a prefix of a recent prompt (simplest draw: the whole newest one), so that
        # prompts share cached blocks.
        earlier = data.draw(st.sampled_from(self.prompts[::-1]))
        dropped = data.draw(st.integers(0, len(earlier)))
        token_ids = (earlier[:len(earlier) - dropped] + suffix)[:MAX_PROMPT_LEN]
        self.prompts.append(token_ids)
        seq_id = self.new_seq_id()
        before = self.snapshot()
        try:
            cached = self.manager.allocate(seq_id, token_ids)
        except fastllm.KVCacheFullError:
            assert self.snapshot() == before
            assert not self.manager.can_allocate(len(token_ids))
            return
        assert cached % self.manager.block_size == 0 and 0 <= cached <= max(len(token_ids) - 1, 0)
        assert self.manager.enable_prefix_caching or cached == 0
        self.tokens[seq_id] = list(token_ids)
        self.write_kv(seq_id, cached)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token_ids=st.lists(VOCAB, min_size=1, max_size=6))
    def append(self, data, token_ids):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self.snapshot()
        old_table = self.manager.block_table(seq_id)
        try:
            copies = self.manager.append_tokens(seq_id, token_ids)
        except fastllm.KVCacheFullError:
            assert self.snapshot() == before
            return
        new_table = self.manager.block_table(seq_id)
        if copies:  # the shared partial last block, moved to a fresh one
            [(src, dst)] = copies
            assert len(self.tokens[seq_id]) % self.manager.block_size != 0
            assert src == old_table[-1] and dst == new_table[len(old_table) - 1]
            self.pool[dst] = list(self.pool[src])
        else:
            assert new_table[:len(old_table)] == old_table
        start = len(self.tokens[seq_id])
        self.tokens[seq_id] += token_ids
        self.write_kv(seq_id, start)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.new_seq_id()
        self.manager.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(seq_id)
        del self.tokens[seq_id]
        before = self.snapshot()
        try:
            self.manager.free(seq_id)
            raise AssertionError(f"sequence {seq_id} freed twice")
        except ValueError:
            assert self.snapshot() == before

    @invariant()
    def every_sequence_reads_its_own_kv(self):
        manager, block_size = self.manager, self.manager.block_size
        content = {}  # block -> tokens it holds, the same for every sequence holding it
        for seq_id, tokens in self.tokens.items():
            table = manager.block_table(seq_id)
            assert manager.num_tokens(seq_id) == len(tokens)
            assert len(table) == math.ceil(len(tokens) / block_size)
            for position in range(len(tokens)):
                assert self.pool[table[position // block_size]][position % block_size] == \
                    tuple(tokens[:position + 1])
            for i, block in enumerate(table):
                held = tuple(tokens[i * block_size:(i + 1) * block_size])
                assert content.setdefault(block, held) == held

    @invariant()
    def ref_counts_match_the_block_tables(self):
        manager = self.manager
        holders = Counter(b for seq_id in self.tokens for b in manager.block_table(seq_id))
        assert [manager.ref_count(b) for b in range(manager.num_blocks)] == \
            [holders[b] for b in range(manager.num_blocks)]
        stats = manager.stats()
        assert stats["referenced_blocks"] == len(holders)
        assert (stats["free_blocks"] + stats["referenced_blocks"] + stats["evictable_blocks"]
                == manager.num_blocks)
        assert manager.num_free_blocks == stats["free_blocks"] + stats["evictable_blocks"]
        assert stats["evictable_blocks"] <= stats["cached_blocks"] <= manager.num_blocks
        assert 0 <= stats["hits"] <= stats["queries"]
        assert manager.usage == len(holders) / manager.num_blocks
        if not manager.enable_prefix_caching:
            assert stats["cached_blocks"] == stats["queries"] == 0

    def teardown(self):
        """Freeing everything leaks nothing: each block ends free or evictable."""
        if not hasattr(self, "manager"):
            return
        for seq_id in list(self.tokens):
            self.manager.free(seq_id)
        stats = self.manager.stats()
        assert stats["referenced_blocks"] == 0
        assert stats["free_blocks"] + stats["evictable_blocks"] == self.manager.num_blocks
        assert stats["evictable_blocks"] == stats["cached_blocks"]
        assert all(self.manager.ref_count(b) == 0 for b in range(self.manager.num_blocks))


BlockManagerMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=40, deadline=None, derandomize=True, database=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase
