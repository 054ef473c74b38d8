"""Chapter 9: a modern model. Chapter 1's forward pass with four swaps, each a small function beside the one it
replaces, and the engine of chapters 3 to 5 running it unchanged.

============================  ==================================  ===========================================
chapter 1 (GPT-2)             chapter 9 (Llama: SmolLM2-135M)      why
============================  ==================================  ===========================================
``layer_norm``                ``rms_norm``                         no mean, no bias: one reduction fewer
``wpe`` (learned positions)   ``rope`` on q and k                  position is an angle; only *relative*
                                                                   positions reach the scores
``mlp`` (GELU)                ``swiglu``                           a gate: ``silu(x Wg) * (x Wu)``, then down
``attention`` (multi-head)    ``grouped_query_attention``          9 query heads share 3 K/V heads: a KV
                                                                   cache 3x smaller
============================  ==================================  ===========================================

Shapes: T tokens, E = n_embd, H = n_head query heads, H_kv = n_kv_head key/value heads, G = H // H_kv query heads
per K/V head, D = head_dim, F = intermediate_size, V = vocab_size. Parameters are named as in the GGUF file
(``params["blk"][i]["attn_q"]``), matrices ``[in, out]`` as in chapter 1 (``loading.llama`` transposes them).
Everything stays float32 (chapter 1's rule: a float64 constant would promote every matmul).
"""

from __future__ import annotations

from functools import partial

import numpy as np

from ..ch01_forward.model import attention, merge_heads, split_heads
from ..ch02_kv_cache.kv_cache import CACHED_FORWARDS, KVCache
from ..ch02_kv_cache.kv_cache import generate, generate_stream  # noqa: F401  chapter 2's loop runs this model (below)
from ..ch03_batching.model_runner import MODEL_STEPS, Chunk
from ..errors import CacheCapacityError, InvalidInputError
from ..loading.llama import LlamaModel


# -- the four swaps --------------------------------------------------------------------------------------------------


def rms_norm(x, weight, eps):  # x [T, E]; weight [E] -> [T, E]           (replaces layer_norm)
    """Each row divided by its root mean square, then scaled by ``weight``: LayerNorm without subtracting the
    mean and without a bias (Zhang & Sennrich 2019)."""
    mean_square = (x * x).mean(axis=-1, keepdims=True)  # [T, 1]
    return weight * (x / np.sqrt(mean_square + np.float32(eps)))  # [T, E]


def silu(x):  # x * sigmoid(x), written with tanh so that no exp() can overflow for very negative x
    return x * (np.float32(0.5) + np.float32(0.5) * np.tanh(np.float32(0.5) * x))


def swiglu(x, p):  # x [T, E] -> [T, E]                                    (replaces mlp)
    """The gated MLP (Shazeer 2020): ``down(silu(gate(x)) * up(x))``. Three matrices instead of two, so F = 1536 is
    ~8/3 E, not 4E: about the parameters of GPT-2's MLP."""
    return (silu(x @ p["ffn_gate"]) * (x @ p["ffn_up"])) @ p["ffn_down"]  # [T, F] * [T, F] -> [T, E]


def rope_angles(positions, head_dim: int, theta: float):  # positions [T] -> cos, sin [T, D/2]
    """The rotation angle of every position and frequency: ``position * theta^(-2i/D)`` for i = 0 .. D/2 - 1.
    Pair i turns fast for small i and slowly for large i, like the hands of a clock (Su et al. 2021)."""
    inv_freq = np.float32(1) / np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)  # [D/2]
    angles = np.asarray(positions, dtype=np.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    return np.cos(angles), np.sin(angles)


def rope(x, cos, sin):  # x [H, T, D]; cos, sin [T, D/2] -> [H, T, D]       (replaces wpe)
    """Rotate each pair (x[i], x[i + D/2]) of every head by its angle. Applied to q and k, the score q.k then
    depends on the two positions only through their difference."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # [H, T, D/2] each
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)  # [H, T, D]


def grouped_query_attention(q, k, v):  # q [H, T, D]; k, v [H_kv, S, D] -> [H, T, D]   (replaces attention's heads)
    """Each K/V head serves G = H // H_kv consecutive query heads (Ainslie et al. 2023): repeat it G times and it
    is chapter 1's causal attention. Only H_kv heads are computed and cached."""
    G = q.shape[0] // k.shape[0]
    return attention(q, np.repeat(k, G, axis=0), np.repeat(v, G, axis=0))  # K/V head j -> query heads jG .. jG+G-1


# -- the block and the model: chapter 1's, with the swaps --------------------------------------------------------


def project_qkv(x, p, cfg, cos, sin):  # x [T, E] -> q [H, T, D], k, v [H_kv, T, D]
    q = rope(split_heads(x @ p["attn_q"], cfg.n_head), cos, sin)  # positions enter here, not at the embedding
    k = rope(split_heads(x @ p["attn_k"], cfg.n_kv_head), cos, sin)
    v = split_heads(x @ p["attn_v"], cfg.n_kv_head)  # values are not rotated
    return q, k, v


def block(x, p, cfg, cos, sin, attend=grouped_query_attention):  # x [T, E] -> [T, E]
    """One pre-norm block. ``attend(q, k, v)`` is the attention: over these tokens only (the default), or over a
    KV cache or an engine's store (which is all that changes in the cached and batched versions below)."""
    q, k, v = project_qkv(rms_norm(x, p["attn_norm"], cfg.rms_norm_eps), p, cfg, cos, sin)
    x = x + merge_heads(attend(q, k, v)) @ p["attn_output"]  # [T, E]
    return x + swiglu(rms_norm(x, p["ffn_norm"], cfg.rms_norm_eps), p)  # [T, E]


def lm_head(params, x, eps):  # x [T, E] -> logits [T, V]
    head = params.get("output", params["token_embd"])  # SmolLM2 ties it to the token embedding, as GPT-2
    return rms_norm(x, params["output_norm"], eps) @ head.T


def transformer(model: LlamaModel, token_ids, cache: KVCache | None = None) -> np.ndarray:  # [T] -> hidden [T, E]
    """The tokens through every block, at positions ``0 ..`` (or, with a ``cache``, after the tokens it holds,
    whose K/V they attend to and to which theirs are added)."""
    cfg, params = model.config, model.params
    ids = model.check_tokens(token_ids)
    start = 0 if cache is None else cache.length
    if cache is not None:
        check_cache(cfg, cache, len(ids))
    cos, sin = rope_angles(np.arange(start, start + len(ids)), cfg.head_dim, cfg.rope_theta)  # [T, D/2] each
    x = params["token_embd"][ids]  # [T, E]: no position embedding to add
    for layer, p in enumerate(params["blk"]):
        attend = grouped_query_attention if cache is None else partial(cached_attention, cache, layer)
        x = block(x, p, cfg, cos, sin, attend)
    if cache is not None:
        cache.length += len(ids)
    return x


def forward(model: LlamaModel, token_ids) -> np.ndarray:
    """Logits for every position of ``token_ids``: [T, V] (chapter 1's ``forward``)."""
    return lm_head(model.params, transformer(model, token_ids), model.config.rms_norm_eps)


# -- with a KV cache: chapter 2's cache, holding n_kv_head heads ----------------------------------------------------


def cached_attention(cache: KVCache, layer: int, q, k, v):  # q [H, T, D]; k, v [H_kv, T, D] -> [H, T, D]
    return grouped_query_attention(q, *cache.update(layer, k, v))  # against everything cached so far


def check_cache(cfg, cache: KVCache, num_new: int) -> None:
    if cache.k.shape[:2] + cache.k.shape[3:] != (cfg.n_layer, cfg.n_kv_head, cfg.head_dim):
        raise InvalidInputError(f"the KV cache holds {cache.k.shape[0]} layers x {cache.k.shape[1]} heads x head_dim "
                                f"{cache.k.shape[3]}; the model needs {cfg.n_layer} x {cfg.n_kv_head} x {cfg.head_dim}")
    cache.reserve(num_new)  # checked before anything is written: a failed call leaves the cache intact


def cached_logits(model: LlamaModel, token_ids, cache: KVCache, last_only: bool = False) -> np.ndarray:
    """Chapter 2's ``cached_logits`` for this architecture: the new tokens' logits [T, V] (or the last's, [1, V])."""
    x = transformer(model, token_ids, cache)  # [T, E]
    return lm_head(model.params, x[-1:] if last_only else x, model.config.rms_norm_eps)


CACHED_FORWARDS["llama"] = cached_logits  # chapter 2's generate and generate_stream now run Llama models, unchanged


# -- through the engine: chapter 3's ragged step for this architecture ---------------------------------------------


def attend_chunks(store, chunks, spans, layer, q, k, v):  # q [H, N, D]; k, v [H_kv, N, D] -> [H, N, D]
    """Each chunk's queries against its own sequence's K/V in the engine's store (chapter 3's loop). A decoding
    token hands the store its G query heads per K/V head as G rows, [H_kv, G, D]: the store's decode attention
    (chapter 5's paged one, in place or gathered) reads each cached K/V head once for all G of them, without
    repeating it."""
    H, N, D = q.shape
    H_kv = k.shape[0]
    out = np.empty((H, N, D), dtype=q.dtype)
    scale = np.float32(1 / np.sqrt(D))
    for chunk, (a, b) in zip(chunks, spans):
        if b - a == 1:  # decode
            q_grouped = (q[:, a] * scale).reshape(H_kv, H // H_kv, D)  # [H_kv, G, D]
            out[:, a] = store.attend_decode(chunk.seq_id, layer, chunk.start, q_grouped, k[:, a:b],
                                            v[:, a:b]).reshape(H, D)
        else:  # prefill (a whole prompt or a chunk of it): causal, over everything the store holds for it
            k_all, v_all = store.update(chunk.seq_id, layer, chunk.start, k[:, a:b], v[:, a:b])  # [H_kv, S, D]
            out[:, a:b] = grouped_query_attention(q[:, a:b], k_all, v_all)
    return out


def ragged_forward(model: LlamaModel, store, chunks: list[Chunk], logits_indices=None) -> np.ndarray:
    """Chapter 3's ``ragged_forward`` for this architecture: all chunks as one [N, E] matrix, each row rotated by
    its own position, attention per chunk; the next-token logits of each chunk [B, V] (or of the rows
    ``logits_indices`` names, [R, V], as chapter 3's)."""
    cfg, params = model.config, model.params
    lengths = [len(c.token_ids) for c in chunks]
    ends = np.cumsum(lengths)  # [B]
    spans = [(int(e - t), int(e)) for e, t in zip(ends, lengths)]
    positions = np.concatenate([np.arange(c.start, c.start + t) for c, t in zip(chunks, lengths)])  # [N]
    if positions.max() >= cfg.n_positions:
        raise CacheCapacityError(f"position {int(positions.max())} is past the context n_ctx={cfg.n_positions}")
    cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope_theta)  # [N, D/2]
    x = params["token_embd"][np.concatenate([c.token_ids for c in chunks])]  # [N, E]
    for layer, p in enumerate(params["blk"]):
        x = block(x, p, cfg, cos, sin, partial(attend_chunks, store, chunks, spans, layer))
    picked = ends - 1 if logits_indices is None else np.asarray(logits_indices, dtype=np.int64)
    return lm_head(params, x[picked], cfg.rms_norm_eps)  # [B, V] (or [R, V])


MODEL_STEPS["llama"] = ragged_forward  # the engines of chapters 3 to 7 now run Llama models: nothing else changes
