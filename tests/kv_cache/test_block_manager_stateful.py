"""fastllm.BlockManager against a pure-Python model, driven by random operation sequences.

The model is what a caller sees: each live sequence's tokens and how many of them have their KV
computed, and a simulated pool recording whose KV each slot holds. The KV at position p depends
on tokens 0..p, and on whether it was computed causally (tokens appended with cacheable=False
are not), so a slot records that whole prefix and that flag. A slot is written only when the
caller marks its token computed (the forward ran); new blocks start unwritten (None). After
every step, every computed position of every live sequence must read back its own prefix
through the block table: a wrong prefix hit, a hit on a block whose KV was never written or is
not causal, a missed copy-on-write, or a referenced block handed out again would all break that.
Besides, each prefix-cache hit must be a block-aligned prefix that some sequence marked
computed, causally. A tiny vocabulary makes prompts share prefixes often; a small pool makes
eviction and KVCacheFullError common.
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
        self.computed: dict[int, int] = {}  # leading tokens whose KV is written
        self.uncacheable_from: dict[int, float] = {}  # first token appended with cacheable=False
        # pool[block][slot]: (tokens 0..p, causal) of the position-p KV the slot holds, as
        # written; None where nothing was written since the block was handed out.
        self.pool: list[list[tuple[tuple[int, ...], bool] | None]] = [
            [None] * block_size for _ in range(num_blocks)]
        # Block-aligned token prefixes some sequence marked computed with causal KV: the only
        # ones the prefix cache may ever serve.
        self.computed_prefixes: set[tuple[int, ...]] = set()
        self.next_seq_id = 0
        self.prompts: list[list[int]] = [[]]

    def snapshot(self) -> tuple:
        manager = self.manager
        return (manager.stats(),
                {s: (manager.block_table(s), manager.num_tokens(s),
                     manager.num_computed_tokens(s)) for s in self.tokens},
                [manager.ref_count(b) for b in range(manager.num_blocks)])

    def unwrite_kv(self, seq_id: int, start: int) -> None:
        """The slots of the sequence's tokens from ``start`` on, just handed out: unwritten."""
        table, block_size = self.manager.block_table(seq_id), self.manager.block_size
        for position in range(start, len(self.tokens[seq_id])):
            self.pool[table[position // block_size]][position % block_size] = None

    def compute(self, seq_id: int, num_tokens: int) -> None:
        """Does the caller's part of a forward step: writes the KV of the sequence's tokens not
        yet computed below ``num_tokens``, then marks them computed."""
        manager, block_size = self.manager, self.manager.block_size
        tokens, start = self.tokens[seq_id], self.computed[seq_id]
        if num_tokens <= start:  # already computed: nothing changes
            before = self.snapshot()
            manager.mark_computed(seq_id, num_tokens)
            assert self.snapshot() == before
            return
        table, uncacheable_from = manager.block_table(seq_id), self.uncacheable_from[seq_id]
        for position in range(start, num_tokens):
            self.pool[table[position // block_size]][position % block_size] = \
                (tuple(tokens[:position + 1]), position < uncacheable_from)
        manager.mark_computed(seq_id, num_tokens)
        self.computed[seq_id] = num_tokens
        for end in range(block_size, num_tokens + 1, block_size):
            if end <= uncacheable_from:
                self.computed_prefixes.add(tuple(tokens[:end]))

    def new_seq_id(self) -> int:
        self.next_seq_id += 1
        return self.next_seq_id

    @rule(data=st.data(), suffix=st.lists(VOCAB, max_size=6), run=st.booleans())
    def allocate(self, data, suffix, run):
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
        assert self.manager.num_computed_tokens(seq_id) == cached
        block_size, stats = self.manager.block_size, self.manager.stats()
        num_reusable = (len(token_ids) - 1) // block_size if self.manager.enable_prefix_caching \
            and token_ids else 0
        assert stats["hits"] - before[0]["hits"] == cached // block_size
        assert stats["queries"] - before[0]["queries"] == num_reusable
        for end in range(block_size, cached + 1, block_size):
            assert tuple(token_ids[:end]) in self.computed_prefixes, \
                f"hit on {token_ids[:end]}, never marked computed"
        self.tokens[seq_id] = list(token_ids)
        self.computed[seq_id] = cached
        self.uncacheable_from[seq_id] = math.inf
        self.unwrite_kv(seq_id, cached)
        if run:  # the prompt's step right away
            self.compute(seq_id, len(token_ids))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token_ids=st.lists(VOCAB, min_size=1, max_size=6),
          cacheable=st.sampled_from([True, True, True, False]), run=st.booleans())
    def append(self, data, token_ids, cacheable, run):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self.snapshot()
        old_table = self.manager.block_table(seq_id)
        try:
            copies = self.manager.append_tokens(seq_id, token_ids, cacheable=cacheable)
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
        if not cacheable:
            self.uncacheable_from[seq_id] = min(self.uncacheable_from[seq_id], start)
        self.unwrite_kv(seq_id, start)
        if run:  # a decode step: everything the sequence holds
            self.compute(seq_id, len(self.tokens[seq_id]))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def mark_computed(self, data):
        """A step ran over some of the sequence's tokens (a prefill chunk, or all of them)."""
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        num_tokens = len(self.tokens[seq_id])
        count = data.draw(st.one_of(st.just(num_tokens), st.integers(-1, num_tokens + 1)))
        if 0 <= count <= num_tokens:
            self.compute(seq_id, count)
            return
        before = self.snapshot()
        try:
            self.manager.mark_computed(seq_id, count)
            raise AssertionError(f"mark_computed({seq_id}, {count}) of {num_tokens} tokens")
        except ValueError:
            assert self.snapshot() == before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.new_seq_id()
        self.manager.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child] = self.computed[parent]
        self.uncacheable_from[child] = self.uncacheable_from[parent]
        assert self.manager.num_computed_tokens(child) == self.computed[child]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(seq_id)
        del self.tokens[seq_id], self.computed[seq_id], self.uncacheable_from[seq_id]
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
            computed, uncacheable_from = self.computed[seq_id], self.uncacheable_from[seq_id]
            assert manager.num_computed_tokens(seq_id) == computed <= len(tokens)
            for position in range(computed):
                assert self.pool[table[position // block_size]][position % block_size] == \
                    (tuple(tokens[:position + 1]), position < uncacheable_from)
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
        if not self.computed_prefixes:  # nothing computed causally: nothing to cache
            assert stats["cached_blocks"] == stats["hits"] == 0

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
