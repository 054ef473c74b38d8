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
from ..errors import InvalidInputError
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
    lengths = [len(c.token_ids) for c in chunks]
    ends = np.cumsum(lengths)  # [B] row after each chunk's last token
    spans = [(int(e - t), int(e)) for e, t in zip(ends, lengths)]  # each chunk's rows a .. b-1
    token_ids = np.concatenate([c.token_ids for c in chunks])  # [N]
    positions = np.concatenate([np.arange(c.start, c.start + t) for c, t in zip(chunks, lengths)])  # [N]
    x = params["wte"][token_ids] + params["wpe"][positions]  # [N, E]
    eps, H, D = cfg.layer_norm_epsilon, cfg.n_head, cfg.head_dim
    scale = np.float32(1 / np.sqrt(D))
    for layer, p in enumerate(params["h"]):
        qkv = linear(layer_norm(x, **p["ln_1"], eps=eps), **p["attn"]["c_attn"])  # [N, 3E]: all rows at once
        q, k, v = split_qkv(qkv, H)  # 3 x [H, N, D] views, no copy
        q_scaled = q * scale  # [H, N, D] for the decode rows, scaled once for all of them
        out = np.empty((len(x), H, D), dtype=x.dtype)  # [N, H, D]
        for chunk, (a, b) in zip(chunks, spans):  # attention: each sequence against its own cache
            if b - a == 1:  # decode: one query sees every cached key, no mask needed; the store reads them
                out[a] = store.attend_decode(chunk.seq_id, layer, chunk.start, q_scaled[:, a:b], k[:, a:b],
                                             v[:, a:b])[:, 0]  # [H, D]
            else:  # prefill: chapter 1's causal attention over everything cached
                k_all, v_all = store.update(chunk.seq_id, layer, chunk.start, k[:, a:b], v[:, a:b])  # [H, start+T, D]
                out[a:b] = attention(q[:, a:b], k_all, v_all).transpose(1, 0, 2)  # [T, H, D]
        x += linear(out.reshape(len(x), H * D), **p["attn"]["c_proj"])  # [N, E] residual
        x += mlp(layer_norm(x, **p["ln_2"], eps=eps), p["mlp"])  # [N, E]
    return lm_head(params, x[ends - 1], eps)  # [B, V]: each chunk's last position


# The model step of each architecture, by the name its config gives (``config.architecture``). The engines call
# ``model_step``, never one architecture's forward: this chapter registers GPT-2's, a later one adds its own
# (chapter 9: Llama), and no engine changes. vLLM's ``ModelRegistry`` maps a checkpoint's architecture to its code
# the same way.
MODEL_STEPS: dict = {"gpt2": ragged_forward}


def model_step(model, store: KVStore, chunks: list[Chunk]) -> np.ndarray:
    """The ``ragged_forward`` of the model's architecture: every chunk in one pass, the next-token logits [B, V]."""
    arch = getattr(model.config, "architecture", "gpt2")
    if arch not in MODEL_STEPS:
        raise InvalidInputError(f"no model step for architecture {arch!r} (known: {', '.join(MODEL_STEPS)}); "
                                f"import the chapter that runs it")
    return MODEL_STEPS[arch](model, store, chunks)
