"""Appendix: BLAS kernels for a product of a few rows by a big weight.

BLAS's matrix-matrix product (GEMM) repacks the weight, panel by panel, into cache-sized blocks before
multiplying. For one row NumPy calls a matrix-vector product (GEMV) instead, which just streams the weight. For a
few rows, one GEMV per row can still cost less than the repacking: the rows after the first find the weight in the
L3 cache. The constants are where this held on the project's 2-core machine; ``python -m gpt2_core bench batching``
measures both paths (``small_batch_gemv``) on yours.
"""

from __future__ import annotations

import numpy as np

GEMV_MAX_ROWS = 6  # up to this many rows, one GEMV per row beats one GEMM
HEAD_BLOCK = 2048  # the LM head's column block for per-row GEMVs: 768 x 2048 float32 = 6 MB for GPT-2 small
ROW_TILE = 8  # BLAS works through a GEMM's rows in blocks of this many (see gemm_rows)
PAD_MAX_ROWS = 4 * ROW_TILE  # gemm_rows pads decode-sized batches only


def gemm_rows(n: int) -> int:
    """How many rows to hand BLAS's GEMM for ``n`` rows: ``n``, or, below ``PAD_MAX_ROWS`` rows, ``n`` padded up to
    a multiple of ``ROW_TILE`` when 5 to 7 rows would be left past the last full multiple.

    This BLAS works through the rows in blocks, and a remainder of 5-7 rows can cost more than a whole block
    (``python -m gpt2_core bench padding`` times every row count both ways). Zero rows added to ``x`` give zero
    rows in the result, which are dropped; the other rows are the same products, to float32 rounding. vLLM pads
    its decode batches too, to the batch sizes of its captured CUDA graphs."""
    rest = n % ROW_TILE
    return n + ROW_TILE - rest if rest >= ROW_TILE - 3 and n < PAD_MAX_ROWS else n


def gemm(x, weight):  # [N, in] -> [N, out]: one matrix-matrix product, in the faster form for the weight's order
    """A column-major weight goes to BLAS as ``(W.T @ x.T).T``: the same product, with ``W.T`` a row-major
    [out, in] matrix on the left, which this BLAS runs faster than ``x @ W`` for a column-major ``W``."""
    if np.isfortran(weight):
        return (weight.T @ x.T).T
    return x @ weight


def padded_gemm(x, weight):  # [N, in] -> [N, out]
    """``gemm`` on ``gemm_rows(N)`` rows: ``x`` padded with zero rows when that is faster."""
    n = len(x)
    rows = gemm_rows(n)
    if rows == n:
        return gemm(x, weight)
    padded = np.zeros((rows, x.shape[1]), dtype=x.dtype)  # [N', in]
    padded[:n] = x
    return gemm(padded, weight)[:n]  # [N, out]: the zero rows dropped


def gemv_per_row(x, weight, block: int | None = None):  # [N, in] -> [N, out]
    """One GEMV per row: ``x[:, None, :] @ weight`` is a stack of N [1, in] x [in, out] products, which NumPy
    hands to BLAS one GEMV at a time. A weight too big for the cache (the LM head) is walked in column blocks of
    ``block`` columns, each used by every row in turn, so each block is read from memory once."""
    y = np.empty((len(x), 1, weight.shape[1]), dtype=np.result_type(x, weight))  # [N, 1, out]
    step = block or weight.shape[1]
    for j in range(0, weight.shape[1], step):
        np.matmul(x[:, None, :], weight[:, j:j + step], out=y[:, :, j:j + step])  # N GEMVs
    return y[:, 0, :]  # [N, out]


def small_batch_matmul(x, weight, gemv_max_rows: int = GEMV_MAX_ROWS, block: int | None = None):  # [N, in] -> [N, out]
    """``x @ weight`` without tiles: one GEMV for one row, a GEMV per row up to ``gemv_max_rows`` rows, else the
    (padded) GEMM."""
    n = len(x)
    if n > gemv_max_rows:
        return padded_gemm(x, weight)
    if n < 2:
        return x @ weight  # one GEMV
    return gemv_per_row(x, weight, block)
