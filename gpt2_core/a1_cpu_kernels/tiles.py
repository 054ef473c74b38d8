"""Appendix: weights cut into tiles of 32 columns, for steps of 2 to 64 rows.

For a few rows, BLAS's general matrix-matrix product spends its time repacking the weight, not multiplying. This
BLAS (OpenBLAS) has a second kernel for small products, m x n x k up to ``SMALL_GEMM_MNK``, which works on the
matrices as they lie, with no repacking: a [N, 768] x [768, 32] product qualifies up to 40 rows (up to 10 rows
when in = 3072; more rows go through in groups). ``np.matmul`` over the stack of tiles makes all the calls in one
NumPy call. The small kernel runs on one thread, so from ``TWO_THREADS_FROM_ROWS`` rows a worker thread takes the
first half of the tiles (NumPy lets go of Python's lock inside the product). The price is a second copy of every
weight: 495 MB for GPT-2 small.

That small kernel belongs to OpenBLAS's Skylake-X family of kernels (AVX-512). Where OpenBLAS runs another family,
as its Haswell kernels on an AMD EPYC without AVX-512, every tile goes through the general product and the tiles
lose (0.47-0.87x the untiled step at 2 to 64 rows, measured on such a host). ``small_kernel_here()`` tells which,
and ``accelerate`` uses tiles only where the kernel is. Even there they do not always pay: on the Intel Xeon of
``notebooks/results/batching.json`` (Skylake-X kernels) the tiled step was 0.85-1.26x as fast as the untiled one
at 2 to 64 rows, winning at 4, 6 and 12-24 rows, with a median of 0.98x.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

TILE = 32  # columns per tile: a [768, 32] float32 tile is 96 KB
SMALL_GEMM_MNK = 100 ** 3  # OpenBLAS runs a product of m x n x k <= 100**3 with its small-matrix kernel
TILED_MAX_ROWS = 64
# From this many rows the tiles are shared between two threads: every tiled product. A step reads each weight from
# memory, and one core streams it slower than two: decode steps of 2-8 rows in real steps took 1.45-1.50x as long
# with one thread as with two (2-core Intel Xeon, tiles on, 2026-12-07; an earlier 9 was chosen on weights warm in
# the cache, where one thread's small products keep up).
TWO_THREADS_FROM_ROWS = 2


SMALL_KERNEL_ARCHITECTURES = ("SkylakeX", "Cooperlake", "SapphireRapids")  # OpenBLAS's AVX-512 kernel families


def blas_architecture() -> str | None:
    """The kernel family OpenBLAS chose for this CPU (threadpoolctl reads it), or ``None`` for another BLAS."""
    from threadpoolctl import threadpool_info

    return next((lib.get("architecture") for lib in threadpool_info()
                 if lib.get("user_api") == "blas" and lib.get("internal_api") == "openblas"), None)


def small_kernel_here() -> bool:
    """Does this process's BLAS have the small-matrix kernel the tiles are made for?"""
    return blas_architecture() in SMALL_KERNEL_ARCHITECTURES


def uses_tiles(rows: int) -> bool:
    """Does a product of ``rows`` rows go through the tiles (``tiled_matmul``) when it has them?"""
    return 1 < rows <= TILED_MAX_ROWS


def tile_bytes(weight) -> int:
    """Bytes of ``tile_weight(weight)``."""
    k, n = weight.shape
    return -(-n // TILE) * TILE * k * 4


def tile_weight(weight) -> np.ndarray:  # [in, out] -> [ceil(out / TILE), in, TILE]
    """``weight`` cut into tiles of ``TILE`` columns, each tile its own contiguous [in, TILE] matrix; the last
    tile is padded with zero columns. A copy."""
    k, n = weight.shape
    tiles = np.zeros((-(-n // TILE), k, TILE), dtype=np.float32)  # [B, in, TILE]
    full = n // TILE
    tiles[:full] = weight[:, :full * TILE].reshape(k, full, TILE).transpose(1, 0, 2)
    if n % TILE:
        tiles[full, :, :n % TILE] = weight[:, full * TILE:]
    return tiles


_POOL: list = []  # the one worker thread that takes half of the tiles, started on first use


def worker():
    """The worker thread's executor, or None on a machine with one core."""
    if not _POOL:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        _POOL.append(ThreadPoolExecutor(1, thread_name_prefix="gpt2-tiles") if cores > 1 else None)
    return _POOL[0]


if hasattr(os, "register_at_fork"):  # a forked child has no worker thread: it starts its own on first use
    os.register_at_fork(after_in_child=_POOL.clear)


def tiled_matmul(x, tiles, out_features: int) -> np.ndarray:  # x [N, in], tiles [B, in, TILE] -> [N, out]
    """``x @ weight`` from ``tile_weight(weight)``: one small product per tile (see the module docstring). The
    result is the same product to float32 rounding."""
    n, k = x.shape
    rows = max(1, SMALL_GEMM_MNK // (k * TILE))  # rows per product that stay in the small kernel

    def products(t):  # [b, in, TILE] -> [b, N, TILE]
        if n <= rows:
            return np.matmul(x, t)
        return np.concatenate([np.matmul(x[r:r + rows], t) for r in range(0, n, rows)], axis=1)

    pool = worker() if n >= TWO_THREADS_FROM_ROWS else None
    if pool is None:
        y = products(tiles)  # [B, N, TILE]
    else:
        half = len(tiles) // 2
        first = pool.submit(products, tiles[:half])
        second = products(tiles[half:])
        y = np.concatenate([first.result(), second])  # [B, N, TILE]
    return y.transpose(1, 0, 2).reshape(n, -1)[:, :out_features]  # [N, out]: the tiles side by side
