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

One row of int4 (a batch-1 decode step) has a kernel of its own, ``int4_matvec``: unpacking is then the work, and
the loop above unpacks one group (``group_size`` numbers, 32 to 64) at a time, too few for the core's vector units.
It reads the bytes *input-major* in tiles of 64 output channels instead (``int4_tiles``: ``tiles[t, i, c]`` holds
inputs 2i and 2i+1 of channel 64t + c), so that its inner loop runs along 64 channels (four AVX-512 instructions
wide, eight AVX2 ones), and each tile's bytes lie in one contiguous run (read as a stream; a stride across the whole
matrix ran 2x slower here):

    for each tile of 64 output channels, in parallel:
        for each group g:   acc = sum over the group's inputs k of x[k] * nibble[k, tile]    # integers 0..15
                            y[tile] += scale[g, tile] * (acc - 8 * sum(x[group]))           # the offset, once

The tiled copy is made the first time a weight multiplies one row and kept with it: about the weight's own bytes
again (nibbles and scales, reordered), which ``nbytes`` does not count (it counts what the format stores).
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

    return {"int8": int8_matmul, "int4": int4_matmul, "int4_matvec": _compile_matvec()}


def _compile_matvec():
    """The batch-1 int4 kernel (see the module's docstring)."""
    from numba import njit, prange

    @njit(fastmath=True, boundscheck=False, inline="always")
    def add_inputs(acc, row, x0, x1):  # acc[:] += x0 * low nibbles of row + x1 * high nibbles
        for c in range(acc.shape[0]):
            b = np.int32(row[c])  # int32, not uint8: LLVM then vectorizes the loop
            acc[c] += x0 * np.float32(b & 15) + x1 * np.float32(b >> 4)

    @njit(parallel=True, fastmath=True, boundscheck=False, cache=False)
    def int4_matvec(x, tiles, scales, group_size, y):  # x [1, K]; tiles [T, K/2, 64] uint8; scales [T, K/g, 64]
        T, _, width = tiles.shape
        M, half = y.shape[1], group_size // 2
        for t in prange(T):
            acc = np.empty(width, dtype=np.float32)
            out = np.zeros(width, dtype=np.float32)
            for g in range(scales.shape[1]):
                acc[:] = 0.0
                xsum = np.float32(0.0)
                for i in range(g * half, (g + 1) * half):  # byte row i of the tile: inputs 2i and 2i + 1
                    x0, x1 = x[0, 2 * i], x[0, 2 * i + 1]
                    xsum += x0 + x1
                    add_inputs(acc, tiles[t, i], x0, x1)
                s = scales[t, g]
                for c in range(width):
                    out[c] += s[c] * (acc[c] - np.float32(8.0) * xsum)
            n = min(width, M - t * width)  # the last tile may be part padding
            y[0, t * width:t * width + n] = out[:n]

    return int4_matvec


TILE = 64  # output channels a tile of int4_tiles


def int4_tiles(packed, scales, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``packed`` [M, K/2] and ``scales`` [M, K/g] (chapter 6's layout) -> tiles [T, K/2, 64] uint8 (``[t, i, c]``:
    inputs 2i (low nibble) and 2i + 1 (high) of channel 64t + c, as q + 8) and scales [T, K/g, 64]; T = ceil(M / 64),
    the last tile padded with zeros: the order ``int4_matvec`` reads."""
    M, half = packed.shape  # unpacked as quantization.unpack_int4 does, kept as q + 8 (that module imports this one)
    p = packed.reshape(M, half * 2 // group_size, 1, group_size // 2)
    q = np.concatenate([p & 15, p >> 4], axis=2).reshape(M, half * 2)  # [M, K] in 0..15, in input order
    pairs = q[:, 0::2] | (q[:, 1::2] << 4)  # [M, K/2]: inputs 2i, 2i + 1
    T = -(-M // TILE)

    def tiled(a):  # [M, n] -> [T, n, 64]
        a = np.pad(a, ((0, T * TILE - M), (0, 0)))
        return np.ascontiguousarray(a.reshape(T, TILE, a.shape[1]).transpose(0, 2, 1))
    return tiled(pairs), tiled(np.asarray(scales, dtype=np.float32))


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
    elif weight.fmt == "int4" and x.shape[0] == 1:  # one row: the input-major copy, made on first use, kept
        layout = weight.__dict__.get("tiles")
        if layout is None:
            layout = weight.tiles = int4_tiles(weight.packed, weight.scales, weight.group_size)
        k["int4_matvec"](x, *layout, weight.group_size, y)
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
    tiles = int4_tiles(np.full((2, 2), 0x88, dtype=np.uint8), np.ones((2, 2), dtype=np.float32), 2)
    k["int4_matvec"](x, *tiles, 2, y)
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
