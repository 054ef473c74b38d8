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


@dataclass(frozen=True)
class RaggedLayout:
    """Where each chunk's tokens sit in the step's [N, E] matrix: the rows' token ids and positions, each chunk's
    span of rows, and the row whose logits give each chunk's next token."""

    token_ids: np.ndarray  # [N] every chunk's new tokens, one chunk after another
    positions: np.ndarray  # [N] each row's position in its own sequence (chunk.start, chunk.start + 1, ...)
    spans: list  # [(a, b)] per chunk: its rows are a .. b-1
    last_rows: np.ndarray  # [B] each chunk's last row: the one whose logits are sampled


def ragged_layout(chunks: list[Chunk]) -> RaggedLayout:
    """The row bookkeeping of a ragged step: chunks of T_1, T_2, ... tokens become rows 0 .. T_1-1, then
    T_1 .. T_1+T_2-1, and so on, with no padding."""
    lengths = [len(c.token_ids) for c in chunks]
    ends = np.cumsum(lengths, dtype=np.int64)  # [B] row after each chunk's last token
    spans = [(int(e - t), int(e)) for e, t in zip(ends, lengths)]  # each chunk's rows a .. b-1
    token_ids = np.concatenate([c.token_ids for c in chunks]).astype(np.int64)  # [N]
    positions = np.concatenate([np.arange(c.start, c.start + t) for c, t in zip(chunks, lengths)])  # [N]
    return RaggedLayout(token_ids, positions.astype(np.int64), spans, ends - 1)


def ragged_forward(model: GPT2Model, store: KVStore, chunks: list[Chunk], logits_indices=None) -> np.ndarray:
    """Run every chunk through the model in one pass; return the next-token logits of each chunk [B, V].

    The store must already have room for ``start + T`` tokens of every chunk (``KVStore.ensure``).
    ``logits_indices`` [R]: the rows of the [N, E] batch to return logits for instead, [R, V] (vLLM's name; the
    LM head is the step's largest matmul, so only the rows a caller samples from go through it).
    """
    cfg, params = model.config, model.params
    rows = ragged_layout(chunks)  # token ids, positions, each chunk's span of rows and its last row
    x = params["wte"][rows.token_ids] + params["wpe"][rows.positions]  # [N, E]: chapter 1's embed, row by row
    x = ragged_transformer(params["h"], x, chunks, store, cfg.n_head, cfg.layer_norm_epsilon)  # [N, E]
    picked = rows.last_rows if logits_indices is None else np.asarray(logits_indices, dtype=np.int64)
    return lm_head(params, x[picked], cfg.layer_norm_epsilon)  # [B, V]: each chunk's last position (or [R, V])


def embed_chunks(params: dict, chunks: list[Chunk]) -> np.ndarray:
    """Chapter 1's ``embed`` of every chunk at its own positions, the chunks' rows one after another: [N, E]."""
    rows = ragged_layout(chunks)
    return params["wte"][rows.token_ids] + params["wpe"][rows.positions]  # [N, E]


def ragged_transformer(blocks: list, x: np.ndarray, chunks: list[Chunk], store: KVStore, n_head: int,
                       eps: float) -> np.ndarray:
    """Every block over the ragged batch ``x`` [N, E]: the weight matmuls on all rows at once, attention per
    chunk against its own sequence's K/V in ``store``. Returns [N, E] (``x`` is updated in place)."""
    spans = ragged_layout(chunks).spans  # each chunk's rows a .. b-1
    decode = [i for i, (a, b) in enumerate(spans) if b - a == 1]  # chunks of one new token: decoding sequences
    rows = np.array([spans[i][0] for i in decode], dtype=np.int64)  # [B] their rows
    seq_ids, starts = [chunks[i].seq_id for i in decode], [chunks[i].start for i in decode]
    for layer, p in enumerate(blocks):
        qkv = linear(layer_norm(x, **p["ln_1"], eps=eps), **p["attn"]["c_attn"])  # [N, 3E]: all rows at once
        q, k, v = split_qkv(qkv, n_head)  # 3 x [H, N, D] views, no copy
        H, N, D = q.shape
        out = np.empty((N, H, D), dtype=x.dtype)  # [N, H, D]
        if decode:  # each query sees every cached key, no mask needed: the store attends them all in one call
            q_decode = q[:, rows] * np.float32(1 / np.sqrt(D))  # [H, B, D], scaled once for all of them
            attended = store.attend_decodes(seq_ids, layer, starts, q_decode, k[:, rows], v[:, rows])  # [H, B, D]
            out[rows] = attended.transpose(1, 0, 2)  # [B, H, D]
        for chunk, (a, b) in zip(chunks, spans):  # prefill: chapter 1's causal attention over everything cached
            if b - a != 1:
                k_all, v_all = store.update(chunk.seq_id, layer, chunk.start, k[:, a:b], v[:, a:b])  # [H, start+T, D]
                out[a:b] = attention(q[:, a:b], k_all, v_all).transpose(1, 0, 2)  # [T, H, D]
        x += linear(out.reshape(N, H * D), **p["attn"]["c_proj"])  # [N, E] residual
        x += mlp(layer_norm(x, **p["ln_2"], eps=eps), p["mlp"])  # [N, E]
    return x


# The model step of each architecture, by the name its config gives (``config.architecture``). The engines call
# ``model_step``, never one architecture's forward: this chapter registers GPT-2's, a later one adds its own
# (chapter 9: Llama), and no engine changes. vLLM's ``ModelRegistry`` maps a checkpoint's architecture to its code
# the same way.
MODEL_STEPS: dict = {"gpt2": ragged_forward}


def model_step(model, store: KVStore, chunks: list[Chunk], logits_indices=None) -> np.ndarray:
    """The ``ragged_forward`` of the model's architecture: every chunk in one pass, the next-token logits [B, V]
    (or [R, V] for the rows ``logits_indices`` names)."""
    arch = getattr(model.config, "architecture", "gpt2")
    if arch not in MODEL_STEPS:
        raise InvalidInputError(f"no model step for architecture {arch!r} (known: {', '.join(MODEL_STEPS)}); "
                                f"import the chapter that runs it")
    if logits_indices is None:
        return MODEL_STEPS[arch](model, store, chunks)
    return MODEL_STEPS[arch](model, store, chunks, logits_indices=logits_indices)
