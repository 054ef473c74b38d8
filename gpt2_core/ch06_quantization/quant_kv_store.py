"""Chapter 6: the KV cache in fewer bytes, behind chapter 3's ``KVStore`` interface.

* ``fp16``: chapter 4's ``PagedKVStore`` with ``dtype=np.float16`` — nothing new: the pool holds halves, 2 bytes
  an element, and attention computes in float32 on what it gathers.
* ``int8``: ``Int8PagedKVStore`` below: the pool holds int8, and every token's K (and V) of every head has its own
  float32 scale, ``max|k| / 127`` over the head's D values (KIVI and vLLM's fp8 cache keep per-token or per-head
  scales for the same reason: a token's keys can be far larger than its neighbours'). A token costs
  ``2 x L x H x (D + 4)`` bytes against fp32's ``2 x L x H x D x 4``: 3.76x fewer for GPT-2's D = 64, scales
  counted.

``update`` quantizes the new tokens as it writes them and hands back float32 K/V, so the engine, the scheduler and
the attention code run unchanged; only the store knows its bytes are int8. The budget arithmetic
(``from_budget``, ``bytes_per_token``, ``nbytes``) counts the scales.
"""

from __future__ import annotations

import numpy as np

from ..loading.config import GPT2Config
from ..errors import CacheCapacityError, InvalidInputError, is_integer, is_real
from ..ch03_batching.kv_store import KVStore, claimed_zeros
from ..ch04_paged.paged_kv_store import PagedKVStore

KV_FORMATS = ("fp32", "fp16", "int8")


def quantize_kv(x):  # x [T, H, D] float32 -> q [T, H, D] int8, scale [T, H] float32
    """Symmetric int8 per token and head: each head's D values of a token share one scale."""
    scale = np.abs(x).max(axis=-1) / np.float32(127)  # [T, H]
    scale[scale == 0] = 1
    return np.rint(x / scale[..., None]).astype(np.int8), scale.astype(np.float32)


class Int8PagedKVStore(PagedKVStore):
    """Chapter 4's paged store with an int8 pool ``[L, slots, 2, H, D]`` and float32 scales ``[L, slots, 2, H]``.

    The block manager, block tables, forks and copy on write are chapter 4's; ``update`` gathers a sequence's
    int8 K/V and scales and returns them dequantized, in a float32 scratch buffer (valid until the next call)."""

    def __init__(self, config: GPT2Config, num_blocks: int, block_size: int = 16):
        super().__init__(config, num_blocks, block_size, dtype=np.int8)
        L, H = config.n_layer, config.n_kv_head
        self.scales = claimed_zeros((L, self.num_blocks * self.block_size, 2, H), np.float32,
                                    f"the scales of an int8 KV pool of {self.num_blocks} blocks (lower num_blocks)")

    @staticmethod
    def token_bytes(config: GPT2Config) -> int:
        """K and V of one token in every layer and head: D int8 values and one float32 scale each."""
        return 2 * config.n_layer * config.n_kv_head * (config.head_dim + 4)

    @classmethod
    def from_budget(cls, config: GPT2Config, budget_bytes: int, block_size: int = 16):
        """As many blocks as fit in ``budget_bytes``, scales included."""
        if not is_integer(block_size, 1):
            raise InvalidInputError(f"block_size must be a positive integer, got {block_size!r}")
        if not is_real(budget_bytes) or budget_bytes < 0:
            raise InvalidInputError(f"budget_bytes must be a finite number of bytes >= 0, got {budget_bytes!r}")
        per_block = cls.token_bytes(config) * block_size
        if budget_bytes < per_block:
            raise InvalidInputError(f"a KV budget of {budget_bytes:,} bytes holds no int8 block of {block_size} "
                                    f"tokens ({per_block:,} bytes each)")
        return cls(config, int(budget_bytes // per_block), block_size)

    @property
    def bytes_per_token(self) -> int:
        return self.token_bytes(self.config)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.scales.nbytes

    def _copy_block(self, src: int, dst: int) -> None:
        super()._copy_block(src, dst)
        bs = self.block_size
        self.scales[:, dst * bs:(dst + 1) * bs] = self.scales[:, src * bs:(src + 1) * bs]

    def update(self, seq_id, layer: int, start: int, k, v):  # k, v [H, T, D] -> K, V so far [H, start+T, D] f32
        H, T, D = k.shape
        end = start + T
        slots = self.slots[seq_id]
        if start < 0:
            raise InvalidInputError(f"sequence {seq_id!r}: update at position {start}; positions start at 0")
        if end > len(slots):
            raise CacheCapacityError(f"sequence {seq_id!r}: position {end - 1} is past its {len(slots)} reserved "
                                     f"slots (call ensure first)")
        new = slots[start:end]
        for i, x in enumerate((k, v)):  # 0: K, 1: V
            q, scale = quantize_kv(x.transpose(1, 0, 2))  # [T, H, D], [T, H]
            self.kv[layer][new, i] = q
            self.scales[layer][new, i] = scale
        self.written[seq_id] = max(self.written[seq_id], end)
        kv = self.kv[layer].take(slots[:end], axis=0)  # [S, 2, H, D] int8
        out = self._gather_buffer()[:end * 2 * H * D].reshape(end, 2, H, D)  # float32 scratch
        np.multiply(kv, self.scales[layer].take(slots[:end], axis=0)[..., None], out=out)  # dequantized
        return out[:, 0].transpose(1, 0, 2), out[:, 1].transpose(1, 0, 2)  # 2 x [H, S, D] (views)

    def _gather_buffer(self) -> np.ndarray:
        if self._scratch is None:
            c = self.config
            self._scratch = np.empty(self.max_len * 2 * c.n_kv_head * c.head_dim, dtype=np.float32)
        return self._scratch

    def read(self, seq_id, layer: int, num_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Dequantized copies of ``seq_id``'s K and V [H, num_tokens, D] at ``layer``."""
        slots = self.slots[seq_id][:num_tokens]
        kv = self.kv[layer][slots] * self.scales[layer][slots][..., None]  # [S, 2, H, D] float32
        return kv[:, 0].transpose(1, 0, 2).copy(), kv[:, 1].transpose(1, 0, 2).copy()


def kv_bytes_per_token(config: GPT2Config, fmt: str) -> int:
    """Bytes of K and V per token (all layers and heads) in ``fmt``, scales included."""
    check_kv_format(fmt)
    if fmt == "int8":
        return Int8PagedKVStore.token_bytes(config)
    return 2 * config.n_layer * config.n_kv_head * config.head_dim * (4 if fmt == "fp32" else 2)


def paged_store(config: GPT2Config, fmt: str, budget_bytes: int, block_size: int = 16) -> KVStore:
    """A paged KV store in ``fmt`` with as many blocks as fit in ``budget_bytes``."""
    check_kv_format(fmt)
    if fmt == "int8":
        return Int8PagedKVStore.from_budget(config, budget_bytes, block_size)
    return PagedKVStore.from_budget(config, budget_bytes, block_size, dtype=np.float32 if fmt == "fp32" else np.float16)


def check_kv_format(fmt) -> None:
    if fmt not in KV_FORMATS:
        raise InvalidInputError(f"KV format must be one of {', '.join(KV_FORMATS)}, got {fmt!r}")
