"""Chapter 4: the block allocator and the block tables — unit tests, then a hypothesis state machine that runs
well over 10,000 random allocate / append / fork / free / preempt operations and checks after every one that no
block leaks and none is held by two sequences except through a fork; at the end the whole pool is free."""

import pytest
from helpers import run_counted_state_machine
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpt2_core.ch04_paged.block_manager import BlockAllocator, BlockManager, blocks_needed, internal_fragmentation
from gpt2_core.errors import CacheCapacityError, InvalidInputError

# ----------------------------------------------------------------------------------------------------------------
# BlockAllocator


def test_allocator_hands_out_every_block_once_then_raises():
    a = BlockAllocator(4)
    got = [a.allocate() for _ in range(4)]
    assert sorted(got) == [0, 1, 2, 3] and a.num_free_blocks == 0
    assert a.ref_count == [1, 1, 1, 1]
    with pytest.raises(CacheCapacityError, match="all 4 are in use"):
        a.allocate()
    a.check_invariants()


def test_allocator_free_list_is_fifo_and_freed_blocks_are_reused_last():
    a = BlockAllocator(3)
    b0, b1, b2 = a.allocate(), a.allocate(), a.allocate()
    a.free(b1)
    a.free(b0)
    assert list(a.free_list) == [b1, b0]
    assert a.allocate() == b1
    a.check_invariants()


def test_shared_block_is_freed_by_its_last_holder_only():
    a = BlockAllocator(2)
    b = a.allocate()
    a.share(b)
    assert a.ref_count[b] == 2
    a.free(b)
    assert a.num_free_blocks == 1 and a.ref_count[b] == 1  # still held
    a.free(b)
    assert a.num_free_blocks == 2 and a.ref_count[b] == 0
    a.check_invariants()


def test_double_free_and_sharing_a_free_block_are_caught():
    a = BlockAllocator(2)
    b = a.allocate()
    a.free(b)
    with pytest.raises(AssertionError, match="double free"):
        a.free(b)
    with pytest.raises(AssertionError, match="it is free"):
        a.share(b)


def test_invariant_check_catches_a_corrupted_free_list():
    a = BlockAllocator(3)
    b = a.allocate()
    a.free_list.append(b)  # in use and in the free list: the bug the invariant exists for
    with pytest.raises(AssertionError):
        a.check_invariants()


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_allocator_rejects_bad_sizes(bad):
    with pytest.raises(InvalidInputError):
        BlockAllocator(bad)


# ----------------------------------------------------------------------------------------------------------------
# Block tables


def test_blocks_needed_and_internal_fragmentation():
    assert [blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert internal_fragmentation([4, 8], 4) == 0.0
    assert internal_fragmentation([1], 4) == 0.75
    assert internal_fragmentation([5, 3], 4) == pytest.approx(1 - 8 / 12)
    assert internal_fragmentation([], 16) == 0.0


def test_a_block_is_allocated_only_when_the_last_one_is_full():
    m = BlockManager(num_blocks=8, block_size=4)
    m.allocate("a", 3)
    assert len(m.block_tables["a"]) == 1
    for n in range(4, 14):
        m.ensure("a", n)
        assert len(m.block_tables["a"]) == blocks_needed(n, 4), n
        m.check_invariants()
    assert m.num_free_blocks == 8 - 4
    m.ensure("a", 10)  # shrinking is not a thing: room stays
    assert m.num_tokens["a"] == 13
    m.free("a")
    assert m.num_free_blocks == 8 and m.block_tables == {}
    m.check_invariants()


def test_allocate_and_ensure_are_all_or_nothing():
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate("a", 9)  # 3 blocks
    assert not m.can_allocate(5) and m.can_allocate(4)
    with pytest.raises(CacheCapacityError, match="needs 2 KV blocks"):
        m.allocate("b", 5)
    assert "b" not in m.block_tables and m.num_free_blocks == 1
    assert m.can_ensure("a", 16) and not m.can_ensure("a", 17)
    with pytest.raises(CacheCapacityError):
        m.ensure("a", 17)
    assert len(m.block_tables["a"]) == 3 and m.num_tokens["a"] == 9
    m.check_invariants()


def test_unknown_and_duplicate_sequences_are_errors():
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate("a", 1)
    with pytest.raises(InvalidInputError):
        m.allocate("a", 1)
    with pytest.raises(InvalidInputError):
        m.ensure("b", 1)
    assert not m.can_ensure("b", 1)
    with pytest.raises(InvalidInputError):
        m.free("b")
    with pytest.raises(InvalidInputError):
        m.fork("b", "c")
    with pytest.raises(InvalidInputError):
        m.fork("a", "a")
    with pytest.raises(InvalidInputError):
        BlockManager(4, block_size=0)


def test_fork_shares_blocks_and_copies_the_partly_filled_last_block_on_write():
    m = BlockManager(num_blocks=8, block_size=4)
    m.allocate("parent", 6)  # blocks [p0 full, p1 half full]
    p0, p1 = m.block_tables["parent"]
    m.fork("parent", "child")
    assert m.block_tables["child"] == [p0, p1] and m.allocator.ref_count[p0] == 2
    m.check_invariants()
    copies = m.ensure("child", 7)  # the child writes position 6, in the shared block p1: copy it first
    assert len(copies) == 1 and copies[0][0] == p1
    new = copies[0][1]
    assert m.block_tables["child"] == [p0, new] and m.block_tables["parent"] == [p0, p1]
    assert m.allocator.ref_count[p1] == 1 and m.allocator.ref_count[p0] == 2
    assert m.ensure("parent", 7) == []  # p1 is the parent's alone now: no copy
    m.check_invariants()
    m.free("parent")
    assert m.allocator.ref_count[p0] == 1  # the child still holds the full prefix block
    m.free("child")
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_fork_at_a_block_boundary_needs_no_copy():
    m = BlockManager(num_blocks=8, block_size=4)
    m.allocate("p", 8)
    m.fork("p", "c")
    assert m.ensure("c", 9) == [] and len(m.block_tables["c"]) == 3
    m.check_invariants()


def test_copy_on_write_counts_its_block_in_can_ensure():
    m = BlockManager(num_blocks=2, block_size=4)
    m.allocate("p", 2)
    m.fork("p", "c")
    assert m.can_ensure("c", 3)  # one free block for the copy
    m.allocate("x", 1)
    assert not m.can_ensure("c", 3)  # no block left to copy into
    with pytest.raises(CacheCapacityError):
        m.ensure("c", 3)
    m.check_invariants()


# ----------------------------------------------------------------------------------------------------------------
# Property test: random operations never leak or double-hand a block


class BlockTableMachine(RuleBasedStateMachine):
    """A model of a scheduler's use of the block manager: admit (allocate), decode (append one token, or many),
    fork, finish (free) and preempt (free now, re-allocate the same number of tokens later)."""

    operations = 0  # counted across all runs, to show the test does what its docstring claims

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 3, 4, 16]))
    def setup(self, num_blocks, block_size):
        self.m = BlockManager(num_blocks, block_size)
        self.length = {}  # seq -> tokens it holds (our model of the truth)
        self.preempted = []  # lengths of preempted sequences, to readmit
        self.next_id = 0

    def _count(self):
        type(self).operations += 1

    @rule(n=st.integers(0, 40))
    def allocate(self, n):
        self._count()
        fits = self.m.can_allocate(n)
        assert fits == (blocks_needed(n, self.m.block_size) <= self.m.num_free_blocks)
        if fits:
            self.m.allocate(self.next_id, n)
            self.length[self.next_id] = n
        else:
            free_before = self.m.num_free_blocks
            with pytest.raises(CacheCapacityError):
                self.m.allocate(self.next_id, n)
            assert self.m.num_free_blocks == free_before and self.next_id not in self.m.block_tables
        self.next_id += 1

    @precondition(lambda self: self.length)
    @rule(data=st.data(), grow=st.integers(1, 20))
    def append(self, data, grow):
        self._count()
        seq = data.draw(st.sampled_from(sorted(self.length)))
        target = self.length[seq] + grow
        if self.m.can_ensure(seq, target):
            copies = self.m.ensure(seq, target)
            assert len(copies) <= 1
            self.length[seq] = target
        else:
            table = list(self.m.block_tables[seq])
            with pytest.raises(CacheCapacityError):
                self.m.ensure(seq, target)
            assert self.m.block_tables[seq] == table

    @precondition(lambda self: self.length)
    @rule(data=st.data())
    def fork(self, data):
        self._count()
        parent = data.draw(st.sampled_from(sorted(self.length)))
        self.m.fork(parent, self.next_id)
        self.length[self.next_id] = self.length[parent]
        self.next_id += 1

    @precondition(lambda self: self.length)
    @rule(data=st.data())
    def free(self, data):
        self._count()
        seq = data.draw(st.sampled_from(sorted(self.length)))
        self.m.free(seq)
        del self.length[seq]

    @precondition(lambda self: self.length)
    @rule()
    def preempt_newest(self):
        self._count()
        seq = max(self.length)
        self.m.free(seq)
        self.preempted.append(self.length.pop(seq))

    @precondition(lambda self: self.preempted)
    @rule()
    def readmit(self):
        self._count()
        n = self.preempted[-1]
        if self.m.can_allocate(n):
            self.m.allocate(self.next_id, self.preempted.pop())
            self.length[self.next_id] = n
            self.next_id += 1

    @invariant()
    def no_leak_no_accidental_sharing(self):
        m = self.m
        m.check_invariants()  # ref counts == holders, free list == blocks with ref_count 0, no duplicates
        assert set(m.block_tables) == set(self.length)
        for seq, n in self.length.items():
            assert m.num_tokens[seq] == n and len(m.block_tables[seq]) == blocks_needed(n, m.block_size)
        held = {b for t in m.block_tables.values() for b in t}
        assert len(held) + m.num_free_blocks == m.num_blocks  # every block is held or free: none leaked

    def teardown(self):
        for seq in list(self.length):
            self.m.free(seq)
        assert self.m.num_free_blocks == self.m.num_blocks  # the whole pool is free again
        self.m.check_invariants()


def test_random_operations_never_leak_or_share_a_block_by_accident():
    run_counted_state_machine(BlockTableMachine, max_examples=150, steps=100, min_operations=10_000)


def test_choose_block_size_takes_the_largest_within_the_waste_allowed():
    from gpt2_core.ch04_paged.block_manager import choose_block_size

    assert choose_block_size([64, 128], (8, 16, 64), max_waste=0.0) == 64
    assert choose_block_size([17], (1, 4, 16), max_waste=0.2) == 4  # 16 wastes 15/32, 4 wastes 3/20
    assert choose_block_size([17], (1, 4, 16), max_waste=0.1) == 1
    assert choose_block_size([1], (4, 16), max_waste=0.0) == 4  # nothing fits: the smallest
