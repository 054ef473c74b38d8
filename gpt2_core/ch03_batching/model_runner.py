"""Chapter 3's model step: one forward pass over a *ragged* batch of many sequences' new tokens.

Each sequence in the batch contributes a chunk of new tokens: its whole prompt if it was just admitted
(prefill), or its one last sampled token (decode). All chunks are concatenated into one [N, E] matrix, so every
weight matmul reads each weight once for all N tokens, with no padding. Only attention is per sequence, because
each sequence attends to its own cached past, fetched from a ``KVStore``. Every other function is chapter 1's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .kv_store import KVStore
from ..ch01_forward.model import attention, layer_norm, linear, lm_head, mlp, split_qkv
from ..loading.weights import GPT2Model


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
    x = embed_chunks(params, chunks)  # [N, E]: every chunk's rows, one after another
    x = ragged_transformer(params["h"], x, chunks, store, cfg.n_head, cfg.layer_norm_epsilon)  # [N, E]
    ends = np.cumsum([len(c.token_ids) for c in chunks])  # [B] row after each chunk's last token
    return lm_head(params, x[ends - 1], cfg.layer_norm_epsilon)  # [B, V]: each chunk's last position


def embed_chunks(params: dict, chunks: list[Chunk]) -> np.ndarray:
    """Chapter 1's ``embed`` of every chunk at its own positions, the chunks' rows one after another: [N, E]."""
    token_ids = np.concatenate([c.token_ids for c in chunks])  # [N]
    positions = np.concatenate([np.arange(c.start, c.start + len(c.token_ids)) for c in chunks])  # [N]
    return params["wte"][token_ids] + params["wpe"][positions]  # [N, E]


def ragged_transformer(blocks: list, x: np.ndarray, chunks: list[Chunk], store: KVStore, n_head: int,
                       eps: float) -> np.ndarray:
    """Every block over the ragged batch ``x`` [N, E]: the weight matmuls on all rows at once, attention per
    chunk against its own sequence's K/V in ``store``. Returns [N, E] (``x`` is updated in place)."""
    ends = np.cumsum([len(c.token_ids) for c in chunks])  # [B] row after each chunk's last token
    spans = [(int(e - len(c.token_ids)), int(e)) for e, c in zip(ends, chunks)]  # each chunk's rows a .. b-1
    for layer, p in enumerate(blocks):
        qkv = linear(layer_norm(x, **p["ln_1"], eps=eps), **p["attn"]["c_attn"])  # [N, 3E]: all rows at once
        q, k, v = split_qkv(qkv, n_head)  # 3 x [H, N, D] views, no copy
        H, N, D = q.shape
        q_scaled = q * np.float32(1 / np.sqrt(D))  # [H, N, D] for the decode rows, scaled once for all of them
        out = np.empty((N, H, D), dtype=x.dtype)  # [N, H, D]
        for chunk, (a, b) in zip(chunks, spans):  # attention: each sequence against its own cache
            if b - a == 1:  # decode: one query sees every cached key, no mask needed; the store reads them
                out[a] = store.attend_decode(chunk.seq_id, layer, chunk.start, q_scaled[:, a:b], k[:, a:b],
                                             v[:, a:b])[:, 0]  # [H, D]
            else:  # prefill: chapter 1's causal attention over everything cached
                k_all, v_all = store.update(chunk.seq_id, layer, chunk.start, k[:, a:b], v[:, a:b])  # [H, start+T, D]
                out[a:b] = attention(q[:, a:b], k_all, v_all).transpose(1, 0, 2)  # [T, H, D]
        x += linear(out.reshape(N, H * D), **p["attn"]["c_proj"])  # [N, E] residual
        x += mlp(layer_norm(x, **p["ln_2"], eps=eps), p["mlp"])  # [N, E]
    return x
