"""Chapter 3's model step: one forward pass over a *ragged* batch of many sequences' new tokens.

Each sequence in the batch contributes a chunk of new tokens: its whole prompt if it was just admitted
(prefill), or its one last sampled token (decode). All chunks are concatenated into one [N, E] matrix, so every
weight matmul is a single BLAS call that reads each weight once for all N tokens — no padding. Only attention is
per sequence, because each sequence attends to its own cached past, fetched from a ``KVStore``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .kv_cache import lm_head_fast
from .kv_store import KVStore
from .model import attention, layer_norm, linear, merge_heads, mlp, split_heads
from .weights import GPT2Model


@dataclass(frozen=True)
class Chunk:
    """New tokens of one sequence for this step, starting at position ``start`` (= tokens already cached)."""

    seq_id: object
    token_ids: np.ndarray  # [T] int64
    start: int


def ragged_forward(model: GPT2Model, store: KVStore, chunks: list[Chunk]) -> np.ndarray:
    """Run every chunk through the model in one pass; return the next-token logits of each chunk [B, V].

    The store must already have room for ``start + T`` tokens of every chunk (``KVStore.ensure``).
    """
    cfg, params = model.config, model.params
    lengths = [len(c.token_ids) for c in chunks]
    ends = np.cumsum(lengths)  # [B] row after each chunk's last token
    spans = [(int(e - t), int(e)) for e, t in zip(ends, lengths)]
    token_ids = np.concatenate([c.token_ids for c in chunks])  # [N]
    positions = np.concatenate([np.arange(c.start, c.start + t) for c, t in zip(chunks, lengths)])  # [N]
    x = params["wte"][token_ids] + params["wpe"][positions]  # [N, E]
    eps, H = cfg.layer_norm_epsilon, cfg.n_head
    for layer, p in enumerate(params["h"]):
        qkv = linear(layer_norm(x, **p["ln_1"], eps=eps), **p["attn"]["c_attn"])  # [N, 3E]: one matmul for all
        out = np.empty_like(x)  # [N, E]
        for chunk, (a, b) in zip(chunks, spans):
            q, k, v = (split_heads(m, H) for m in np.split(qkv[a:b], 3, axis=-1))  # 3 x [H, T, D]
            k_all, v_all = store.update(chunk.seq_id, layer, chunk.start, k, v)  # [H, start + T, D]
            out[a:b] = merge_heads(attention(q, k_all, v_all))  # [T, E]
        x = x + linear(out, **p["attn"]["c_proj"])  # [N, E]
        x = x + mlp(layer_norm(x, **p["ln_2"], eps=eps), p["mlp"])  # [N, E]
    return lm_head_fast(model, x[ends - 1])  # [B, V]: only each chunk's last position needs logits
