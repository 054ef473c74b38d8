"""Chapter 8: tensor parallelism (Megatron-LM's split of every layer) across worker processes.

Each of ``world_size`` workers holds 1/world of every layer's weights and does 1/world of its arithmetic:

* ``c_attn`` and the MLP's ``c_fc`` are split by **output columns** ("column-parallel"): worker r computes the Q,
  K and V of its own heads, and its share of the MLP's 4E hidden units. No communication is needed: the
  attention of a head needs only that head's Q, K and V, and GELU works element by element.
* the two ``c_proj`` are split by **input rows** ("row-parallel"): worker r multiplies its slice of the hidden
  vector by its rows of W, which gives a *partial sum* of the output. The full output is the sum of the workers'
  partials: one **all-reduce** per projection, two per block. The bias is added once, after the sum.
* the LM head (the tied ``wte``) is split by **vocabulary**: worker r computes the logits of its share of the
  tokens and writes them into its columns of one shared logits array (a gather).

Every layer function is chapter 1's, and each worker keeps chapter 2's KV cache for its own heads. The all-reduce
goes through shared memory (``SharedMemoryAllReduce``); the processes are ``process_group``'s. For speed figures
the driver and the workers run B sequences of one length as one [B*T, E] matrix (``BatchKVCache``).
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import CacheCapacityError, InvalidInputError, is_integer
from ..ch01_forward.model import attention, gelu, layer_norm, linear, lm_head
from .process_group import BARRIER_TIMEOUT_S, OwnsGroup, ProcessGroup
from ..loading.weights import GPT2Model


# --- splitting the weights ---------------------------------------------------------------------------------------

def part(n: int, rank: int, world: int) -> slice:
    """Worker ``rank``'s share of ``n`` things: a contiguous range, the first ``n % world`` shares one larger."""
    return slice(rank * n // world, (rank + 1) * n // world)


def qkv_columns(n_embd: int, rank: int, world: int) -> np.ndarray:
    """The columns of c_attn's [E, 3E] weight that produce worker ``rank``'s heads of Q, K and V (in that order)."""
    mine = np.arange(n_embd)[part(n_embd, rank, world)]  # this worker's heads' columns within Q (head-major)
    return np.concatenate([mine, n_embd + mine, 2 * n_embd + mine])  # ... and the same within K and within V


def shard_layer(p: dict, rank: int, world: int) -> dict:
    """One block's weights for worker ``rank``: column-parallel c_attn, c_fc; row-parallel c_proj (full bias)."""
    E = p["ln_1"]["weight"].shape[0]
    cols, heads, hidden = qkv_columns(E, rank, world), part(E, rank, world), part(4 * E, rank, world)
    c_attn, a_proj, c_fc, m_proj = p["attn"]["c_attn"], p["attn"]["c_proj"], p["mlp"]["c_fc"], p["mlp"]["c_proj"]
    copy = np.ascontiguousarray
    return {"ln_1": p["ln_1"], "ln_2": p["ln_2"],
            "attn": {"c_attn": {"weight": copy(c_attn["weight"][:, cols]), "bias": c_attn["bias"][cols]},  # [E, 3E/w]
                     "c_proj": {"weight": copy(a_proj["weight"][heads]), "bias": a_proj["bias"]}},  # [E/w, E]
            "mlp": {"c_fc": {"weight": copy(c_fc["weight"][:, hidden]), "bias": c_fc["bias"][hidden]},  # [E, 4E/w]
                    "c_proj": {"weight": copy(m_proj["weight"][hidden]), "bias": m_proj["bias"]}}}  # [4E/w, E]


def shard_params(params: dict, rank: int, world: int) -> dict:
    """Worker ``rank``'s weights: its share of every block and its share of the vocabulary's rows of ``wte``."""
    vocab = part(params["wte"].shape[0], rank, world)
    return {"h": [shard_layer(p, rank, world) for p in params["h"]], "ln_f": params["ln_f"],
            "wte": np.ascontiguousarray(params["wte"][vocab])}  # [V/w, E]: the LM head's rows for these tokens


# --- one worker's forward ----------------------------------------------------------------------------------------

class BatchKVCache:
    """Chapter 2's cache for B sequences of one length, for this worker's H heads: ``k[layer]`` is [B, H, cap, D]."""

    def __init__(self, n_layer: int, batch: int, n_head: int, capacity: int, head_dim: int):
        self.k = np.zeros((n_layer, batch, n_head, capacity, head_dim), dtype=np.float32)
        self.v = np.zeros_like(self.k)
        self.capacity, self.length = capacity, 0

    def update(self, layer: int, k, v):  # k, v [B, H, T, D] -> every key, value so far as [B*H, S, D] (views)
        B, H, T, D = k.shape
        end = self.length + T
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end].reshape(B * H, end, D), self.v[layer, :, :, :end].reshape(B * H, end, D)


def local_attention(x, attn: dict, n_head: int, batch: int, cache: BatchKVCache, layer: int):
    """This worker's heads: x [B*T, E] -> their outputs [B*T, H*D] (H = this worker's heads), K/V cached."""
    qkv = linear(x, **attn["c_attn"])  # [B*T, 3*H*D]: this worker's heads of Q, K, V side by side
    T = qkv.shape[0] // batch
    q, k, v = qkv.reshape(batch, T, 3, n_head, -1).transpose(2, 0, 3, 1, 4)  # 3 x [B, H, T, D]
    k_all, v_all = cache.update(layer, k, v)  # [B*H, S, D]
    out = attention(q.reshape(batch * n_head, T, -1), k_all, v_all)  # [B*H, T, D]: chapter 1's attention
    return out.reshape(batch, n_head, T, -1).transpose(0, 2, 1, 3).reshape(batch * T, -1)  # [B*T, H*D]


def row_parallel(x_part, weight, bias, all_reduce):  # x_part [N, in/w]; weight [in/w, out]; bias [out] -> [N, out]
    """A row-parallel linear layer: each worker's rows give a partial sum; the all-reduce adds them up on every
    worker; the bias, which is not split, is added once, after the sum."""
    return all_reduce(x_part @ weight) + bias  # [N, out], the same on every worker


def sum_in_rank_order(partials: list):
    """The all-reduce of partials that are all in one process: their sum, in rank order."""
    total = partials[0].copy()
    for partial in partials[1:]:
        total += partial
    return total


def split_row_parallel(x, weight, bias, world: int, all_reduce=sum_in_rank_order):
    """A row-parallel linear layer with ``world`` workers played in one process: worker r's columns of x times its
    rows of W give a partial [N, out]; ``all_reduce`` (partials -> their sum) adds them up; the bias comes once."""
    partials = [x[:, part(x.shape[1], r, world)] @ weight[part(weight.shape[0], r, world)] for r in range(world)]
    return all_reduce(partials) + bias  # [N, out] == x @ weight + bias, up to float32 rounding


def tp_block(x, p: dict, n_head: int, eps: float, batch: int, cache: BatchKVCache, layer: int, all_reduce):
    """Chapter 1's block with this worker's share of the weights: two all-reduces. x [B*T, E] -> [B*T, E]."""
    heads = local_attention(layer_norm(x, **p["ln_1"], eps=eps), p["attn"], n_head, batch, cache, layer)
    x = x + row_parallel(heads, **p["attn"]["c_proj"], all_reduce=all_reduce)  # [B*T, E]
    hidden = gelu(linear(layer_norm(x, **p["ln_2"], eps=eps), **p["mlp"]["c_fc"]))  # [B*T, 4E/w]: column-parallel
    return x + row_parallel(hidden, **p["mlp"]["c_proj"], all_reduce=all_reduce)  # [B*T, E]


def shard_forward(shard: dict, x, n_head: int, eps: float, batch: int, cache: BatchKVCache, all_reduce,
                  last_only: bool = False):
    """Every block on this worker's shard, then its share of the logits: x [B*T, E] -> [B*T or B, V/w]."""
    for layer, p in enumerate(shard["h"]):
        x = tp_block(x, p, n_head, eps, batch, cache, layer, all_reduce)  # [B*T, E]
    cache.length += x.shape[0] // batch
    if last_only:
        x = x.reshape(batch, -1, x.shape[1])[:, -1]  # [B, E]: each sequence's last position
    return lm_head(shard, x, eps)  # [N, V/w]: chapter 1's head on this worker's rows of wte


def no_communication(partial):
    """The all-reduce of a world of one: the partial sum is the whole sum."""
    return partial


# --- the all-reduce through shared memory --------------------------------------------------------------------------

class SharedMemoryAllReduce:
    """Sum every worker's [N, E] partial through shared memory.

    Worker r writes its partial into its slot, waits at the barrier until every worker has written, then adds
    the slots in rank order, so every worker gets the bitwise same sum (its residual stream stays identical to
    the others'). Two sets of slots, used in turn, make one barrier per all-reduce enough: a worker can only come
    back to a set after every worker has passed the barrier of the all-reduce in between, which they reach only
    after reading that set.
    """

    def __init__(self, slots, rank: int, barrier):  # slots [2, world, max_rows, E] in shared memory
        self.slots, self.rank, self.barrier = slots, rank, barrier
        self.calls, self.seconds, self.bytes_written = 0, 0.0, 0

    def __call__(self, partial):  # partial [N, E] -> sum over workers [N, E]
        t0 = time.perf_counter()
        slots = self.slots[self.calls % 2, :, :partial.shape[0]]  # [world, N, E]
        slots[self.rank] = partial  # "send": write into shared memory
        self.barrier.wait(timeout=BARRIER_TIMEOUT_S)  # every worker's partial is in place
        total = slots.sum(axis=0)  # [N, E], summed in rank order on every worker
        self.calls += 1
        self.bytes_written += partial.nbytes
        self.seconds += time.perf_counter() - t0
        return total


class TensorParallelWorker:
    """One worker process: its shard, its all-reduce and its heads' KV cache. The driver calls its methods."""

    def __init__(self, rank: int, arrays: dict, barrier, shard: dict, n_head: int, eps: float):
        self.rank, self.arrays, self.shard, self.n_head, self.eps = rank, arrays, shard, n_head, eps
        self.all_reduce = SharedMemoryAllReduce(arrays["partials"], rank, barrier)
        self.vocab = part(arrays["logits"].shape[1], rank, barrier.parties)
        self.cache = None

    def start(self, batch: int, capacity: int) -> None:
        """A new, empty KV cache for ``batch`` sequences of up to ``capacity`` tokens."""
        layers, head_dim = len(self.shard["h"]), self.shard["h"][0]["attn"]["c_proj"]["weight"].shape[0] // self.n_head
        self.cache = BatchKVCache(layers, batch, self.n_head, capacity, head_dim)

    def all_reduce_alone(self, rows: int, repeats: int) -> float:
        """Seconds per all-reduce of [rows, E] with no compute between: the price of one, barrier included."""
        partial = np.ones((rows, self.arrays["x"].shape[1]), dtype=np.float32)
        self.all_reduce(partial)  # both workers in step
        t0 = time.perf_counter()
        for _ in range(repeats):
            self.all_reduce(partial)
        return (time.perf_counter() - t0) / repeats

    def forward(self, rows: int, last_only: bool) -> dict:
        """Read the driver's input x [rows, E] from shared memory; write this worker's columns of the logits."""
        self.all_reduce.seconds, self.all_reduce.bytes_written = 0.0, 0
        t0 = time.perf_counter()
        batch = self.cache.k.shape[1]
        logits = shard_forward(self.shard, self.arrays["x"][:rows], self.n_head, self.eps, batch, self.cache,
                               self.all_reduce, last_only)  # [N, V/w]
        t1 = time.perf_counter()
        self.arrays["logits"][:len(logits), self.vocab] = logits  # the gather: disjoint columns of one array
        gather = time.perf_counter() - t1
        return {"seconds": time.perf_counter() - t0, "comm_seconds": self.all_reduce.seconds + gather,
                "comm_bytes": self.all_reduce.bytes_written + logits.nbytes}


# --- the driver ---------------------------------------------------------------------------------------------------

class TensorParallelModel(OwnsGroup):
    """A GPT-2 split over ``world_size`` worker processes. The driver embeds the tokens, writes them into shared
    memory and reads the gathered logits back; the workers run every block. Greedy ``generate`` equals chapter 2's.

    ``max_rows`` bounds the tokens of one call (B*T), ``max_logit_rows`` the rows of logits one call returns.
    Use as a context manager, or call ``close()``.
    """

    def __init__(self, model: GPT2Model, world_size: int = 2, max_rows: int = 1024, max_logit_rows: int = 64):
        cfg = model.config
        if not is_integer(world_size, 1) or cfg.n_head % world_size:
            raise InvalidInputError(f"world_size must be a positive integer dividing n_head={cfg.n_head}, "
                                    f"got {world_size!r}")
        self.model, self.world_size = model, world_size
        self.max_rows, self.max_logit_rows, self.length, self.batch = max_rows, max_logit_rows, 0, 0
        E, V, f32 = cfg.n_embd, cfg.vocab_size, np.float32
        specs = {"x": ((max_rows, E), f32), "partials": ((2, world_size, max_rows, E), f32),
                 "logits": ((max_logit_rows, V), f32)}
        shards = [shard_params(model.params, r, world_size) for r in range(world_size)]
        args = [(cfg.n_head // world_size, cfg.layer_norm_epsilon)] * world_size
        self.group = ProcessGroup(TensorParallelWorker, shards, args, specs, name="tensor-parallel")
        self.last_stats: list[dict] = []

    def _run(self, token_ids: np.ndarray, last_only: bool) -> np.ndarray:  # token_ids [B, T] -> logits [N, V]
        B, T = token_ids.shape
        positions = np.arange(self.length, self.length + T)  # [T]
        x = self.model.params["wte"][token_ids] + self.model.params["wpe"][positions]  # [B, T, E]: embed (driver)
        self.group.arrays["x"][:B * T] = x.reshape(B * T, -1)  # "send" the input: write it into shared memory
        self.last_stats = self.group.call("forward", B * T, last_only)
        self.length += T
        rows = B if last_only else B * T
        return self.group.arrays["logits"][:rows].copy()  # [N, V]: every worker's columns, gathered

    def prefill(self, token_ids, capacity: int | None = None, last_only: bool = False) -> np.ndarray:
        """Start B new sequences (token_ids [T] or [B, T], one length) with empty caches; return their logits:
        [T, V] for one sequence, [B*T, V] for a batch, [B, V] with ``last_only``."""
        ids, self.capacity = self._check(token_ids, capacity, last_only)
        self.group.call("start", ids.shape[0], self.capacity)
        self.length, self.batch = 0, ids.shape[0]
        return self._run(ids, last_only)

    def decode_step(self, tokens) -> np.ndarray:
        """One new token per sequence (an int, or [B] ints); returns the next-token logits: [V], or [B, V]."""
        if self.batch == 0:
            raise InvalidInputError("decode_step before prefill: there is no sequence to extend")
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)  # [B, 1]
        if ids.shape[0] != self.batch:
            raise InvalidInputError(f"decode_step got {ids.shape[0]} tokens for a batch of {self.batch} sequences")
        self.model.check_tokens(ids[:, 0])
        if self.length + 1 > self.capacity:
            raise CacheCapacityError(f"KV cache full: {self.length} cached + 1 new token exceeds its capacity of "
                                     f"{self.capacity}")
        logits = self._run(ids, last_only=True)  # [B, V]
        return logits[0] if np.ndim(tokens) == 0 else logits

    def _check(self, token_ids, capacity: int | None, last_only: bool) -> tuple[np.ndarray, int]:
        ids = np.asarray(token_ids)
        ids = ids.reshape(1, -1) if ids.ndim == 1 else ids  # [B, T]
        if ids.ndim != 2 or ids.size == 0:
            raise InvalidInputError(f"token_ids must be [T] or [B, T] and not empty, got shape {ids.shape}")
        ids = np.stack([self.model.check_tokens(row) for row in ids])  # [B, T] int64, each row checked
        B, T = ids.shape
        capacity = T if capacity is None else capacity
        if not is_integer(capacity, T, self.model.config.n_positions):
            raise CacheCapacityError(f"capacity must be an integer from the prompt's {T} tokens to n_ctx="
                                     f"{self.model.config.n_positions}, got {capacity!r}")
        logit_rows = B if last_only else B * T
        if B * T > self.max_rows or logit_rows > self.max_logit_rows:
            raise InvalidInputError(f"{B} x {T} tokens ({logit_rows} rows of logits) exceed this model's max_rows="
                                    f"{self.max_rows} or max_logit_rows={self.max_logit_rows}; make it with larger "
                                    "limits")
        return ids, capacity

    def generate(self, token_ids, max_new_tokens: int) -> np.ndarray:
        """Greedy tokens, [max_new_tokens] for one prompt [T] or [B, max_new_tokens] for a batch [B, T]."""
        ids = np.asarray(token_ids)
        logits = self.prefill(ids, capacity=ids.shape[-1] + max_new_tokens, last_only=True)  # [B, V]
        new = []
        for step in range(max_new_tokens):
            new.append(logits.argmax(axis=-1))  # [B]
            if step < max_new_tokens - 1:
                logits = self.decode_step(new[-1])
        out = np.stack(new, axis=1)  # [B, n]
        return out[0] if ids.ndim == 1 else out
