"""Chapter 10: KV rollback. A verify pass writes the K/V of every draft; the rejected ones must go.

The K/V of a rejected draft are wrong for the sequence (they belong to a token it will not have), but nothing reads
them: attention reads positions ``0 .. num_computed_tokens - 1`` only, and the next pass writes over them. What
must not stay is the *room*: a verify pass of k + 1 positions may have taken new blocks that the accepted tokens
do not fill. ``truncate`` gives them back, as a page table drops the pages past a shrunk mapping: the blocks past
the new length return to the allocator (to the front of its free list, since they hold nothing worth caching), and
the sequence's slot map is cut to the new length. Chapter 2's cache rolls back by setting ``cache.length``.

A block registered in the prefix cache holds computed tokens only, and rejected drafts are never computed tokens,
so rollback never cuts into one (``truncate`` refuses to).
"""

from __future__ import annotations

from ..ch04_paged.block_manager import blocks_needed
from ..ch04_paged.paged_kv_store import FP32, KVCodec
from ..ch05_sharing.prefix_cache import PrefixCachingBlockManager, PrefixCachingKVStore
from ..errors import InvalidInputError, is_integer


class TruncatingBlockManager(PrefixCachingBlockManager):
    """Chapter 5's block tables, which can also shrink (``truncate``)."""

    def truncate(self, seq_id, num_tokens: int) -> list[int]:
        """Keep room for ``seq_id``'s first ``num_tokens`` positions only; the blocks past them are freed (a block
        shared with a fork loses one holder). Returns the blocks released, last first."""
        if seq_id not in self.block_tables:
            raise InvalidInputError(f"sequence {seq_id!r} has no block table to truncate")
        registered = len(self.hashes[seq_id]) * self.block_size  # positions in blocks of the prefix cache
        if not is_integer(num_tokens, registered, self.num_tokens[seq_id]):
            raise InvalidInputError(f"truncate {seq_id!r}: num_tokens must be an integer in [{registered}, "
                                    f"{self.num_tokens[seq_id]}] (cached blocks stay whole), got {num_tokens!r}")
        table = self.block_tables[seq_id]
        keep = blocks_needed(num_tokens, self.block_size)
        released = table[keep:][::-1]
        del table[keep:]
        for block in released:
            self.allocator.free(block)
        self.num_tokens[seq_id] = int(num_tokens)
        return released


class SpeculativeKVStore(PrefixCachingKVStore):
    """Chapter 5's store (prefix caching, paged attention) over a ``TruncatingBlockManager``: ``truncate`` rolls
    a sequence back to its accepted tokens."""

    def __init__(self, config, num_blocks: int, block_size: int = 16, codec: KVCodec = FP32):
        super().__init__(config, num_blocks, block_size, codec)
        self.manager = TruncatingBlockManager(self.num_blocks, self.block_size)

    def truncate(self, seq_id, num_tokens: int) -> int:
        """Roll ``seq_id`` back to its first ``num_tokens`` positions; returns the number of blocks freed."""
        released = self.manager.truncate(seq_id, num_tokens)
        self.written[seq_id] = min(self.written[seq_id], int(num_tokens))
        self._refresh_slots(seq_id)  # the slot map (and paged attention's runs) shrink with the table
        return len(released)
