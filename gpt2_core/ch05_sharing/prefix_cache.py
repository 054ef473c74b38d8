"""Chapter 5: prefix caching — K/V computed once for a block of tokens serve every request that starts the same way.

Two requests whose prompts begin with the same system prompt compute the same K/V for it: a token's K and V depend
only on the tokens up to it. So a *full* block of K/V can be found again by what produced it: its tokens, and
everything before them. Its **block hash** chains the two, ``hash_block(parent_hash, tokens)`` with the hash of the
block before (vLLM, nano-vllm): equal hashes mean an equal prefix up to the block's end.

* When a block of a sequence is full and computed, the allocator **registers** it under its hash.
* A new request looks its prompt's full blocks up, first to last, and **shares** every block found (a reference
  more: the blocks are immutable, as chapter 4's copy on write keeps shared blocks); it computes only the rest.
  The prompt's last token is always computed: its logits are the first new token's.
* A freed block keeps its K/V and its hash, in the free list. ``allocate`` hands out blocks that hold nothing
  first, then cached ones, least recently freed first: **LRU eviction**. A hit on a free block takes it out of the
  free list again.
"""

from __future__ import annotations

from ..ch04_paged.block_manager import BlockAllocator, BlockManager, blocks_needed
from ..errors import CacheCapacityError, InvalidInputError, is_integer
from ..ch04_paged.paged_kv_store import FP32, KVCodec
from .paged_attention import PagedAttentionKVStore

ROOT_HASH = 0  # the "parent" of a sequence's first block


def hash_block(parent_hash: int, token_ids) -> int:
    """The identity of a full block: its tokens, chained with the hash of the block before it."""
    return hash((parent_hash, tuple(int(t) for t in token_ids)))


def block_hashes(token_ids, block_size: int) -> list[int]:
    """The chained hash of each *full* block of ``token_ids``: [len(token_ids) // block_size]."""
    hashes, parent = [], ROOT_HASH
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


class PrefixCachingAllocator(BlockAllocator):
    """Chapter 4's allocator whose blocks remember what they hold: ``cached`` maps a block hash to the block that
    holds those tokens' K/V, in use or free. ``register`` adds a computed full block; ``allocate`` forgets the hash
    of the block it hands out (an eviction, if it had one); ``take`` revives a cached block (a hit)."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.block_hash: list[int | None] = [None] * self.num_blocks  # each block's hash, once registered
        self.block_tokens: list[tuple | None] = [None] * self.num_blocks  # its tokens, checked on every hit
        self.cached: dict[int, int] = {}  # block hash -> block
        self.num_evictions = 0

    def allocate(self) -> int:
        """The block at the front of the free list: one holding nothing if there is one, else the least recently
        freed cached block, whose hash is forgotten (evicted)."""
        block = super().allocate()
        if self.block_hash[block] is not None:
            del self.cached[self.block_hash[block]]
            self.block_hash[block] = self.block_tokens[block] = None
            self.num_evictions += 1
        return block

    def free(self, block: int) -> None:
        """Chapter 4's ``free``; a freed block that holds nothing worth keeping goes to the *front* of the free list,
        so that cached blocks are evicted only when no empty block is left."""
        super().free(block)
        if self.ref_count[block] == 0 and self.block_hash[block] is None:
            assert self.free_list[-1] == block
            self.free_list.appendleft(self.free_list.pop())

    def lookup(self, block_hash: int, token_ids) -> int | None:
        """The block cached under ``block_hash`` if it holds ``token_ids`` (a hash collision is a miss), else None."""
        block = self.cached.get(block_hash)
        if block is None or self.block_tokens[block] != tuple(int(t) for t in token_ids):
            return None
        return block

    def take(self, block: int) -> None:
        """A cache hit: one more holder of ``block``; a free one leaves the free list (it is no longer evictable)."""
        assert self.block_hash[block] is not None, f"block {block} holds nothing cached"
        if self.ref_count[block] == 0:
            self.free_list.remove(block)
            self.ref_count[block] = 1
        else:
            self.share(block)

    def register(self, block: int, block_hash: int, token_ids) -> bool:
        """``block`` (in use, full, computed) holds ``token_ids``: findable under ``block_hash`` from now on. If
        another block already holds the same tokens (two sequences computed them in the same step), that one stays
        the cached copy and ``block`` stays anonymous: returns False."""
        assert self.ref_count[block] > 0, f"cannot register block {block}: it is free"
        if block_hash in self.cached:
            return self.cached[block_hash] == block
        assert self.block_hash[block] is None, f"block {block} is registered already"
        self.block_hash[block], self.block_tokens[block] = block_hash, tuple(int(t) for t in token_ids)
        self.cached[block_hash] = block
        return True

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def check_invariants(self) -> None:
        """Chapter 4's, and: ``cached`` and ``block_hash`` agree, block by block."""
        super().check_invariants()
        for h, block in self.cached.items():
            assert self.block_hash[block] == h, f"block {block} is cached under {h} but says {self.block_hash[block]}"
        assert sum(h is not None for h in self.block_hash) == len(self.cached), "a registered block is not cached"


class PrefixCachingBlockManager(BlockManager):
    """Chapter 4's block tables over a ``PrefixCachingAllocator``, with the hash chain of each sequence's
    registered blocks (``hashes[seq_id]``) and the prefix cache's counters (in tokens, as vLLM counts them)."""

    def __init__(self, num_blocks: int, block_size: int = 16):
        super().__init__(num_blocks, block_size)
        self.allocator = PrefixCachingAllocator(num_blocks)
        self.hashes: dict[object, list[int]] = {}  # seq_id -> hashes of its first full, computed blocks
        self.num_queried_tokens = 0  # prompt tokens looked up at admission
        self.num_hit_tokens = 0  # of those, found cached: prefill tokens saved
        self.num_copied_blocks = 0  # copies on write of a shared, partly filled block

    def cached_prefix(self, token_ids) -> tuple[list[int], list[int]]:
        """(blocks, hashes) of the longest run of ``token_ids``'s full blocks found cached, first block first. The
        last token is left out: it must be computed, its logits are the next token's."""
        blocks, hashes, parent, bs = [], [], ROOT_HASH, self.block_size
        for i in range((len(token_ids) - 1) // bs):
            tokens = token_ids[i * bs:(i + 1) * bs]
            parent = hash_block(parent, tokens)
            block = self.allocator.lookup(parent, tokens)
            if block is None:
                break
            blocks.append(block)
            hashes.append(parent)
        return blocks, hashes

    def num_cached_tokens(self, token_ids) -> int:
        """Tokens at the start of ``token_ids`` whose K/V are cached (a multiple of ``block_size``)."""
        return len(self.cached_prefix(token_ids)[0]) * self.block_size

    def _blocks_to_take(self, hits: list[int], num_tokens: int) -> int:
        """Blocks that leave the free list to give a sequence with cached blocks ``hits`` room for ``num_tokens``:
        the new ones, and the hits that are free now."""
        revived = sum(self.allocator.ref_count[b] == 0 for b in hits)
        return max(blocks_needed(num_tokens, self.block_size), len(hits)) - len(hits) + revived

    def can_allocate_prefix(self, token_ids, num_tokens: int) -> bool:
        hits, _ = self.cached_prefix(token_ids)
        return self._blocks_to_take(hits, num_tokens) <= self.num_free_blocks

    def allocate_prefix(self, seq_id, token_ids, num_tokens: int) -> int:
        """A new block table with room for ``num_tokens`` tokens of ``token_ids``, whose cached full blocks are
        shared instead of allocated; all or nothing. Returns the tokens already computed (num_computed_tokens)."""
        if seq_id in self.block_tables:
            raise InvalidInputError(f"sequence {seq_id!r} already has a block table")
        hits, hashes = self.cached_prefix(token_ids)
        num_cached = len(hits) * self.block_size
        if not is_integer(num_tokens, num_cached + 1, len(token_ids)):
            raise InvalidInputError(f"num_tokens must be an integer in [{num_cached + 1}, {len(token_ids)}] (the "
                                    f"{num_cached} cached tokens and at least one to compute), got {num_tokens!r}")
        need = self._blocks_to_take(hits, num_tokens)
        if need > self.num_free_blocks:
            raise CacheCapacityError(f"sequence {seq_id!r} needs {need} KV blocks for {num_tokens} tokens "
                                     f"({num_cached} cached), {self.num_free_blocks} of {self.num_blocks} are free")
        for block in hits:
            self.allocator.take(block)
        new = [self.allocator.allocate() for _ in range(blocks_needed(num_tokens, self.block_size) - len(hits))]
        self.block_tables[seq_id] = hits + new
        self.num_tokens[seq_id] = int(num_tokens)
        self.hashes[seq_id] = hashes
        self.num_queried_tokens += len(token_ids)
        self.num_hit_tokens += num_cached
        return num_cached

    def allocate(self, seq_id, num_tokens: int) -> list[int]:
        """Chapter 4's ``allocate`` (no lookup); the sequence's blocks can still be registered as they fill."""
        table = super().allocate(seq_id, num_tokens)
        self.hashes[seq_id] = []
        return table

    def cache_blocks(self, seq_id, token_ids, num_computed: int) -> None:
        """Register every full block of ``seq_id`` whose tokens are all computed (positions < ``num_computed``)."""
        hashes, table, bs = self.hashes[seq_id], self.block_tables[seq_id], self.block_size
        for i in range(len(hashes), min(num_computed // bs, len(table))):
            tokens = token_ids[i * bs:(i + 1) * bs]
            hashes.append(hash_block(hashes[-1] if hashes else ROOT_HASH, tokens))
            self.allocator.register(table[i], hashes[-1], tokens)

    def ensure(self, seq_id, num_tokens: int) -> list[tuple[int, int]]:
        copies = super().ensure(seq_id, num_tokens)
        self.num_copied_blocks += len(copies)
        return copies

    def fork(self, parent, child, num_tokens: int | None = None) -> list[int]:
        table = super().fork(parent, child, num_tokens)
        self.hashes[child] = self.hashes[parent][:self.num_tokens[child] // self.block_size]  # its full blocks'
        return table

    def free(self, seq_id) -> None:
        """Chapter 4's ``free``, last block first: a prompt's first blocks, the ones other prompts are likeliest to
        share, are then the last to be evicted."""
        if seq_id in self.block_tables:
            self.block_tables[seq_id].reverse()
            self.hashes.pop(seq_id)
        super().free(seq_id)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found cached / prompt tokens looked up (vLLM's prefix cache hit rate)."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def check_invariants(self) -> None:
        """Chapter 4's, the allocator's, and: a registered block in a table holds the hash the table expects."""
        super().check_invariants()
        for seq_id, hashes in self.hashes.items():
            table = self.block_tables[seq_id]
            assert len(hashes) <= len(table), f"{seq_id!r}: more hashes than blocks"
            for block, h in zip(table, hashes):
                assert self.allocator.block_hash[block] in (None, h), f"{seq_id!r}: block {block} holds other tokens"


class PrefixCachingKVStore(PagedAttentionKVStore):
    """The paged-attention store over a ``PrefixCachingBlockManager``: ``allocate_prefix`` shares a prompt's cached
    blocks and says how many tokens need no computing; ``cache_blocks`` registers blocks as they are computed."""

    def __init__(self, config, num_blocks: int, block_size: int = 16, codec: KVCodec = FP32):
        super().__init__(config, num_blocks, block_size, codec)
        self.manager = PrefixCachingBlockManager(self.num_blocks, self.block_size)

    def num_cached_tokens(self, token_ids) -> int:
        return self.manager.num_cached_tokens(token_ids)

    def can_allocate_prefix(self, token_ids, num_tokens: int) -> bool:
        return num_tokens <= self.max_len and self.manager.can_allocate_prefix(token_ids, num_tokens)

    def allocate_prefix(self, seq_id, token_ids, num_tokens: int) -> int:
        self._check_length(seq_id, num_tokens)
        num_cached = self.manager.allocate_prefix(seq_id, token_ids, num_tokens)
        self.written[seq_id] = num_cached
        self._refresh_slots(seq_id)
        return num_cached

    def cache_blocks(self, seq_id, token_ids, num_computed: int) -> None:
        self.manager.cache_blocks(seq_id, token_ids, num_computed)
