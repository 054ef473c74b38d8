"""Chapter 5: paged attention proper — a decoding token attends to its sequence's K/V where they lie, block by block.

Chapter 4's store gathers a sequence's whole history into one contiguous array per layer (``np.take``) before
attention reads it: every decode step copies every cached token of every sequence. Here attention walks the block
table instead and reads each block in place (a slice of the pool is a view, not a copy). Blocks that happen to be
neighbours in the pool are read as one *run* (one view, one matmul): the blocks of a prompt are allocated
together and usually are.

The softmax over all S positions is computed one run at a time with an **online softmax** (Milakov & Gimelshein
2018; FlashAttention, flash-decoding): each run gives its own maximum ``m``, sum ``l`` of ``exp(score - m)`` and
weighted sum ``acc`` of its values; two such partial results are merged by rescaling both to the larger maximum,
``exp(m_old - m_new)``. After the last run ``acc / l`` is exactly softmax(scores) @ V, up to float32 rounding, and
no [H, S] score array of the whole sequence, and no copy of its K/V, is ever made.

Each run costs a handful of NumPy calls. A sequence whose blocks lie in many short runs (blocks handed out as it
grew, beside other sequences') pays more for those calls than the copy saves: the store then gathers, as chapter 4's
does (``RUN_COST_TOKENS``). A GPU kernel walks the block table inside one launch and never needs to choose.

A pool that keeps K/V in fewer bytes (chapter 6 hands the store an fp16 or int8 codec) is decoded run by run, as
attention reads it: only the blocks read are turned back into float32, one run at a time. Chapter 4's float32 codec
decodes nothing, and a run stays a view.
"""

from __future__ import annotations

import numpy as np

from ..errors import CacheCapacityError
from ..ch04_paged.paged_kv_store import FP32, KVCodec, PagedKVStore


def contiguous_runs(slots: np.ndarray) -> list[tuple[int, int]]:
    """The pool slots ``slots`` [S] (position order) as maximal runs of consecutive slots: [(first, end), ...]."""
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1  # positions where the next slot is not the one after
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(slots)]])
    return [(int(slots[a]), int(slots[b - 1]) + 1) for a, b in zip(starts, ends)]


def paged_decode_attention(q, pool, runs, codec=FP32, scales=None):  # q [H, 1, D] scaled; pool [slots, 2, H, D]
    """One query against the K/V held in ``pool[first:end]`` (kept by ``codec``, with ``scales`` [slots, 2, H] if it
    keeps scales) for every run ``(first, end)`` of ``runs``, in position order: [H, 1, D]."""
    for i, (first, end) in enumerate(runs):
        # [n, 2, H, D] float32: for fp32 a view of the pool, nothing copied; another codec decodes this run only
        kv = codec.decode(pool[first:end], None if scales is None else scales[first:end])
        s = q @ kv[:, 0].transpose(1, 2, 0)  # [H, 1, n] scores of this run's keys
        m_run = s.max(axis=-1, keepdims=True)  # [H, 1, 1] the run's own maximum
        p = np.exp(s - m_run)  # [H, 1, n]
        l_run, acc_run = p.sum(axis=-1, keepdims=True), p @ kv[:, 1].transpose(1, 0, 2)  # [H, 1, 1], [H, 1, D]
        if i == 0:
            m, l, acc = m_run, l_run, acc_run
            continue
        m_new = np.maximum(m, m_run)  # the maximum so far; rescale both sides to it
        old, new = np.exp(m - m_new), np.exp(m_run - m_new)  # [H, 1, 1] each, <= 1
        m, l, acc = m_new, l * old + l_run * new, acc * old + acc_run * new
    return acc / l  # [H, 1, D]: softmax(all scores) @ all values


# A run of blocks beyond the first costs ``paged_decode_attention`` about what reading in place instead of gathering
# saves on 100 tokens: 70-116 in the timings of notebook 05's section 1 (``notebooks/results/prefix.json``: float32
# K/V, GPT-2 124M's heads, one host). A codec that decodes (chapter 6) is not calibrated: the same value is used.
RUN_COST_TOKENS = 100


class PagedAttentionKVStore(PagedKVStore):
    """Chapter 4's paged store whose decode attention reads the blocks in place (``paged_decode_attention``).

    Prefill chunks still go through ``update`` (scatter the chunk, gather the history for the causal attention);
    a decoding token is scattered into its slot and attended to without a gather, unless the NumPy calls of its runs
    beyond the first would cost more than gathering its S tokens: with more than 1 + S / ``run_cost_tokens`` runs,
    chapter 4's gather reads them (``run_cost_tokens = 0``: always in place).
    """

    run_cost_tokens = RUN_COST_TOKENS

    def __init__(self, config, num_blocks: int, block_size: int = 16, codec: KVCodec = FP32):
        super().__init__(config, num_blocks, block_size, codec)
        self.runs: dict[object, tuple[int, list]] = {}  # seq_id -> (num_tokens, its runs), reused by every layer

    def attend_decode(self, seq_id, layer: int, start: int, q, k, v):
        slots = self.slots[seq_id]
        if not 0 <= start < len(slots):
            raise CacheCapacityError(f"sequence {seq_id!r}: position {start} is outside its {len(slots)} reserved "
                                     f"slots (call ensure first)")
        if self.runs.get(seq_id, (None,))[0] != start + 1:  # a new length: layer 0 of this step finds the runs
            self.runs[seq_id] = (start + 1, contiguous_runs(slots[:start + 1]))
        runs = self.runs[seq_id][1]
        if (len(runs) - 1) * self.run_cost_tokens > start + 1:  # scattered: one gather costs less than their calls
            return super().attend_decode(seq_id, layer, start, q, k, v)  # chapter 4's: write, gather, attend
        self.write(layer, slots[start:start + 1], k, v)  # the new token's K and V into its slot, nothing gathered
        self.written[seq_id] = max(self.written[seq_id], start + 1)
        scales = None if self.scales is None else self.scales[layer]  # [slots, 2, H] if the codec keeps scales
        return paged_decode_attention(q, self.kv[layer], runs, self.codec, scales)

    def _refresh_slots(self, seq_id) -> None:
        super()._refresh_slots(seq_id)
        self.runs.pop(seq_id, None)  # the block table changed: its runs too

    def free(self, seq_id) -> None:
        super().free(seq_id)
        self.runs.pop(seq_id, None)
