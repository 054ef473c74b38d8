"""Chapter 3's model step: one forward pass over a *ragged* batch of many sequences' new tokens.

Each sequence in the batch contributes a chunk of new tokens: its whole prompt if it was just admitted
(prefill), or its one last sampled token (decode). All chunks are concatenated into one [N, E] matrix, so every
weight matmul reads each weight once for all N tokens — no padding: one BLAS call, or for 2 to ``TILED_MAX_ROWS``
rows one NumPy call over the weight's tiles (``tiled_matmul``). Only attention is per sequence, because each
sequence attends to its own cached past, fetched from a ``KVStore``.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from .kv_cache import lm_head_fast
from .kv_store import KVStore
from .measure import available_memory_bytes
from .model import GELU_C, attention, layer_norm, split_qkv
from .weights import GPT2Model


@dataclass(frozen=True)
class Chunk:
    """New tokens of one sequence for this step, starting at position ``start`` (= tokens already cached)."""

    seq_id: object
    token_ids: np.ndarray  # [T] int64
    start: int


def decode_attention(q, k, v):  # q [H, 1, D] already scaled by 1/sqrt(D); k, v [H, S, D] -> [H, 1, D]
    """Chapter 1's ``attention`` for a single query (the last position: it sees every key, no mask), fused: the
    query arrives scaled (``ragged_forward`` scales all rows of a layer at once) and the softmax is normalised
    after the product with V, dividing an [H, 1, D] array instead of the [H, 1, S] scores. In a batch of 32
    decoding sequences these calls, one set per sequence and layer, are a visible share of the step."""
    s = q @ k.transpose(0, 2, 1)  # [H, 1, S]
    e = np.exp(s - s.max(axis=-1, keepdims=True))  # [H, 1, S]
    return (e @ v) / e.sum(axis=-1, keepdims=True)  # [H, 1, D]


# Up to how many rows one GEMV per row beats one GEMM, and the head's column block; measured on this project's
# 2-core machine (``python -m gpt2_core bench batching`` records both paths under ``small_batch_gemv``).
GEMV_MAX_ROWS = 6
HEAD_BLOCK = 2048  # columns: 768 x 2048 float32 = 6 MB for GPT-2 small
ROW_TILE = 8  # rows: see gemm_rows
PAD_MAX_ROWS = 4 * ROW_TILE  # gemm_rows pads decode-sized batches only: the sizes measured


def gemm_rows(n: int) -> int:
    """How many rows to hand BLAS's matrix-matrix product for ``n`` rows: ``n``, or, up to ``PAD_MAX_ROWS`` rows,
    ``n`` padded up to a multiple of ``ROW_TILE`` when 5 to 7 rows would be left past the last full multiple.

    This BLAS works through the rows in blocks, and a remainder of 5-7 rows can cost more than a whole block. All
    the matmuls of a GPT-2 small step, padded and not, side by side (``python -m gpt2_core bench padding``,
    ``data/benchmarks/padding-2026-12-03.json``, median of 15 rounds each): padded ran 1.07x as fast at 7 rows,
    1.08-1.13x at 13-15, 1.01-1.07x at 21-23 and 29-31; the row counts it leaves alone measured 0.96-1.03x. A
    small gain, which the 5 rounds of one batching benchmark run did not separate from the noise. Zero rows
    added to ``x`` give zero rows in the result, which are dropped; the other rows are the same products, to
    float32 rounding. vLLM pads its decode batches too, to the batch sizes of its captured CUDA graphs."""
    rest = n % ROW_TILE
    return n + ROW_TILE - rest if rest >= ROW_TILE - 3 and n < PAD_MAX_ROWS else n


# Weights in tiles of columns, for decode-sized batches (2 to TILED_MAX_ROWS rows); measured on this project's
# 2-core machine (``python -m gpt2_core bench batching`` records the step with and without, under ``tiled``).
TILE = 32  # columns per tile: a [768, 32] float32 tile is 96 KB
SMALL_GEMM_MNK = 100 ** 3  # OpenBLAS runs a product of m x n x k <= 100**3 with its small-matrix kernel
TILED_MAX_ROWS = 64
TWO_THREADS_FROM_ROWS = 9  # from this many rows the tiles are shared between two threads


def uses_tiles(rows: int) -> bool:
    """Does a product of ``rows`` rows go through the tiles (``tiled_matmul``) when it has them?"""
    return 1 < rows <= TILED_MAX_ROWS


def tile_weight(weight) -> np.ndarray:  # [in, out] -> [ceil(out / TILE), in, TILE]
    """``weight`` cut into tiles of ``TILE`` columns, each tile its own contiguous [in, TILE] matrix; the last
    tile is padded with zero columns. A copy: 495 MB more for GPT-2 small's step weights and head."""
    k, n = weight.shape
    tiles = np.zeros((-(-n // TILE), k, TILE), dtype=np.float32)  # [B, in, TILE]
    full = n // TILE
    tiles[:full] = weight[:, :full * TILE].reshape(k, full, TILE).transpose(1, 0, 2)
    if n % TILE:
        tiles[full, :, :n % TILE] = weight[:, full * TILE:]
    return tiles


def tiles_for(model: GPT2Model, weight) -> np.ndarray | None:
    """``tile_weight(weight)``, made on first use and kept with the model (``GPT2Model.tiles``); None if the memory
    for it is not available (``measure.available_memory_bytes``): the step then runs without tiles, as before.
    Tiles are made only while memory the size of the whole model would be left over after them, so that they
    never take the memory a step's activations need. The answer is kept too; ``model.refresh()`` asks again."""
    def make(w):
        k, n = w.shape
        available = available_memory_bytes()
        if available is not None and -(-n // TILE) * TILE * k * 4 + model.nbytes() > available:
            return None
        return tile_weight(w)
    return model.tiles(weight, make)


_POOL: list = []  # the one worker thread that takes half of the tiles, started on first use


def _worker():
    if not _POOL:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        _POOL.append(ThreadPoolExecutor(1, thread_name_prefix="gpt2-tiles") if cores > 1 else None)
    return _POOL[0]


if hasattr(os, "register_at_fork"):  # a forked child has no worker thread: it starts its own on first use
    os.register_at_fork(after_in_child=_POOL.clear)


def tiled_matmul(x, tiles, out_features: int) -> np.ndarray:  # x [N, in], tiles [B, in, TILE] -> [N, out]
    """``x @ weight`` from ``tile_weight(weight)``: one small product per tile.

    For a few rows, BLAS's general matrix-matrix product spends its time repacking the weight, not multiplying
    (section 1 of notebook 03). This BLAS (OpenBLAS) has a second kernel for small products, m x n x k up to
    ``SMALL_GEMM_MNK``, which works on the matrices as they lie, with no repacking: a [N, 768] x [768, 32] product
    qualifies up to 40 rows (up to 10 rows when in = 3072; more rows go through in groups). ``np.matmul`` over the
    stack of tiles makes all the calls in one NumPy call. The small kernel runs on one thread, so from
    ``TWO_THREADS_FROM_ROWS`` rows a worker thread takes the first half of the tiles (NumPy lets go of Python's
    lock inside the product). The result is the same product to float32 rounding.
    """
    n, k = x.shape
    rows = max(1, SMALL_GEMM_MNK // (k * TILE))  # rows per product that stay in the small kernel

    def products(t):  # [b, in, TILE] -> [b, N, TILE]
        if n <= rows:
            return np.matmul(x, t)
        return np.concatenate([np.matmul(x[r:r + rows], t) for r in range(0, n, rows)], axis=1)

    worker = _worker() if n >= TWO_THREADS_FROM_ROWS else None
    if worker is None:
        y = products(tiles)  # [B, N, TILE]
    else:
        half = len(tiles) // 2
        first = worker.submit(products, tiles[:half])
        second = products(tiles[half:])
        y = np.concatenate([first.result(), second])  # [B, N, TILE]
    return y.transpose(1, 0, 2).reshape(n, -1)[:, :out_features]  # [N, out]: the tiles side by side


ATTENTION_TWO_THREADS_FROM = 8  # sequences: measured even at 2-8, 1.1-1.2x at 16-32 (notebook 03)


def in_two(attend, work, store: KVStore) -> None:
    """``attend(work)``, with the work split in two halves of about equal cost (tokens x tokens seen) between the
    worker thread and this one, from ``ATTENTION_TWO_THREADS_FROM`` sequences on, if the store allows it
    (``KVStore.concurrent_updates``) and no sequence has two chunks. Each sequence's attention reads only its own
    cache and writes only its own rows, so the halves never touch each other's data. If a half fails, the other
    is finished before the error goes on (the store is never written behind the caller's back)."""
    distinct = len({chunk.seq_id for chunk, _ in work}) == len(work)  # two chunks of one sequence run in order
    worker = _worker() if len(work) >= ATTENTION_TWO_THREADS_FROM and store.concurrent_updates and distinct else None
    if worker is None:
        attend(work)
        return
    cost = np.cumsum([(b - a) * (chunk.start + b - a) for chunk, (a, b) in work])
    half = min(max(1, int(np.searchsorted(cost, cost[-1] / 2))), len(work) - 1)
    first = worker.submit(attend, work[:half])
    try:
        attend(work[half:])
    finally:
        wait([first])
    first.result()


def batched_matmul(x, weight, gemv_max_rows: int = GEMV_MAX_ROWS, block: int | None = None,
                   tiles=None):  # [N, in] -> [N, out]
    """``x @ weight`` by the faster kernel for N rows.

    With ``tiles`` (``tile_weight(weight)``), 2 to ``TILED_MAX_ROWS`` rows go through ``tiled_matmul``; the
    kernels below are the ones used without tiles, and past ``TILED_MAX_ROWS``.

    BLAS's matrix-matrix product (GEMM) repacks the weight, panel by panel, into cache-sized blocks before
    multiplying. For one row NumPy calls a matrix-vector product (GEMV) instead, which just streams the weight.
    For 2 to ``gemv_max_rows`` rows, one GEMV per row still costs less than the repacking: the rows after the
    first find the weight (2-9 MB per matrix for GPT-2 small) in the L3 cache. ``x[:, None, :] @ weight`` is a
    stack of N [1, in] x [in, out] products, which NumPy hands to BLAS one GEMV at a time. A weight too big for
    the cache (the LM head) is walked in column blocks of ``block`` columns, each used by every row in turn.

    A column-major weight (the output projections, ``weights.in_memory_order``) goes to the GEMM as
    ``(W.T @ x.T).T``: the same product, with ``W.T`` a row-major [out, in] matrix on the left. For 8 rows this
    BLAS ran that form 1.3-2.1x as fast as ``x @ W`` with W column-major, and 0.85-1.3x as fast as with W
    row-major (chapter 2's notebook, optimisation 3); whole steps of 8-32 sequences ran at 0.95-1.05x the
    speed of row-major weights (``bench layout``, three runs), and of 1-4 sequences at 1.0-1.2x.

    Every GEMM gets ``gemm_rows(N)`` rows: ``x`` is padded with zero rows when that is faster.
    """
    n = len(x)
    if tiles is not None and uses_tiles(n):
        return tiled_matmul(x, tiles, weight.shape[1])
    if n > gemv_max_rows:
        rows = gemm_rows(n)
        if rows == n:
            return _gemm(x, weight)  # [N, out]
        padded = np.zeros((rows, x.shape[1]), dtype=x.dtype)  # [N', in]
        padded[:n] = x
        return _gemm(padded, weight)[:n]  # [N, out]: the zero rows dropped
    if n < 2:
        return x @ weight  # [N, out]: one GEMV (N == 1)
    y = np.empty((len(x), 1, weight.shape[1]), dtype=np.result_type(x, weight))  # [N, 1, out]
    step = block or weight.shape[1]
    for j in range(0, weight.shape[1], step):
        np.matmul(x[:, None, :], weight[:, j:j + step], out=y[:, :, j:j + step])  # N GEMVs
    return y[:, 0, :]  # [N, out]


def _gemm(x, weight):  # [N, in] -> [N, out]: one matrix-matrix product, in the faster form for the weight's order
    if np.isfortran(weight):
        return (weight.T @ x.T).T  # the column-major weight passed as row-major W.T
    return x @ weight


def batched_linear(x, weight, bias, gemv_max_rows: int = GEMV_MAX_ROWS, tiles=None):  # x [N, in] -> [N, out]
    """Chapter 1's ``linear`` for many rows (``batched_matmul``), with the bias added in place (no second
    [N, out] array)."""
    y = batched_matmul(x, weight, gemv_max_rows, tiles=tiles)
    y += bias
    return y


def linear_for_step(model: GPT2Model, rows: int, gemv_max_rows: int = GEMV_MAX_ROWS, tiled: bool = True):
    """The ``linear(x, weight, bias)`` of a step of ``rows`` rows: ``batched_linear``, with the weight's tiles
    (``tiles_for``) for 2 to ``TILED_MAX_ROWS`` rows if ``tiled``."""
    use_tiles = tiled and uses_tiles(rows)

    def linear(x, weight, bias):  # x [rows, in] -> [rows, out]
        return batched_linear(x, weight, bias, gemv_max_rows, tiles_for(model, weight) if use_tiles else None)
    return linear


def batched_lm_head(model: GPT2Model, x, gemv_max_rows: int = GEMV_MAX_ROWS,
                    tiled: bool = True) -> np.ndarray:  # [B, E] -> [B, V]
    """Chapter 2's ``lm_head_fast`` for a batch of last positions; in tiles (``tiled_matmul``) for 2 to
    ``TILED_MAX_ROWS`` rows if ``tiled``, else as follows.

    The head [E, V] is 154 MB for GPT-2 small: far past any cache, so for a few rows the matrix-matrix product
    repacks all of it from memory. For 2 to ``gemv_max_rows`` rows, ``batched_matmul`` walks it in column blocks
    of ``HEAD_BLOCK`` columns (small enough to stay in the L3 cache): each block is read from memory once, for
    the first row, and from cache for the others. Past that it is one GEMM, on ``gemm_rows`` rows.
    """
    if len(x) == 1:
        return lm_head_fast(model, x)  # [1, V]
    x = layer_norm(x, **model.params["ln_f"], eps=model.config.layer_norm_epsilon)  # [B, E]
    head = model.lm_head_weight()  # [E, V]
    tiles = tiles_for(model, head) if tiled and uses_tiles(len(x)) else None
    return batched_matmul(x, head, gemv_max_rows, block=HEAD_BLOCK, tiles=tiles)  # [B, V]


def gelu_(h):  # h [N, F], overwritten with gelu(h)
    """Chapter 1's ``gelu``, computed in place with one scratch array (the same operations in the same order,
    so the same float32 numbers). Chapter 1's expression gives each of its nine operations a new result array;
    NumPy recycles some of them, but at its peak it holds three arrays the size of ``h`` (15 MB each for a
    1,250-token prefill step). This form holds one and writes the result into ``h`` (notebook 03 measures
    both)."""
    t = h * h  # [N, F] the one scratch array
    t *= h  # x^3
    t *= np.float32(0.044715)
    t += h  # x + 0.044715 x^3
    t *= GELU_C
    np.tanh(t, out=t)
    t += 1
    h *= np.float32(0.5)  # 0.5 x (exact: a power of two)
    h *= t
    return h


def ragged_forward(model: GPT2Model, store: KVStore, chunks: list[Chunk],
                   gemv_max_rows: int = GEMV_MAX_ROWS, tiled: bool = True) -> np.ndarray:
    """Run every chunk through the model in one pass; return the next-token logits of each chunk [B, V].

    The store must already have room for ``start + T`` tokens of every chunk (``KVStore.ensure``).
    ``tiled``: steps of 2 to ``TILED_MAX_ROWS`` rows multiply by the weights in tiles (``tiled_matmul``).
    ``gemv_max_rows``: see ``batched_matmul``, for steps without tiles (1 = always GEMM, as the benchmark compares).
    """
    g = gemv_max_rows
    cfg, params = model.config, model.params
    lengths = [len(c.token_ids) for c in chunks]
    ends = np.cumsum(lengths)  # [B] row after each chunk's last token
    spans = [(int(e - t), int(e)) for e, t in zip(ends, lengths)]
    token_ids = np.concatenate([c.token_ids for c in chunks])  # [N]
    positions = np.concatenate([np.arange(c.start, c.start + t) for c, t in zip(chunks, lengths)])  # [N]
    x = params["wte"][token_ids] + params["wpe"][positions]  # [N, E]
    linear = linear_for_step(model, len(x), g, tiled)
    work = list(zip(chunks, spans))
    eps, H, D = cfg.layer_norm_epsilon, cfg.n_head, cfg.head_dim
    scale = np.float32(1 / np.sqrt(D))
    for layer, p in enumerate(params["h"]):
        qkv = linear(layer_norm(x, **p["ln_1"], eps=eps), **p["attn"]["c_attn"])  # [N, 3E]
        q, k, v = split_qkv(qkv, H)  # 3 x [H, N, D] views, no copy
        q_scaled = q * scale  # [H, N, D] for the decode path, scaled once for all rows
        out = np.empty((len(x), H, D), dtype=x.dtype)  # [N, H, D]

        def attend(work):  # [(chunk, (a, b))]: each chunk's new K/V into the store, its attention into out
            for chunk, (a, b) in work:
                k_all, v_all = store.update(chunk.seq_id, layer, chunk.start, k[:, a:b], v[:, a:b])  # [H, start+T, D]
                if b - a == 1:  # decode: one query sees every cached key, no mask needed
                    out[a] = decode_attention(q_scaled[:, a:b], k_all, v_all)[:, 0]  # [H, D]
                else:  # prefill: chapter 1's causal attention
                    out[a:b] = attention(q[:, a:b], k_all, v_all).transpose(1, 0, 2)  # [T, H, D]
        in_two(attend, work, store)
        x += linear(out.reshape(len(x), H * D), **p["attn"]["c_proj"])  # [N, E] residual
        h = gelu_(linear(layer_norm(x, **p["ln_2"], eps=eps), **p["mlp"]["c_fc"]))  # [N, 4E]
        x += linear(h, **p["mlp"]["c_proj"])  # [N, E]: chapter 1's mlp, in place
    return batched_lm_head(model, x[ends - 1], gemv_max_rows=g, tiled=tiled)  # [B, V]: each chunk's last position
