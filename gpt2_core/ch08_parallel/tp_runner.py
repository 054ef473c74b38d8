"""Chapter 8: tensor parallelism under chapter 5's engine — the engine's model step, run on worker processes.

``TensorParallelRunner`` is a ``forward(model, store, chunks)`` for ``CachingLLMEngine(forward=...)``: the
scheduler, the prefix cache, chunked prefill, forks and preemption stay in the driver, unchanged; only the model
step moves. As in vLLM, the driver keeps the block tables and the workers keep the K/V:

* the paged store's pool moves into **shared memory**; worker r reads and writes only its own heads of it, so
  the blocks the driver shares (prefix cache, forks) and copies on write (``ensure``) are shared and copied for
  every worker at once;
* each step the driver embeds the chunks, writes ``x`` [N, E] into shared memory and sends the chunks and their
  block tables (a few hundred bytes); every worker runs chapter 3's ``ragged_transformer`` on its shard, whose two
  row-parallel weights all-reduce as they multiply (``RowParallelWeight``), then its share of the vocabulary's
  logits, written into its columns of one shared [B, V] array.
"""

from __future__ import annotations

import numpy as np

from ..ch01_forward.model import lm_head
from ..ch03_batching.kv_store import KVStore
from ..ch03_batching.model_runner import Chunk, embed_chunks, ragged_transformer
from ..ch04_paged.paged_kv_store import PagedKVStore, slot_indices
from ..ch05_sharing.paged_attention import contiguous_runs, paged_decode_attention
from ..errors import InvalidInputError, is_integer
from ..loading.weights import GPT2Model
from .process_group import OwnsGroup, ProcessGroup
from .tensor_parallel import SharedMemoryAllReduce, part, shard_params


class RowParallelWeight:
    """Worker r's rows of a row-parallel weight [in/w, out]: ``x_part @ w`` is its partial sum, all-reduced, so
    chapter 1's ``linear(x_part, w, bias)`` gives the whole product on every worker, the bias added once after the
    sum (``tensor_parallel.row_parallel``, through chapter 6's ``x @ W`` seam)."""

    __array_ufunc__ = None  # NumPy hands x @ self to self.__rmatmul__

    def __init__(self, rows: np.ndarray, all_reduce):
        self.rows, self.all_reduce = rows, all_reduce

    def __rmatmul__(self, x_part):  # x_part [N, in/w] -> [N, out]
        return self.all_reduce(x_part @ self.rows)


def all_reducing(p: dict, all_reduce) -> dict:
    """One block's shard (``shard_layer``) with its two row-parallel weights all-reducing: chapter 3's step runs it."""
    def proj(c_proj):
        return {**c_proj, "weight": RowParallelWeight(c_proj["weight"], all_reduce)}
    return {**p, "attn": {**p["attn"], "c_proj": proj(p["attn"]["c_proj"])},
            "mlp": {**p["mlp"], "c_proj": proj(p["mlp"]["c_proj"])}}


class HeadsOfPool:
    """A worker's heads of the engine's paged pool (a view of shared memory), with the calls chapter 3's
    ``ragged_transformer`` makes: ``update`` (prefill chunks) and ``attend_decodes`` (decoding tokens, each by
    ``attend_decode``: paged attention in place).
    The slots of each sequence come from the block tables the driver sends with every step."""

    def __init__(self, pool: np.ndarray, block_size: int):  # pool [L, slots, 2, H/w, D]
        self.pool, self.block_size = pool, block_size
        self.slots: dict = {}  # seq_id -> pool slot of positions 0 .. end of its chunk - 1
        self.runs: dict = {}  # seq_id -> its slots as runs, for a decode (found once, used by every layer)

    def set_tables(self, chunks: list[Chunk], tables: dict) -> None:
        self.slots = {c.seq_id: slot_indices(tables[c.seq_id], c.start + len(c.token_ids), self.block_size)
                      for c in chunks}
        self.runs = {}

    def update(self, seq_id, layer: int, start: int, k, v):  # k, v [H, T, D] -> all K, V so far [H, start+T, D]
        slots, pool = self.slots[seq_id], self.pool[layer]  # [start+T], [slots, 2, H, D]
        pool[slots[start:], 0] = k.transpose(1, 0, 2)  # scatter the chunk's tokens into their blocks [T, H, D]
        pool[slots[start:], 1] = v.transpose(1, 0, 2)
        kv = pool[slots]  # [S, 2, H, D]: gathered in position order
        return kv[:, 0].transpose(1, 0, 2), kv[:, 1].transpose(1, 0, 2)

    def attend_decode(self, seq_id, layer: int, start: int, q, k, v):  # q, k, v [H, 1, D] -> [H, 1, D]
        slots, pool = self.slots[seq_id], self.pool[layer]
        pool[slots[start], 0], pool[slots[start], 1] = k[:, 0], v[:, 0]
        if seq_id not in self.runs:
            self.runs[seq_id] = contiguous_runs(slots)
        return paged_decode_attention(q, pool, self.runs[seq_id])

    attend_decodes = KVStore.attend_decodes  # a step's decoding tokens: one attend_decode each, as chapter 3's store


class RaggedWorker:
    """One worker process: its shard (row-parallel weights all-reducing), its heads of the shared pool."""

    def __init__(self, rank: int, arrays: dict, barrier, shard: dict, n_head: int, eps: float, block_size: int):
        world = barrier.parties
        all_reduce = SharedMemoryAllReduce(arrays["partials"], rank, barrier)
        self.arrays, self.shard, self.eps, self.n_head = arrays, shard, eps, n_head // world
        self.blocks = [all_reducing(p, all_reduce) for p in shard["h"]]
        self.vocab = part(arrays["logits"].shape[1], rank, world)
        self.kv = HeadsOfPool(arrays["kv"][:, :, :, part(n_head, rank, world)], block_size)

    def step(self, rows: int, chunks: list[Chunk], tables: dict) -> None:
        """Chapter 3's step on this worker's shard: x [rows, E] from shared memory -> its columns of the logits."""
        self.kv.set_tables(chunks, tables)
        x = self.arrays["x"][:rows].copy()  # [N, E]: this worker's own residual stream (updated in place)
        x = ragged_transformer(self.blocks, x, chunks, self.kv, self.n_head, self.eps)  # [N, E]
        ends = np.cumsum([len(c.token_ids) for c in chunks])  # [B] row after each chunk's last token
        self.arrays["logits"][:len(chunks), self.vocab] = lm_head(self.shard, x[ends - 1], self.eps)  # [B, V/w]


class TensorParallelRunner(OwnsGroup):
    """``forward(model, store, chunks)`` over ``world_size`` worker processes, for chapter 5's engine::

        store = PrefixCachingKVStore(model.config, num_blocks, block_size)
        with TensorParallelRunner(model, store) as tp:
            engine = CachingLLMEngine(model, store, forward=tp)

    ``store`` (a float32 paged store, empty) gets its pool moved into shared memory. ``max_rows`` bounds the tokens
    of one step (the engine's ``max_num_batched_tokens``), ``max_seqs`` its sequences (``max_num_seqs``).
    """

    def __init__(self, model: GPT2Model, store: PagedKVStore, world_size: int = 2, max_rows: int = 2048,
                 max_seqs: int = 64):
        cfg = model.config
        if not is_integer(world_size, 1) or cfg.n_head % world_size:
            raise InvalidInputError(f"world_size must be a positive integer dividing n_head={cfg.n_head}, "
                                    f"got {world_size!r}")
        for name, value in (("max_rows", max_rows), ("max_seqs", max_seqs)):
            if not is_integer(value, 1):
                raise InvalidInputError(f"{name} must be a positive integer, got {value!r}")
        shape = (cfg.n_layer, store.capacity_tokens(), 2, cfg.n_head, cfg.head_dim)
        if getattr(store, "kv", None) is None or store.kv.shape != shape or store.kv.dtype != np.float32:
            raise InvalidInputError(f"the tensor-parallel step needs a float32 paged store of this model's shape "
                                    f"{shape}, got {type(store).__name__}")
        self.model, self.store, self.max_rows, self.max_seqs = model, store, int(max_rows), int(max_seqs)
        E, V, f32 = cfg.n_embd, cfg.vocab_size, np.float32
        specs = {"x": ((max_rows, E), f32), "partials": ((2, world_size, max_rows, E), f32),
                 "logits": ((max_seqs, V), f32), "kv": (shape, f32)}
        shards = [shard_params(model.params, r, world_size) for r in range(world_size)]
        args = [(cfg.n_head, cfg.layer_norm_epsilon, store.block_size)] * world_size
        self.group = ProcessGroup(RaggedWorker, shards, args, specs, name="tensor-parallel-engine")
        self.group.arrays["kv"][...] = store.kv  # the pool, now in shared memory: the workers fill their heads
        store.kv = self.group.arrays["kv"]

    def __call__(self, model: GPT2Model, store: PagedKVStore, chunks: list[Chunk]) -> np.ndarray:
        """One ragged step on the workers: the chunks' next-token logits [B, V]."""
        if model is not self.model or store is not self.store:
            raise InvalidInputError("a TensorParallelRunner runs the model and the store it was made with")
        rows = sum(len(c.token_ids) for c in chunks)
        if rows > self.max_rows or len(chunks) > self.max_seqs:
            raise InvalidInputError(f"a step of {rows} tokens in {len(chunks)} sequences exceeds this runner's "
                                    f"max_rows={self.max_rows} or max_seqs={self.max_seqs}; make it with larger limits")
        self.group.arrays["x"][:rows] = embed_chunks(model.params, chunks)  # "send" x: write it into shared memory
        self.group.call("step", rows, chunks, {c.seq_id: store.block_table(c.seq_id) for c in chunks})
        for c in chunks:  # the store's record of positions written, which a fork shares (its own update keeps it)
            store.written[c.seq_id] = max(store.written[c.seq_id], c.start + len(c.token_ids))
        return self.group.arrays["logits"][:len(chunks)].copy()  # [B, V]: every worker's columns, gathered
