"""Appendix: a step's decode attention in one kernel call per layer, for chapter 3's contiguous store.

Chapter 3's step hands its store every decoding token of a layer at once (``KVStore.attend_decodes``), and that
store answers with one ``attend_decode`` per sequence: a handful of NumPy calls each, so a step of 32 sequences
makes 12 x 32 x ~10 small calls, each a few microseconds of Python and dispatch around a few microseconds of
arithmetic. ``SlotAttentionKVStore`` answers with one numba kernel per layer instead, which loops over
(sequence, head) pairs on both cores and reads each sequence's K/V where they lie in its slot:

    for each (sequence b, head h), in parallel:
        K, V = the slot's [max_len, D] rows of layer and head h      # views, no copy
        K[start], V[start] = k[h, b], v[h, b]                        # the new token, written once
        s[p] = q[h, b] . K[p]            for p = 0 .. start           # the query is already scaled
        out[h, b] = sum_p exp(s[p] - max s) V[p] / sum_p exp(s[p] - max s)

The same arithmetic as chapter 1's ``decode_attention`` in another order (float32 throughout; numba's
``fastmath`` lets the sums be reassociated), so the results agree to float32 rounding, not bit for bit.
``python -m gpt2_core bench capstone`` runs its final engine on it; ``notebooks/A1_cpu_performance.ipynb`` times it
against chapter 3's loop. Without numba (the ``kernels`` extra) the store is chapter 3's.
"""

from __future__ import annotations

import numpy as np

from ..ch03_batching.kv_store import ContiguousKVStore
from ..ch06_quantization.quant_kernels import numba_available
from .tiles import worker

_kernel = None  # compiled on first use: importing this module does not import numba


# The kernel's argument types, given so that numba compiles it at once (a store compiles it when it is made, not
# in the middle of its first step): the two caches [slots, L, H, max_len, D], the layer, slots and starts [B],
# q, k, v and out [H, B, D], the first and last (sequence, head) pair.
SIGNATURE = ("void(float32[:, :, :, :, ::1], float32[:, :, :, :, ::1], int64, int64[::1], int64[::1], "
             "float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], int64, int64)")


def slot_attention_kernel():
    """The numba kernel (compiled on the first call, a few seconds once per process; numba must be installed)."""
    global _kernel
    if _kernel is None:
        from numba import njit

        @njit(SIGNATURE, nogil=True, fastmath=True, cache=False)
        def attend_slots(k_cache, v_cache, layer, slots, starts, q, k, v, out, first, last):
            # k_cache, v_cache [slots, L, H, max_len, D]; q, k, v, out [H, B, D]; slots, starts [B]
            H, B, D = q.shape
            for i in range(first, last):  # the (sequence, head) pairs b * H + h of this call
                b, h = i // H, i % H
                start = starts[b]
                K, V = k_cache[slots[b], layer, h], v_cache[slots[b], layer, h]  # [max_len, D] views
                K[start, :] = k[h, b]
                V[start, :] = v[h, b]
                scores = np.empty(start + 1, dtype=np.float32)
                top = np.float32(-np.inf)
                for p in range(start + 1):
                    s = np.float32(0.0)
                    for d in range(D):
                        s += q[h, b, d] * K[p, d]
                    scores[p] = s
                    top = max(top, s)
                total = np.float32(0.0)
                for p in range(start + 1):
                    scores[p] = np.exp(scores[p] - top)
                    total += scores[p]
                acc = np.zeros(D, dtype=np.float32)
                for p in range(start + 1):
                    for d in range(D):
                        acc[d] += scores[p] * V[p, d]
                for d in range(D):
                    out[h, b, d] = acc[d] / total

        _kernel = attend_slots
    return _kernel


class SlotAttentionKVStore(ContiguousKVStore):
    """Chapter 3's contiguous store whose ``attend_decodes`` is one numba kernel call per layer (float32 K/V, numba
    installed; otherwise chapter 3's loop). Everything else is chapter 3's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if numba_available() and self.dtype == np.float32:
            slot_attention_kernel()  # compiled now, when the store is made, so that no step pays for it

    def attend_decodes(self, seq_ids, layer: int, starts, q, k, v):  # q, k, v [H, B, D] -> [H, B, D]
        starts = np.asarray(starts, dtype=np.int64)
        if (not numba_available() or self.dtype != np.float32 or not len(starts) or starts.min() < 0
                or starts.max() >= self.max_len or any(s not in self.slot_of for s in seq_ids)):
            return super().attend_decodes(seq_ids, layer, starts, q, k, v)  # chapter 3's loop (and its errors)
        slots = np.array([self.slot_of[s] for s in seq_ids], dtype=np.int64)  # [B]
        q, k, v = (np.ascontiguousarray(a, dtype=np.float32) for a in (q, k, v))
        out = np.empty(q.shape, dtype=np.float32)  # [H, B, D]
        kernel, pairs = slot_attention_kernel(), q.shape[0] * q.shape[1]  # (sequence, head) pairs
        args = (self.k, self.v, int(layer), slots, starts, q, k, v, out)
        pool = worker()
        if pool is None:
            kernel(*args, 0, pairs)
        else:  # the tiles' worker thread takes the first half of the pairs (numba lets go of Python's lock)
            first = pool.submit(kernel, *args, 0, pairs // 2)
            kernel(*args, pairs // 2, pairs)
            first.result()
        return out
