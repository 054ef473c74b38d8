"""Chapter 6: the KV cache in fewer bytes — codecs for chapter 4's paged store.

Chapter 4's ``PagedKVStore`` keeps its K/V through a codec (``KVCodec``: float32 as computed). This chapter hands
it two that keep fewer bytes:

* ``FP16Codec``: halves, 2 bytes an element, turned back into float32 as they are read.
* ``Int8Codec``: int8, and every token's K (and V) of every head has its own float32 scale, ``max|k| / 127`` over
  the head's D values (KIVI and vLLM's fp8 cache keep per-token or per-head scales for the same reason: a token's
  keys can be far larger than its neighbours'). A token costs ``2 x L x H x (D + 4)`` bytes against fp32's
  ``2 x L x H x D x 4``: 3.76x fewer for GPT-2's D = 64, scales counted.

The store quantizes new tokens as it writes them and decodes what attention reads: chapter 4's gather decodes the
whole history, chapter 5's paged attention one run of blocks at a time. Blocks, forks, copy on write, the prefix
cache and the budget arithmetic (``from_budget``, ``bytes_per_token``, ``nbytes``, scales counted) are the
chapters' own, unchanged: ``PrefixCachingKVStore(config, num_blocks, codec=Int8Codec())`` runs in chapter 5's
engine (``CachingLLMEngine(model, kv_codec=Int8Codec())``) and behind the server (``serve --kv-dtype int8``).
"""

from __future__ import annotations

import numpy as np

from ..loading.config import GPT2Config
from ..errors import InvalidInputError
from ..ch04_paged.paged_kv_store import KVCodec, PagedKVStore

KV_FORMATS = ("fp32", "fp16", "int8")


def quantize_kv(x):  # x [T, H, D] float32 -> q [T, H, D] int8, scale [T, H] float32
    """Symmetric int8 per token and head: each head's D values of a token share one scale."""
    scale = np.abs(x).max(axis=-1) / np.float32(127)  # [T, H]
    scale[scale == 0] = 1
    return np.rint(x / scale[..., None]).astype(np.int8), scale.astype(np.float32)


class FP16Codec(KVCodec):
    """K/V kept in half precision: 2 bytes an element, float32 again when read."""

    name, dtype, identity = "fp16", np.dtype(np.float16), False

    def encode(self, x):  # x [T, H, D] float32 -> (float16 [T, H, D], no scales)
        return x.astype(np.float16), None

    def decode(self, stored, scales):  # stored [..., D] float16 -> float32 [..., D]
        return stored.astype(np.float32)


class Int8Codec(KVCodec):
    """K/V kept in int8, with a float32 scale per token, head and K/V (``quantize_kv``): D + 4 bytes a head."""

    name, dtype, scaled, identity = "int8", np.dtype(np.int8), True, False

    def encode(self, x):  # x [T, H, D] float32 -> (int8 [T, H, D], scales [T, H] float32)
        return quantize_kv(x)

    def decode(self, stored, scales):  # stored [..., D] int8, scales [...] -> float32 [..., D]
        return stored * scales[..., None]


CODECS = {"fp32": KVCodec, "fp16": FP16Codec, "int8": Int8Codec}


def kv_codec(fmt: str) -> KVCodec:
    """The codec of KV format ``fmt`` (one of ``KV_FORMATS``)."""
    check_kv_format(fmt)
    return CODECS[fmt]()


def kv_bytes_per_token(config: GPT2Config, fmt: str) -> int:
    """Bytes of K and V per token (all layers and heads) in ``fmt``, scales included."""
    return kv_codec(fmt).bytes_per_token(config)


def paged_store(config: GPT2Config, fmt: str, budget_bytes: int, block_size: int = 16) -> PagedKVStore:
    """Chapter 4's paged store in ``fmt`` with as many blocks as fit in ``budget_bytes``."""
    return PagedKVStore.from_budget(config, budget_bytes, block_size, codec=kv_codec(fmt))


def check_kv_format(fmt) -> None:
    if fmt not in KV_FORMATS:
        raise InvalidInputError(f"KV format must be one of {', '.join(KV_FORMATS)}, got {fmt!r}")
