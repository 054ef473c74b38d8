"""Chapter 6's kernels: matmuls that read int8 and int4 weights directly (numba; the optional ``kernels`` extra).

NumPy's only fast matmul is BLAS, and BLAS takes float32: a quantized weight must become float32 before it, so
the numpy path reads the small weights, writes a float32 copy and reads it again — more bytes than fp32 alone.
These kernels read each output channel's bytes once, turn them into float32 in a buffer the size of one row
(it stays in the core's L1 cache), and take the dot product of that row with every input row:

    for each output channel j, in parallel (numba's prange over the two cores):
        w = float32(q[j, :]) * scale                  # one row, int8 or unpacked int4 -> float32, in cache
        for each input row n:  y[n, j] = dot(x[n, :], w)

At batch 1 that reads 1 byte a weight (int8) or half a byte (int4) instead of 4. At batch 32 the product is
compute-bound, and BLAS's tuned GEMM beats this simple loop: the benchmark records both.

Compiling takes seconds the first time a kernel runs in a process (``warm_up`` does it and returns the time);
the benchmark keeps it out of its timings. Without numba installed, ``numba_available()`` is False, the package
uses the numpy path, and asking for these kernels raises a ``MissingDependencyError`` naming the extra.
"""

from __future__ import annotations

import importlib.util
import time

import numpy as np

from ..errors import MissingDependencyError

FORMATS = ("int8", "int4")  # formats with a kernel here (fp16 runs the numpy path)
INSTALL = "pip install 'gpt2-numpy[kernels]'"
_kernels = None  # the compiled functions, made on first use


def numba_available() -> bool:
    return importlib.util.find_spec("numba") is not None


def require_numba() -> None:
    if not numba_available():
        raise MissingDependencyError(f"kernel='numba' needs numba, which is not installed: {INSTALL} (or "
                                     f"pip install -e '.[kernels]' in a checkout); kernel='numpy' runs without it")


def _compile():
    """Define the kernels with numba (lazily: importing this module does not import numba)."""
    require_numba()
    from numba import njit, prange

    @njit(parallel=True, fastmath=True, cache=False)
    def int8_matmul(x, q, scale, y):  # x [N, K] f32; q [M, K] int8; scale [M] f32 -> y [N, M] f32
        N, K = x.shape
        for j in prange(q.shape[0]):
            w = np.empty(K, dtype=np.float32)  # one output channel, in float32
            s = scale[j]
            for k in range(K):
                w[k] = np.float32(q[j, k]) * s
            for n in range(N):
                acc = np.float32(0.0)
                for k in range(K):
                    acc += x[n, k] * w[k]
                y[n, j] = acc

    @njit(parallel=True, fastmath=True, cache=False)
    def int4_matmul(x, packed, scales, group_size, y):  # packed [M, K/2] uint8; scales [M, K/g] f32
        N, K = x.shape
        half = group_size // 2
        low, four, eight = np.uint8(15), np.uint8(4), np.float32(8)
        for j in prange(packed.shape[0]):
            w = np.empty(K, dtype=np.float32)
            row = packed[j]
            for g in range(K // group_size):  # byte t of a group: input t (low nibble), input t + half (high)
                s = scales[j, g]
                src = row[g * half:(g + 1) * half]  # 1-D views: the loops below then vectorize
                lo = w[g * group_size:g * group_size + half]
                hi = w[g * group_size + half:(g + 1) * group_size]
                for t in range(half):
                    lo[t] = (np.float32(src[t] & low) - eight) * s
                    hi[t] = (np.float32(src[t] >> four) - eight) * s
            for n in range(N):
                acc = np.float32(0.0)
                for k in range(K):
                    acc += x[n, k] * w[k]
                y[n, j] = acc

    return {"int8": int8_matmul, "int4": int4_matmul}


def kernels() -> dict:
    global _kernels
    if _kernels is None:
        _kernels = _compile()
    return _kernels


def matmul(x, weight) -> np.ndarray:  # x [N, in] float32 C-contiguous; weight an Int8Weight / Int4Weight -> [N, out]
    """``x @ weight`` reading the quantized bytes directly."""
    k = kernels()
    y = np.empty((x.shape[0], weight.shape[1]), dtype=np.float32)
    if weight.fmt == "int8":
        k["int8"](x, weight.q, weight.scale, y)
    elif weight.fmt == "int4":
        k["int4"](x, weight.packed, weight.scales, weight.group_size, y)
    else:
        raise MissingDependencyError(f"no numba kernel for {weight.fmt}; kernels exist for {', '.join(FORMATS)}")
    return y


def warm_up() -> float:
    """Compile every kernel (runs each once on a tiny matrix); return the seconds it took (0 if already done)."""
    t0 = time.perf_counter()
    fresh = _kernels is None
    k = kernels()
    x, y = np.ones((1, 4), dtype=np.float32), np.empty((1, 2), dtype=np.float32)
    k["int8"](x, np.ones((2, 4), dtype=np.int8), np.ones(2, dtype=np.float32), y)
    k["int4"](x, np.full((2, 2), 0x88, dtype=np.uint8), np.ones((2, 2), dtype=np.float32), 2, y)
    return time.perf_counter() - t0 if fresh else 0.0


def threading_info() -> dict:
    """numba's threads and threading layer (after a kernel ran), for the benchmark's record."""
    if not numba_available():
        return {"numba": None}
    import numba

    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel region has run yet
        layer = None
    return {"numba": numba.__version__, "num_threads": numba.get_num_threads(), "threading_layer": layer}
