"""Chapter 4: memory for K/V managed like virtual memory — fixed-size blocks, a free list, per-sequence block tables.

A *block* holds the K/V of ``block_size`` consecutive token positions (every layer, every head). The pool of
``num_blocks`` physical blocks is allocated once; a sequence owns a *block table*, the list of physical blocks
holding its logical blocks 0, 1, 2, ... in order, exactly as a page table maps virtual pages to frames. A sequence
grows by one block only when its last block is full, so at most ``block_size - 1`` slots per sequence are ever
reserved and unused (internal fragmentation), and since any free block will do, free memory never becomes
unusable because it is in the wrong place (no external fragmentation).

``BlockAllocator`` hands out physical blocks and counts references to them (a block may be shared by a sequence
and its fork); ``BlockManager`` keeps the block tables. Both assert their invariants: a block in use is never in
the free list, and a block's ``ref_count`` is 0 before it is handed out again.
"""

from __future__ import annotations

from collections import deque

from ..errors import CacheCapacityError, InvalidInputError, is_integer


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` token positions: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


def internal_fragmentation(lengths, block_size: int) -> float:
    """Fraction of the reserved slots left empty when sequences of ``lengths`` tokens each hold whole blocks."""
    lengths = [int(n) for n in lengths]
    reserved = sum(blocks_needed(n, block_size) * block_size for n in lengths)
    return 0.0 if reserved == 0 else 1 - sum(lengths) / reserved


def choose_block_size(lengths, candidates=(1, 2, 4, 8, 16, 32, 64, 128, 256), max_waste: float = 0.05) -> int:
    """The largest candidate block size whose internal fragmentation on ``lengths`` is at most ``max_waste``.

    Larger blocks mean fewer allocations and shorter block tables; smaller ones waste less of the last block.
    ``lengths``: the token counts sequences hold, e.g. every running sequence's length at every step.
    """
    fits = [bs for bs in sorted(candidates) if internal_fragmentation(lengths, bs) <= max_waste]
    return fits[-1] if fits else min(candidates)


class BlockAllocator:
    """``num_blocks`` physical blocks: a FIFO free list and a reference count per block."""

    def __init__(self, num_blocks: int):
        if not is_integer(num_blocks, 1):
            raise InvalidInputError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        num_blocks = self.num_blocks = int(num_blocks)  # [0] * np.int64(3) would be an array, not a list
        self.ref_count = [0] * num_blocks  # sequences (block tables) that hold each block
        self.free_list = deque(range(num_blocks))  # block 0 is handed out first; freed blocks go to the back

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list)

    def allocate(self) -> int:
        """Take a free block; its ``ref_count`` becomes 1."""
        if not self.free_list:
            raise CacheCapacityError(f"out of KV blocks: all {self.num_blocks} are in use")
        block = self.free_list.popleft()
        assert self.ref_count[block] == 0, f"block {block} was in the free list with ref_count {self.ref_count[block]}"
        self.ref_count[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more holder of ``block`` (a fork): it is freed only when every holder has freed it."""
        assert self.ref_count[block] > 0, f"cannot share block {block}: it is free"
        self.ref_count[block] += 1

    def free(self, block: int) -> None:
        """Drop one reference to ``block``; the last one returns it to the free list."""
        assert self.ref_count[block] > 0, f"double free of block {block}"
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free_list.append(block)

    def check_invariants(self) -> None:
        """Every block is either free (in the free list once, ``ref_count == 0``) or in use (``ref_count > 0``)."""
        free = set(self.free_list)
        assert len(free) == len(self.free_list), "a block is in the free list twice"
        for block, count in enumerate(self.ref_count):
            assert count >= 0, f"block {block} has ref_count {count}"
            assert (count == 0) == (block in free), f"block {block}: ref_count {count}, in free list: {block in free}"


class BlockManager:
    """Per-sequence block tables over one ``BlockAllocator``.

    ``num_tokens[seq_id]`` is how many token positions ``seq_id`` has room for; ``block_tables[seq_id]`` lists
    the ``blocks_needed(num_tokens, block_size)`` physical blocks that hold them, logical block order.
    """

    def __init__(self, num_blocks: int, block_size: int = 16):
        if not is_integer(block_size, 1):
            raise InvalidInputError(f"block_size must be a positive integer, got {block_size!r}")
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = int(block_size)
        self.block_tables: dict[object, list[int]] = {}
        self.num_tokens: dict[object, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        return blocks_needed(num_tokens, self.block_size) <= self.num_free_blocks

    def allocate(self, seq_id, num_tokens: int) -> list[int]:
        """A new block table with room for ``num_tokens`` tokens; all or nothing."""
        if seq_id in self.block_tables:
            raise InvalidInputError(f"sequence {seq_id!r} already has a block table")
        if not is_integer(num_tokens, 0):
            raise InvalidInputError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
        num_tokens = int(num_tokens)
        need = blocks_needed(num_tokens, self.block_size)
        if need > self.num_free_blocks:
            raise CacheCapacityError(f"sequence {seq_id!r} needs {need} KV blocks for {num_tokens} tokens, "
                                     f"{self.num_free_blocks} of {self.num_blocks} are free")
        self.block_tables[seq_id] = [self.allocator.allocate() for _ in range(need)]
        self.num_tokens[seq_id] = num_tokens
        return self.block_tables[seq_id]

    def _new_blocks(self, seq_id, num_tokens: int) -> tuple[int, bool]:
        """Blocks ``ensure(seq_id, num_tokens)`` would take: new ones, plus one if the last is shared (COW)."""
        if seq_id not in self.block_tables:
            raise InvalidInputError(f"sequence {seq_id!r} has no block table")
        if not is_integer(num_tokens, 0):
            raise InvalidInputError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
        have = self.num_tokens[seq_id]
        if num_tokens <= have:
            return 0, False
        table = self.block_tables[seq_id]
        cow = have % self.block_size != 0 and self.allocator.ref_count[table[-1]] > 1  # will write a shared block
        return blocks_needed(num_tokens, self.block_size) - len(table) + cow, cow

    def can_ensure(self, seq_id, num_tokens: int) -> bool:
        return seq_id in self.block_tables and self._new_blocks(seq_id, num_tokens)[0] <= self.num_free_blocks

    def ensure(self, seq_id, num_tokens: int) -> list[tuple[int, int]]:
        """Grow ``seq_id`` to room for ``num_tokens`` tokens; all or nothing.

        A block is allocated only when the last one is full. Positions ``num_tokens[seq_id] ..`` are about to be
        written: if the partly filled last block is shared with a fork, it is copied first (copy on write).
        Returns the ``(src, dst)`` block copies the caller must make in its K/V pool.
        """
        need, cow = self._new_blocks(seq_id, num_tokens)
        if need > self.num_free_blocks:
            raise CacheCapacityError(f"sequence {seq_id!r} needs {need} more KV blocks to hold {num_tokens} tokens, "
                                     f"{self.num_free_blocks} of {self.num_blocks} are free")
        table, copies = self.block_tables[seq_id], []
        if cow:
            src = table[-1]
            table[-1] = self.allocator.allocate()
            self.allocator.free(src)  # the other holders keep it
            copies.append((src, table[-1]))
        while len(table) < blocks_needed(num_tokens, self.block_size):
            table.append(self.allocator.allocate())
        self.num_tokens[seq_id] = max(self.num_tokens[seq_id], int(num_tokens))
        return copies

    def fork(self, parent, child, num_tokens: int | None = None) -> list[int]:
        """``child`` shares the blocks of ``parent``'s first ``num_tokens`` tokens (default: all it has room for;
        ref counts +1); writes then copy on write. Pass the tokens actually written when ``parent`` has room it
        has not filled yet: the child must not share room the parent is still going to write."""
        if parent not in self.block_tables:
            raise InvalidInputError(f"sequence {parent!r} has no block table to fork")
        if child in self.block_tables:
            raise InvalidInputError(f"sequence {child!r} already has a block table")
        have = self.num_tokens[parent]
        n = have if num_tokens is None else num_tokens
        if not is_integer(n, 0, have):
            raise InvalidInputError(f"fork of {parent!r}: num_tokens must be an integer in [0, {have}], got {n!r}")
        shared = self.block_tables[parent][:blocks_needed(n, self.block_size)]
        for block in shared:
            self.allocator.share(block)
        self.block_tables[child] = list(shared)
        self.num_tokens[child] = int(n)
        return self.block_tables[child]

    def free(self, seq_id) -> None:
        """Release every block of ``seq_id`` (a shared block stays in use by its other holders)."""
        if seq_id not in self.block_tables:
            raise InvalidInputError(f"sequence {seq_id!r} has no block table to free")
        for block in self.block_tables.pop(seq_id):
            self.allocator.free(block)
        del self.num_tokens[seq_id]

    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def check_invariants(self) -> None:
        """The allocator's invariants, and: each block's ``ref_count`` is the number of tables that hold it."""
        self.allocator.check_invariants()
        holders = [0] * self.num_blocks
        for seq_id, table in self.block_tables.items():
            assert len(table) == blocks_needed(self.num_tokens[seq_id], self.block_size), f"{seq_id!r}: table size"
            assert len(set(table)) == len(table), f"sequence {seq_id!r} holds a block twice"
            for block in table:
                holders[block] += 1
        assert holders == self.allocator.ref_count, "a block's ref_count differs from the tables holding it"
