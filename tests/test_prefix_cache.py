"""Chapter 5: the prefix cache — chained block hashes, shared hits, LRU eviction of free cached blocks.

Unit tests of the hash, the allocator and the block manager, then a hypothesis state machine that runs over
10,000 random admissions (with cache hits), prefill chunks, decodes (with copy on write), forks, frees and
preemptions (re-admitted through the cache) on small pools, where cached blocks are evicted all the time. Each
slot holds a stand-in for its K/V: the tokens up to its position (what K/V depend on). After every operation
every sequence must read back the K/V of its own tokens, which fails if a hit handed out the wrong block or a
shared block was written; no block may leak, and a block is never handed out while referenced (the allocator
asserts it).
"""

import numpy as np
import pytest
from helpers import run_counted_state_machine
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpt2_core import GPT2Config
from gpt2_core.ch04_paged.block_manager import blocks_needed
from gpt2_core.errors import CacheCapacityError, InvalidInputError
from gpt2_core.ch05_sharing.prefix_cache import (ROOT_HASH, PrefixCachingAllocator, PrefixCachingBlockManager,
                                    PrefixCachingKVStore, block_hashes, hash_block)

# ----------------------------------------------------------------------------------------------------------------
# The block hash


def test_a_block_hash_depends_on_its_tokens_and_on_every_block_before_it():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # full blocks only: the ninth token is in a partial block
    assert a == [hash_block(ROOT_HASH, [1, 2, 3, 4]), hash_block(a[0], [5, 6, 7, 8])]
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == a  # the same prefix, the same hashes
    b = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert b[0] != a[0] and b[1] != a[1]  # one token of block 0 differs: every later block differs too
    c = block_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)
    assert c[0] == a[0] and c[1] != a[1]
    assert block_hashes(np.array([1, 2, 3, 4]), 4) == block_hashes([1, 2, 3, 4], 4)  # NumPy ids hash alike
    assert block_hashes([1, 2, 3], 4) == []


# ----------------------------------------------------------------------------------------------------------------
# The allocator


def test_free_blocks_without_a_hash_are_reused_first_then_cached_ones_least_recently_freed_first():
    a = PrefixCachingAllocator(4)
    b = [a.allocate() for _ in range(4)]
    a.register(b[0], 100, [0])
    a.register(b[1], 101, [1])
    for block in (b[1], b[0], b[2], b[3]):  # b1 freed before b0: it is the least recently used of the two
        a.free(block)
    assert list(a.free_list)[:2] == [b[3], b[2]]  # the two holding nothing, at the front
    assert [a.allocate(), a.allocate()] == [b[3], b[2]] and a.num_evictions == 0
    assert a.lookup(101, [1]) == b[1] and a.lookup(100, [0]) == b[0]  # still findable while free
    assert a.allocate() == b[1] and a.num_evictions == 1  # evicts the least recently freed cached block
    assert a.lookup(101, [1]) is None and a.lookup(100, [0]) == b[0]
    a.check_invariants()


def test_a_hit_revives_a_free_block_or_shares_a_used_one():
    a = PrefixCachingAllocator(3)
    x = a.allocate()
    a.register(x, 7, [5, 6])
    a.take(x)  # a second sequence shares it
    assert a.ref_count[x] == 2
    a.free(x)
    a.free(x)
    assert x in a.free_list and a.lookup(7, [5, 6]) == x
    a.take(x)  # revived from the free list: not evictable any more
    assert a.ref_count[x] == 1 and x not in a.free_list
    a.check_invariants()


def test_a_hash_collision_is_a_miss_and_a_duplicate_block_stays_anonymous():
    a = PrefixCachingAllocator(3)
    x, y = a.allocate(), a.allocate()
    assert a.register(x, 42, [1, 2])
    assert a.lookup(42, [3, 4]) is None  # same hash, other tokens: never served
    assert not a.register(y, 42, [1, 2])  # computed twice: the first copy stays the cached one
    assert a.block_hash[y] is None and a.cached == {42: x}
    a.free(y)
    assert a.free_list[0] == y  # holds nothing worth keeping: reused first
    with pytest.raises(AssertionError, match="it is free"):
        a.register(y, 43, [1])
    a.check_invariants()


# ----------------------------------------------------------------------------------------------------------------
# The block manager


def test_a_second_prompt_shares_the_cached_full_blocks_of_the_first():
    m = PrefixCachingBlockManager(num_blocks=8, block_size=4)
    p1 = list(range(10))  # 2 full blocks + 2 tokens
    assert m.allocate_prefix("a", p1, 10) == 0  # nothing cached yet
    m.cache_blocks("a", p1, 10)
    assert m.allocator.num_cached_blocks == 2
    p2 = list(range(8)) + [50, 51, 52]
    assert m.num_cached_tokens(p2) == 8 and m.can_allocate_prefix(p2, 11)
    assert m.allocate_prefix("b", p2, 11) == 8
    assert m.block_tables["b"][:2] == m.block_tables["a"][:2]  # shared, not copied
    assert m.block_tables["b"][2] != m.block_tables["a"][2]
    assert [m.allocator.ref_count[x] for x in m.block_tables["a"]] == [2, 2, 1]
    assert (m.num_queried_tokens, m.num_hit_tokens) == (21, 8)
    m.check_invariants()


def test_the_last_token_is_always_computed_even_when_the_whole_prompt_is_cached():
    m = PrefixCachingBlockManager(num_blocks=8, block_size=4)
    p = list(range(8))  # exactly 2 full blocks
    m.allocate_prefix("a", p, 8)
    m.cache_blocks("a", p, 8)
    assert m.num_cached_tokens(p) == 4  # block 1 holds the last token: computed again, for its logits
    assert m.num_cached_tokens(p + [9]) == 8
    with pytest.raises(InvalidInputError, match=r"in \[5, 8\]"):
        m.allocate_prefix("b", p, 4)  # room for the cached tokens only: nothing to compute
    assert "b" not in m.block_tables
    m.check_invariants()


def test_freed_blocks_stay_cached_until_evicted_and_the_tail_goes_first():
    m = PrefixCachingBlockManager(num_blocks=3, block_size=2)
    p = [1, 2, 3, 4, 5, 6]
    m.allocate_prefix("a", p, 6)
    m.cache_blocks("a", p, 6)
    m.free("a")
    assert m.num_free_blocks == 3 and m.num_cached_tokens(p + [7]) == 6  # all three still findable
    m.allocate("x", 1)  # the tail block (tokens 5, 6) is evicted first: the head is likelier to be shared
    assert m.num_cached_tokens(p + [7]) == 4 and m.allocator.num_evictions == 1
    assert not m.can_allocate_prefix(p[:4] + [9], 5)  # 2 cached (free) + 1 new block > the 2 free
    m.free("x")
    assert m.allocate_prefix("b", p[:4] + [9], 5) == 4
    assert m.num_free_blocks == 0
    m.check_invariants()


def test_a_fork_shares_the_parents_blocks_and_their_hashes_and_copies_the_partial_block_on_write():
    m = PrefixCachingBlockManager(num_blocks=8, block_size=4)
    p = list(range(6))
    m.allocate_prefix("a", p, 6)
    m.cache_blocks("a", p, 6)
    m.fork("a", "b")
    assert m.hashes["b"] == m.hashes["a"] and len(m.hashes["b"]) == 1
    assert m.ensure("a", 7) == [(m.block_tables["b"][1], m.block_tables["a"][1])]  # copy on write
    assert m.ensure("b", 7) == []  # the original is b's alone now
    m.check_invariants()


def test_allocate_prefix_is_all_or_nothing():
    m = PrefixCachingBlockManager(num_blocks=3, block_size=2)
    m.allocate("x", 4)
    free, counts = m.num_free_blocks, (m.num_queried_tokens, m.num_hit_tokens)
    with pytest.raises(CacheCapacityError, match="needs 2 KV blocks"):
        m.allocate_prefix("y", [1, 2, 3], 3)
    assert m.num_free_blocks == free and "y" not in m.block_tables and (m.num_queried_tokens, m.num_hit_tokens) == counts
    with pytest.raises(InvalidInputError, match="already has a block table"):
        m.allocate_prefix("x", [1, 2], 1)
    m.check_invariants()


# ----------------------------------------------------------------------------------------------------------------
# Property test: 10,000 random operations with sharing


PREFIXES = ([7, 7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11], [7, 7, 1, 2, 30, 31], [40, 41, 42, 43, 44])


class PrefixCacheMachine(RuleBasedStateMachine):
    """A scheduler's use of the caching block manager, with a model of what every slot holds."""

    operations = 0

    @initialize(num_blocks=st.integers(2, 20), block_size=st.sampled_from([1, 2, 3, 4]))
    def setup(self, num_blocks, block_size):
        self.m = PrefixCachingBlockManager(num_blocks, block_size)
        self.slot = {}  # (block, offset) -> the tokens up to that position: a stand-in for its K/V
        self.seqs = {}  # seq_id -> [tokens, num_computed]
        self.preempted = []  # tokens of preempted sequences, to re-admit
        self.next_id = 0
        self.hits = 0

    def _count(self):
        type(self).operations += 1

    def _write(self, seq, start, end):
        tokens, table, bs = self.seqs[seq][0], self.m.block_tables[seq], self.m.block_size
        for p in range(start, end):
            self.slot[table[p // bs], p % bs] = tuple(tokens[:p + 1])

    def _admit(self, tokens, chunk):
        seq = self.next_id
        self.next_id += 1
        cached = self.m.num_cached_tokens(tokens)
        n = min(len(tokens), cached + chunk)
        if not self.m.can_allocate_prefix(tokens, n):
            free = self.m.num_free_blocks
            with pytest.raises(CacheCapacityError):
                self.m.allocate_prefix(seq, tokens, n)
            assert self.m.num_free_blocks == free and seq not in self.m.block_tables
            return False
        assert self.m.allocate_prefix(seq, tokens, n) == cached
        self.hits += cached > 0
        self.seqs[seq] = [list(tokens), cached]
        self._check(seq)  # the hit blocks hold this prompt's K/V
        self._write(seq, cached, n)
        self.seqs[seq][1] = n
        self.m.cache_blocks(seq, tokens, n)
        return True

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), max_size=6),
          chunk=st.integers(1, 8))
    def admit(self, prefix, suffix, chunk):
        self._count()
        self._admit(prefix + suffix, chunk)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), k=st.integers(1, 5), token=st.integers(0, 3))
    def compute(self, data, k, token):
        """A prefill chunk, or a decode (a new token first if all are computed); copy on write if shared."""
        self._count()
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens, done = self.seqs[seq]
        if done == len(tokens):
            tokens.append(token)
        target = min(len(tokens), done + k)
        if not self.m.can_ensure(seq, target):
            table = list(self.m.block_tables[seq])
            with pytest.raises(CacheCapacityError):
                self.m.ensure(seq, target)
            assert self.m.block_tables[seq] == table
            if done == len(tokens) - 1 and tokens[-1] == token:
                tokens.pop()
            return
        for src, dst in self.m.ensure(seq, target):  # copy on write: the store copies the block's slots
            for off in range(self.m.block_size):
                if (src, off) in self.slot:
                    self.slot[dst, off] = self.slot[src, off]
        self._write(seq, done, target)
        self.seqs[seq][1] = target
        self.m.cache_blocks(seq, tokens, target)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        self._count()
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens, done = self.seqs[parent]
        self.m.fork(parent, self.next_id, done)
        self.seqs[self.next_id] = [list(tokens[:done]), done]
        self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data):
        self._count()
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        self.m.free(seq)
        del self.seqs[seq]

    @precondition(lambda self: self.seqs)
    @rule()
    def preempt_newest(self):
        self._count()
        seq = max(self.seqs)
        self.m.free(seq)
        tokens, _ = self.seqs.pop(seq)
        if tokens:
            self.preempted.append(tokens)

    @precondition(lambda self: self.preempted)
    @rule(chunk=st.integers(1, 8))
    def readmit(self, chunk):
        """Recompute after preemption: its own blocks, freed, are likely still cached."""
        self._count()
        if self._admit(self.preempted[-1], chunk):
            self.preempted.pop()

    def _check(self, seq):
        tokens, done = self.seqs[seq]
        table, bs = self.m.block_tables[seq], self.m.block_size
        for p in range(done):
            assert self.slot.get((table[p // bs], p % bs)) == tuple(tokens[:p + 1]), (seq, p)

    @invariant()
    def every_sequence_reads_its_own_kv_and_no_block_leaks(self):
        m = self.m
        m.check_invariants()  # ref counts == holders; free list == blocks with ref 0; cache map consistent
        for seq in self.seqs:
            self._check(seq)
            assert m.num_tokens[seq] >= self.seqs[seq][1]
        held = {b for t in m.block_tables.values() for b in t}
        assert len(held) + m.num_free_blocks == m.num_blocks

    def teardown(self):
        for seq in list(self.seqs):
            self.m.free(seq)
        assert self.m.num_free_blocks == self.m.num_blocks
        self.m.check_invariants()
        type(self).hit_runs = getattr(type(self), "hit_runs", 0) + (self.hits > 0)
        type(self).evictions = getattr(type(self), "evictions", 0) + self.m.allocator.num_evictions


def test_random_operations_with_forks_hits_and_evictions_never_leak_or_corrupt_a_block():
    PrefixCacheMachine.hit_runs = PrefixCacheMachine.evictions = 0
    run_counted_state_machine(PrefixCacheMachine, max_examples=150, steps=100, min_operations=10_000)
    assert PrefixCacheMachine.hit_runs > 50 and PrefixCacheMachine.evictions > 100  # the cache was exercised


# ----------------------------------------------------------------------------------------------------------------
# The store


def test_the_store_allocates_a_prefix_with_its_cached_kv_already_written():
    cfg = GPT2Config(vocab_size=11, n_positions=32, n_embd=8, n_head=2, n_layer=2)
    store = PrefixCachingKVStore(cfg, num_blocks=6, block_size=4)
    p = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    store.allocate_prefix("a", p, 9)
    k = np.arange(2 * 9 * 4, dtype=np.float32).reshape(2, 9, 4)
    for layer in range(2):
        store.update("a", layer, 0, k + layer, -k)
    store.cache_blocks("a", p, 9)
    store.free("a")
    assert store.allocate_prefix("b", p[:8] + [0, 0], 10) == 8
    assert store.written["b"] == 8
    for layer in range(2):
        got_k, got_v = store.read("b", layer, 8)
        np.testing.assert_array_equal(got_k, k[:, :8] + layer)
        np.testing.assert_array_equal(got_v, -k[:, :8])
    store.check_invariants()
    assert not store.can_allocate_prefix(list(range(40)), 40)  # past the context
