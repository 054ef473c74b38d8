"""Where the K/V of many sequences live: the interface the chapter 3 engine talks to, and a contiguous store.

The engine never touches cache arrays itself. It asks the store to make room for a sequence's tokens
(``allocate`` / ``ensure``), hands it each layer's new K/V (``update``, which returns everything cached for that
sequence so far), and ``free``s a finished sequence. Chapter 3 keeps every sequence in a contiguous slot
preallocated to ``max_len`` tokens; chapter 4 swaps in a paged store with the same methods, and the engine does
not change.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np

from ..loading.config import GPT2Config
from ..errors import CacheCapacityError, InvalidInputError, is_integer
from ..ch02_kv_cache.kv_cache import kv_cache_bytes
from ..loading.memory import available_memory_bytes
from ..ch01_forward.model import decode_attention


def claimed_zeros(shape, dtype, what: str) -> np.ndarray:
    """A zero-filled array whose memory is really taken now, not bit by bit as it is first written.

    ``np.zeros`` gets fresh pages from the operating system, which maps them only when they are first written:
    the model steps that first fill each slot of a store would stop for those page faults, in the middle of
    serving. vLLM also allocates its whole KV cache up front; writing every byte here moves the cost to the store's
    construction. The memory must then exist: a store larger than the memory available (when the system says
    how much that is: ``memory.available_memory_bytes``) is refused with its size, ``what`` describing it.
    """
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    available = available_memory_bytes()
    if available is not None and nbytes > available:
        raise CacheCapacityError(f"{what} needs {nbytes / 2**20:,.1f} MiB, but only {available / 2**20:,.1f} MiB "
                                 f"of memory is available")
    array = np.empty(shape, dtype=dtype)
    array.fill(0)  # touches every page
    return array


class KVStore(ABC):
    """K/V storage for many sequences, addressed by ``seq_id``."""

    config: GPT2Config

    @abstractmethod
    def can_allocate(self, num_tokens: int) -> bool:
        """Could a new sequence get room for ``num_tokens`` tokens right now?"""

    @abstractmethod
    def allocate(self, seq_id, num_tokens: int) -> None:
        """Give a new sequence room for ``num_tokens`` tokens; ``CacheCapacityError`` if there is none."""

    @abstractmethod
    def can_ensure(self, seq_id, num_tokens: int) -> bool:
        """Could ``seq_id`` grow to hold ``num_tokens`` tokens in total?"""

    @abstractmethod
    def ensure(self, seq_id, num_tokens: int) -> None:
        """Grow ``seq_id``'s room to ``num_tokens`` tokens in total; ``CacheCapacityError`` if impossible."""

    @abstractmethod
    def update(self, seq_id, layer: int, start: int, k: np.ndarray, v: np.ndarray):
        """Write ``k, v`` [H, T, D] at positions ``start .. start+T-1``; return all K, V so far [H, start+T, D]."""

    def attend_decode(self, seq_id, layer: int, start: int, q: np.ndarray, k: np.ndarray, v: np.ndarray):
        """One decoding token: write its ``k, v`` [H, 1, D] at position ``start``, then attend its query ``q``
        [H, 1, D] (already scaled by 1/sqrt(D)) to every cached position 0 .. start: [H, 1, D]. Here ``update``
        hands back the cache as [H, start+1, D] arrays and chapter 1's ``decode_attention`` reads them; a store may
        read its memory where it lies instead (chapter 5's paged attention)."""
        return decode_attention(q, *self.update(seq_id, layer, start, k, v))

    def attend_decodes(self, seq_ids: list, layer: int, starts: list[int], q: np.ndarray, k: np.ndarray,
                       v: np.ndarray) -> np.ndarray:
        """Every decoding token of a step in one call: column ``i`` of ``q, k, v`` [H, B, D] belongs to sequence
        ``seq_ids[i]`` at position ``starts[i]``; -> [H, B, D]. Here one ``attend_decode`` per sequence; a store
        may attend them all in one pass (the appendix's ``SlotAttentionKVStore``: one kernel call per layer)."""
        out = np.empty_like(q)  # [H, B, D]
        for i, (seq_id, start) in enumerate(zip(seq_ids, starts)):
            out[:, i:i + 1] = self.attend_decode(seq_id, layer, start, q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1])
        return out

    @abstractmethod
    def free(self, seq_id) -> None:
        """Release everything ``seq_id`` holds. Freeing an unknown sequence is an error."""

    @abstractmethod
    def reserved_tokens(self) -> int:
        """Token positions currently set aside for live sequences (used or not)."""

    @abstractmethod
    def capacity_tokens(self) -> int:
        """Token positions the whole store can hold."""

    def max_tokens_per_seq(self) -> int:
        """The most tokens one sequence could ever hold, alone in an empty store (a longer request can never run)."""
        return self.capacity_tokens()

    @property
    def bytes_per_token(self) -> int:
        return kv_cache_bytes(self.config, 1, self.dtype)

    def usage(self) -> float:
        """Fraction of the store reserved by live sequences (vLLM's ``kv_cache_usage``)."""
        return self.reserved_tokens() / self.capacity_tokens()


class ContiguousKVStore(KVStore):
    """One preallocated slot of ``max_len`` tokens per sequence, ``num_slots`` slots in all.

    Simple and fast (a sequence's K/V are one contiguous slice), but a sequence that ends after 20 tokens still
    reserved ``max_len``: the waste chapter 4 measures and removes.
    """

    def __init__(self, config: GPT2Config, num_slots: int, max_len: int | None = None, dtype=np.float32):
        max_len = config.n_positions if max_len is None else max_len
        if not is_integer(max_len, 1, config.n_positions):
            raise InvalidInputError(f"max_len must be an integer in [1, n_ctx={config.n_positions}], got {max_len!r}")
        if not is_integer(num_slots, 1):
            raise InvalidInputError(f"num_slots must be a positive integer, got {num_slots!r}")
        max_len, num_slots = int(max_len), int(num_slots)
        self.config, self.dtype, self.max_len, self.num_slots = config, np.dtype(dtype), max_len, num_slots
        shape = (num_slots, config.n_layer, config.n_kv_head, max_len, config.head_dim)  # [slots, L, H, max_len, D]
        kv = claimed_zeros((2, *shape), dtype, f"a contiguous KV store of {num_slots} slots x max_len={max_len} tokens "
                                               f"(lower the slots, max_num_seqs in the engine, or max_len)")
        self.k, self.v = kv[0], kv[1]  # K and V, taken now, all of it
        self.free_slots = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 is handed out first
        self.slot_of: dict = {}

    def can_allocate(self, num_tokens: int) -> bool:
        return bool(self.free_slots) and num_tokens <= self.max_len

    def allocate(self, seq_id, num_tokens: int) -> None:
        if seq_id in self.slot_of:
            raise InvalidInputError(f"sequence {seq_id!r} already has a KV slot")
        if num_tokens > self.max_len:
            raise CacheCapacityError(f"sequence {seq_id!r} needs {num_tokens} tokens, a slot holds max_len="
                                     f"{self.max_len}")
        if not self.free_slots:
            raise CacheCapacityError(f"no free KV slot for sequence {seq_id!r} (all {self.num_slots} in use)")
        self.slot_of[seq_id] = self.free_slots.pop()

    def can_ensure(self, seq_id, num_tokens: int) -> bool:
        return seq_id in self.slot_of and num_tokens <= self.max_len

    def ensure(self, seq_id, num_tokens: int) -> None:
        if seq_id not in self.slot_of:
            raise InvalidInputError(f"sequence {seq_id!r} has no KV slot")
        if num_tokens > self.max_len:
            raise CacheCapacityError(f"sequence {seq_id!r} would need {num_tokens} tokens, its slot holds "
                                     f"max_len={self.max_len}")

    def update(self, seq_id, layer: int, start: int, k, v):
        slot, end = self.slot_of[seq_id], start + k.shape[1]
        if start < 0:  # a negative index would write at the slot's far end
            raise InvalidInputError(f"sequence {seq_id!r}: update at position {start}; positions start at 0")
        if end > self.max_len:
            raise CacheCapacityError(f"sequence {seq_id!r}: position {end - 1} is past its slot of {self.max_len}")
        self.k[slot, layer, :, start:end] = k
        self.v[slot, layer, :, start:end] = v
        return self.k[slot, layer, :, :end], self.v[slot, layer, :, :end]

    def free(self, seq_id) -> None:
        if seq_id not in self.slot_of:
            raise InvalidInputError(f"sequence {seq_id!r} has no KV slot to free")
        self.free_slots.append(self.slot_of.pop(seq_id))

    def reserved_tokens(self) -> int:
        return len(self.slot_of) * self.max_len

    def capacity_tokens(self) -> int:
        return self.num_slots * self.max_len

    def max_tokens_per_seq(self) -> int:
        return self.max_len

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
