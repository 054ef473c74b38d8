"""Chapter 4: the paged KV store — chapter 3's ``KVStore`` interface over a pool of fixed-size blocks.

One preallocated pool ``[L, num_blocks * block_size, 2, H, D]`` (in each layer, a token slot's K and V side by
side); physical block ``b`` is token slots ``b * block_size .. (b + 1) * block_size - 1``. A sequence's logical
position ``p`` lives in slot ``block_table[p // block_size] * block_size + p % block_size``; ``update`` writes the
new K/V into those slots and gathers the sequence's K and V back in position order with one ``np.take`` — no loop
over tokens or blocks. The gathered arrays hold the same float32 values as chapter 3's contiguous slot, so attention, and every
logit after it, are identical.

What the pool holds is a codec's business (``KVCodec``): this chapter's keeps float32 as computed, and its
``encode`` and ``decode`` do nothing. Chapter 6 passes in codecs that keep fewer bytes (fp16; int8 with a scale per
token and head); the blocks, the block tables and every engine above them do not change.

The chapter 3 engine drives it through the same methods as ``ContiguousKVStore``; only the memory changes.
"""

from __future__ import annotations

import numpy as np

from .block_manager import BlockManager, blocks_needed
from ..loading.config import GPT2Config
from ..errors import CacheCapacityError, InvalidInputError, is_integer, is_real
from ..ch03_batching.kv_store import KVStore, claimed_zeros


class KVCodec:
    """How a paged pool keeps K/V. This one, chapter 4's, keeps float32 as computed: ``encode`` and ``decode`` hand
    back what they are given, so the pool is read and written directly (``identity``).

    A codec that keeps fewer bytes (chapter 6) sets ``dtype`` (one stored element), ``scaled`` (the pool then also
    keeps a float32 scale per token, head and K/V: ``[L, slots, 2, H]``) and ``identity = False``, and overrides
    ``encode`` and ``decode``."""

    name = "fp32"
    dtype = np.dtype(np.float32)  # what the pool holds, one element
    scaled = False  # True: a float32 scale per token, head and K/V beside the pool
    identity = True  # encode and decode change nothing: the store may read the pool as float32 K/V

    def encode(self, x):  # x [..., D] float32 -> (stored [..., D] of dtype, scales [...] float32 or None)
        return x, None

    def decode(self, stored, scales):  # stored [..., D] of dtype, scales [...] or None -> float32 [..., D]
        return stored  # the pool's own memory: a view stays a view, nothing copied

    def bytes_per_token(self, config: GPT2Config) -> int:
        """K and V of one token in every layer and head: D elements each, and its scale if ``scaled``."""
        return 2 * config.n_layer * config.n_kv_head * (config.head_dim * self.dtype.itemsize + 4 * self.scaled)


FP32 = KVCodec()  # the default: float32 K/V, as chapters 2 and 3 keep them


def check_codec(codec) -> None:
    if not isinstance(codec, KVCodec):
        raise InvalidInputError(f"codec must be a KVCodec (chapter 6 has fp16 and int8 ones), got {codec!r}")


def slot_indices(block_table, num_tokens: int, block_size: int) -> np.ndarray:
    """Pool slot of each logical position ``0 .. num_tokens-1`` of a sequence with ``block_table``: [num_tokens]."""
    table = np.asarray(block_table, dtype=np.int64)  # [num_blocks of the sequence]
    slots = table[:, None] * block_size + np.arange(block_size)  # [blocks, block_size]: each block's slots
    return slots.reshape(-1)[:num_tokens]  # [num_tokens] in position order


class PagedKVStore(KVStore):
    """K/V of many sequences in ``num_blocks`` blocks of ``block_size`` tokens, shared by all sequences, kept by
    ``codec`` (default ``FP32``: float32 as computed).

    ``update`` returns the sequence's K/V gathered into a scratch buffer owned by the store: the arrays are valid
    until the next ``update`` call (the model step uses them at once). Copy them to keep them.
    """

    def __init__(self, config: GPT2Config, num_blocks: int, block_size: int = 16, codec: KVCodec = FP32):
        check_codec(codec)
        self.manager = BlockManager(num_blocks, block_size)  # checks both counts
        num_blocks, block_size = self.manager.allocator.num_blocks, self.manager.block_size  # as Python ints
        self.config, self.codec, self.block_size, self.num_blocks = config, codec, block_size, num_blocks
        L, H, D = config.n_layer, config.n_kv_head, config.head_dim
        what = f"a paged KV pool of {num_blocks} blocks x {block_size} tokens in {codec.name} (lower num_blocks)"
        self.kv = claimed_zeros((L, num_blocks * block_size, 2, H, D), codec.dtype, what)  # [L, slots, K/V, H, D]
        self.scales = None  # [L, slots, K/V, H] float32, if the codec keeps scales
        if codec.scaled:
            self.scales = claimed_zeros((L, num_blocks * block_size, 2, H), np.float32, f"the scales of {what}")
        self.slots: dict[object, np.ndarray] = {}  # seq_id -> pool slot of each position it has room for
        self.written: dict[object, int] = {}  # seq_id -> positions written so far (0 .. written - 1)
        self._scratch = None  # the buffer of one gather (``_gather_buffer``), made on first use
        self.max_len = config.n_positions

    @classmethod
    def from_budget(cls, config: GPT2Config, budget_bytes: int, block_size: int = 16, codec: KVCodec = FP32):
        """As many blocks as fit in ``budget_bytes`` of K/V memory (``codec``'s bytes per token, scales counted)."""
        if not is_integer(block_size, 1):
            raise InvalidInputError(f"block_size must be a positive integer, got {block_size!r}")
        if not is_real(budget_bytes) or budget_bytes < 0:
            raise InvalidInputError(f"budget_bytes must be a finite number of bytes >= 0, got {budget_bytes!r}")
        check_codec(codec)
        per_block = codec.bytes_per_token(config) * int(block_size)
        num_blocks = int(budget_bytes // per_block)
        if num_blocks < 1:
            raise InvalidInputError(f"a KV budget of {budget_bytes:,} bytes holds no block of {block_size} "
                                    f"tokens in {codec.name} ({per_block:,} bytes each)")
        return cls(config, num_blocks, block_size, codec)

    def block_table(self, seq_id) -> list[int]:
        return self.manager.block_tables[seq_id]

    def _check_length(self, seq_id, num_tokens: int) -> None:
        if num_tokens > self.max_len:
            raise CacheCapacityError(f"sequence {seq_id!r} would need {num_tokens} tokens, past the context "
                                     f"n_ctx={self.max_len}")

    def _refresh_slots(self, seq_id) -> None:
        m = self.manager
        self.slots[seq_id] = slot_indices(m.block_tables[seq_id], m.num_tokens[seq_id], self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_len and self.manager.can_allocate(num_tokens)

    def allocate(self, seq_id, num_tokens: int) -> None:
        self._check_length(seq_id, num_tokens)
        self.manager.allocate(seq_id, num_tokens)
        self.written[seq_id] = 0
        self._refresh_slots(seq_id)

    def can_ensure(self, seq_id, num_tokens: int) -> bool:
        return num_tokens <= self.max_len and self.manager.can_ensure(seq_id, num_tokens)

    def ensure(self, seq_id, num_tokens: int) -> None:
        self._check_length(seq_id, num_tokens)
        if seq_id in self.slots and num_tokens <= len(self.slots[seq_id]):
            return  # room already there (asked twice); a decode step's one more token goes on below
        for src, dst in self.manager.ensure(seq_id, num_tokens):  # copy on write of a block shared with a fork
            self._copy_block(src, dst)
        self._refresh_slots(seq_id)

    def _copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        src, dst = slice(src * bs, (src + 1) * bs), slice(dst * bs, (dst + 1) * bs)
        self.kv[:, dst] = self.kv[:, src]
        if self.scales is not None:
            self.scales[:, dst] = self.scales[:, src]

    def write(self, layer: int, slots: np.ndarray, k, v) -> None:
        """Encode ``k, v`` [H, T, D] float32 into pool ``slots`` [T] of ``layer`` (fp32: stored as they are)."""
        for i, x in enumerate((k, v)):  # 0: K, 1: V
            stored, scales = self.codec.encode(x.transpose(1, 0, 2))  # [T, H, D], [T, H] or None
            self.kv[layer][slots, i] = stored
            if scales is not None:
                self.scales[layer][slots, i] = scales

    def scales_at(self, layer: int, slots):
        """The scales of pool ``slots`` (an index array or a slice) of ``layer``: [S, 2, H], or None if unscaled."""
        return None if self.scales is None else self.scales[layer][slots]

    def update(self, seq_id, layer: int, start: int, k, v):
        H, T, D = k.shape
        end = start + T
        slots = self.slots[seq_id]
        if start < 0:  # checked before anything is written: a negative index would pick slots from the end
            raise InvalidInputError(f"sequence {seq_id!r}: update at position {start}; positions start at 0")
        if end > len(slots):
            raise CacheCapacityError(f"sequence {seq_id!r}: position {end - 1} is past its {len(slots)} reserved "
                                     f"slots (call ensure first)")
        self.write(layer, slots[start:end], k, v)  # scatter the new tokens into their blocks
        self.written[seq_id] = max(self.written[seq_id], end)
        if self.codec.identity:  # float32 as stored: one gather into the scratch buffer, K and V in position order
            out = self._gather_buffer()[:end * 2 * H * D].reshape(end, 2, H, D)  # a view of the scratch buffer
            np.take(self.kv[layer], slots[:end], axis=0, out=out, mode="clip")
        else:  # gather what is stored, then decode it: a new float32 array [S, 2, H, D]
            out = self.codec.decode(self.kv[layer].take(slots[:end], axis=0), self.scales_at(layer, slots[:end]))
        return out[:, 0].transpose(1, 0, 2), out[:, 1].transpose(1, 0, 2)  # 2 x [H, S, D] (views)

    def _gather_buffer(self) -> np.ndarray:
        """The scratch for one gather, made on first use: room for K and V of ``max_len`` tokens, reused by every
        ``update`` (no allocation per call)."""
        if self._scratch is None:
            c = self.config
            self._scratch = np.empty(self.max_len * 2 * c.n_kv_head * c.head_dim, dtype=np.float32)
        return self._scratch

    def fork(self, parent, child) -> None:
        """``child`` starts as a copy of ``parent``'s tokens written so far, sharing their blocks; the first write
        to a shared block copies it (copy on write), so neither sees the other's new tokens. Room ``parent`` has
        reserved but not written yet stays its own."""
        if parent not in self.written:
            raise InvalidInputError(f"sequence {parent!r} has no KV to fork")
        self.manager.fork(parent, child, self.written[parent])
        self.written[child] = self.written[parent]
        self._refresh_slots(child)

    def free(self, seq_id) -> None:
        self.manager.free(seq_id)
        del self.slots[seq_id], self.written[seq_id]

    def reserved_tokens(self) -> int:
        return self.manager.num_used_blocks() * self.block_size

    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def max_tokens_per_seq(self) -> int:
        return min(self.capacity_tokens(), self.max_len)

    def read(self, seq_id, layer: int, num_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Float32 copies of ``seq_id``'s K and V [H, num_tokens, D] at ``layer`` (default: every position it has
        room for), decoded."""
        slots = self.slots[seq_id][:num_tokens]
        kv = self.codec.decode(self.kv[layer][slots], self.scales_at(layer, slots))  # [S, 2, H, D]
        return kv[:, 0].transpose(1, 0, 2).copy(), kv[:, 1].transpose(1, 0, 2).copy()

    def live_tokens(self) -> int:
        """Token positions that live sequences have asked room for (forked blocks counted once per sequence)."""
        return sum(self.manager.num_tokens.values())

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_needed(num_tokens, self.block_size)

    @property
    def bytes_per_token(self) -> int:
        return self.codec.bytes_per_token(self.config)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def check_invariants(self) -> None:
        self.manager.check_invariants()
        for seq_id, slots in self.slots.items():
            assert len(slots) == self.manager.num_tokens[seq_id], f"{seq_id!r}: slot map out of date"
