"""Chapter 8: a pipeline of stages (GPipe's split of the layers) across worker processes.

Stage 0 holds the embeddings and layers 0 .. L/2-1, stage 1 layers L/2 .. L-1, the final layer norm and the LM
head (each stage its own copy of the tied ``wte``). A batch is cut into ``m`` micro-batches; stage 0 runs micro-batch
i, writes its activations [b*T, E] into shared-memory slot i and signals stage 1, then goes on with micro-batch
i+1 while stage 1 works on i. With p stages of equal time, one pass of m micro-batches keeps each stage idle for
p-1 of its m+p-1 time slots: the **bubble** (p-1)/(m+p-1), which more micro-batches shrink.

Decoding closes the ring: stage 1 picks each micro-batch's next tokens (greedy) and hands them straight back to
stage 0, which starts that micro-batch's next step while stage 1 finishes the others, so with m >= p the pipeline
stays full from step to step. Every layer function is chapter 1's (through ``tensor_parallel``'s batched block,
with no all-reduce: each stage holds whole layers and all heads).
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import InvalidInputError, is_integer
from ..ch01_forward.model import lm_head
from .process_group import BARRIER_TIMEOUT_S, CONTEXT, OwnsGroup, ProcessGroup
from .tensor_parallel import BatchKVCache, no_communication, part, tp_block
from ..loading.weights import GPT2Model


def stage_params(params: dict, stage: int, n_stages: int) -> dict:
    """Stage ``stage``'s layers; the first also the embeddings, the last also ``ln_f`` and the (tied) head."""
    out = {"h": params["h"][part(len(params["h"]), stage, n_stages)]}
    if stage == 0:
        out.update(wte=params["wte"], wpe=params["wpe"])
    if stage == n_stages - 1:
        out.update(wte=params["wte"], ln_f=params["ln_f"])
    return out


def ideal_bubble(n_stages: int, micro_batches: int) -> float:
    """GPipe's idle fraction for stages of equal time and free communication: (p-1)/(m+p-1)."""
    return (n_stages - 1) / (micro_batches + n_stages - 1)


def predicted_bubble(stage_seconds, micro_batches: int) -> float:
    """The idle fraction of one pass when stage s takes ``stage_seconds[s]`` per micro-batch: the pass lasts
    sum(t) + (m-1) x max(t) (the first micro-batch crosses every stage, the slowest stage then sets the pace),
    and the stages compute m x sum(t) of p times that. Equal times give (p-1)/(m+p-1)."""
    p, m, total = len(stage_seconds), micro_batches, sum(stage_seconds)
    return 1.0 - m * total / (p * (total + (m - 1) * max(stage_seconds)))


def gpipe_schedule(stage_seconds, micro_batches: int) -> list[list[tuple[float, float]]]:
    """The (start, end) of every micro-batch on every stage when stage s takes ``stage_seconds[s]`` per micro-batch
    and hand-offs are free: micro-batch i starts on stage s once it has left stage s-1 and stage s has finished
    micro-batch i-1. The result has ``bubble_fraction``'s shape; its bubble is ``predicted_bubble``'s."""
    if not is_integer(micro_batches, 1):
        raise InvalidInputError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
    if len(stage_seconds) == 0 or any(t < 0 for t in stage_seconds):
        raise InvalidInputError(f"stage_seconds must be one time >= 0 per stage, got {list(stage_seconds)!r}")
    busy = []
    for s, t in enumerate(stage_seconds):
        ends = [0.0] * micro_batches if s == 0 else [end for _, end in busy[-1]]  # when each left stage s-1
        stage, free_at = [], 0.0
        for i in range(micro_batches):
            start = max(ends[i], free_at)  # micro-batch i has arrived, and the stage is free
            stage.append((start, start + float(t)))
            free_at = start + float(t)
        busy.append(stage)
    return busy


def bubble_fraction(busy: list[list[tuple[float, float]]]) -> float:
    """Measured idle fraction: 1 - (time the stages computed) / (stages x wall time from first start to last end).
    ``busy[s]`` is stage s's list of (start, end) compute intervals (``time.perf_counter``, one clock for all)."""
    start = min(t0 for stage in busy for t0, _ in stage)
    end = max(t1 for stage in busy for _, t1 in stage)
    computed = sum(t1 - t0 for stage in busy for t0, t1 in stage)
    return 1.0 - computed / (len(busy) * (end - start))


class PipelineStage:
    """One stage in its own process. Both stages run ``generate`` at once; semaphores order their hand-offs."""

    def __init__(self, rank: int, arrays: dict, barrier, params: dict, n_stages: int, n_head: int, eps: float,
                 filled, returned):
        self.rank, self.arrays, self.params, self.n_head, self.eps = rank, arrays, params, n_head, eps
        self.last = rank == n_stages - 1
        self.filled, self.returned = filled, returned  # counting semaphores: slots filled (0 -> 1), tokens back

    def _signal_wait(self, semaphore) -> None:
        t0 = time.perf_counter()
        if not semaphore.acquire(timeout=BARRIER_TIMEOUT_S):
            raise TimeoutError(f"pipeline stage {self.rank}: the other stage sent nothing for {BARRIER_TIMEOUT_S} s")
        self.waited += time.perf_counter() - t0

    def _layers(self, x, batch: int, cache: BatchKVCache):  # x [b*T, E] -> [b*T, E]: this stage's blocks
        for layer, p in enumerate(self.params["h"]):
            x = tp_block(x, p, self.n_head, self.eps, batch, cache, layer, no_communication)
        cache.length += x.shape[0] // batch
        return x

    def generate(self, batch: int, length: int, new_tokens: int, micro_batches: int) -> dict:
        """Prefill ``batch`` prompts of ``length`` tokens (from shared ``prompts``) in ``micro_batches`` parts, then
        decode greedily to ``new_tokens`` tokens each; the last stage writes them into shared ``tokens``."""
        self.waited, self.comm, busy = 0.0, 0.0, []
        b = batch // micro_batches
        head_dim = self.params["h"][0]["attn"]["c_proj"]["weight"].shape[0] // self.n_head
        caches = [BatchKVCache(len(self.params["h"]), b, self.n_head, length + new_tokens, head_dim)
                  for _ in range(micro_batches)]
        run = self._first_stage_step if self.rank == 0 else self._last_stage_step
        for step in range(new_tokens):
            for i in range(micro_batches):
                rows = slice(i * b, (i + 1) * b)  # this micro-batch's sequences; its slot: rows b*T*i ...
                busy.append(run(step, rows, caches[i], i * b * length, length, new_tokens))
        return {"busy": busy, "wait_seconds": self.waited, "comm_seconds": self.comm}

    def _first_stage_step(self, step: int, rows: slice, cache: BatchKVCache, slot: int, length: int, new: int):
        if step > 0:
            self._signal_wait(self.returned)  # this micro-batch's previous token is back from the last stage
        t0 = time.perf_counter()
        ids = self.arrays["prompts"][rows, :length] if step == 0 else self.arrays["next"][rows, None]  # [b, T]
        pos = np.arange(cache.length, cache.length + ids.shape[1])  # [T]
        x = (self.params["wte"][ids] + self.params["wpe"][pos]).reshape(ids.size, -1)  # [b*T, E]
        x = self._layers(x, ids.shape[0], cache)
        t1 = time.perf_counter()
        self.arrays["acts"][slot:slot + len(x)] = x  # send: write into this micro-batch's shared slot
        self.comm += time.perf_counter() - t1
        self.filled.release()
        return t0, time.perf_counter()

    def _last_stage_step(self, step: int, rows: slice, cache: BatchKVCache, slot: int, length: int, new: int):
        self._signal_wait(self.filled)  # stage 0 has written this micro-batch's activations
        t0 = time.perf_counter()
        b, T = rows.stop - rows.start, (length if step == 0 else 1)
        x = self.arrays["acts"][slot:slot + b * T].copy()  # receive: [b*T, E]
        self.comm += time.perf_counter() - t0
        x = self._layers(x, b, cache).reshape(b, T, -1)[:, -1]  # [b, E]: each sequence's last position
        logits = lm_head(self.params, x, self.eps)  # [b, V]
        if step == 0:
            self.arrays["logits"][rows] = logits  # the prompts' next-token logits, for checking
        self.arrays["tokens"][rows, step] = self.arrays["next"][rows] = logits.argmax(axis=-1)  # greedy
        if step < new - 1:
            self.returned.release()  # hand the tokens back to stage 0
        return t0, time.perf_counter()


class PipelineModel(OwnsGroup):
    """GPT-2 in ``n_stages`` processes (2: layers 0-5 and 6-11 of GPT-2 small). ``generate(prompts, n, m)`` runs a
    batch of equal-length prompts in ``m`` micro-batches and returns greedy tokens; ``last_stats`` the stages'
    compute intervals (for ``bubble_fraction``), waits and copy times."""

    def __init__(self, model: GPT2Model, n_stages: int = 2, max_batch: int = 32, max_tokens: int = 256,
                 max_micro_batches: int = 8):
        cfg = model.config
        if n_stages != 2:
            raise InvalidInputError(f"this pipeline has 2 stages (a ring of two semaphores), got n_stages={n_stages!r}")
        self.model, self.max_batch, self.max_tokens, self.max_mb = model, max_batch, max_tokens, max_micro_batches
        specs = {"prompts": ((max_batch, max_tokens), np.int64), "next": ((max_batch,), np.int64),
                 "tokens": ((max_batch, max_tokens), np.int64), "logits": ((max_batch, cfg.vocab_size), np.float32),
                 "acts": ((max_batch * max_tokens, cfg.n_embd), np.float32)}  # micro-batch i's slot: rows b*T*i ..
        semaphores = (CONTEXT.Semaphore(0), CONTEXT.Semaphore(0))
        params = [stage_params(model.params, s, n_stages) for s in range(n_stages)]
        args = [(n_stages, cfg.n_head, cfg.layer_norm_epsilon, *semaphores)] * n_stages
        self.group = ProcessGroup(PipelineStage, params, args, specs, name="pipeline")
        self.last_stats: list[dict] = []

    def generate(self, prompts, max_new_tokens: int, micro_batches: int = 1) -> np.ndarray:
        """prompts [B, T] (or one [T]) -> greedy tokens [B, max_new_tokens] (or [max_new_tokens])."""
        ids = np.asarray(prompts)
        batch = ids.reshape(1, -1) if ids.ndim == 1 else ids
        B, T = batch.shape
        self._check(batch, max_new_tokens, micro_batches)
        self.group.arrays["prompts"][:B, :T] = batch
        self.last_stats = self.group.call("generate", B, T, max_new_tokens, micro_batches)
        tokens = self.group.arrays["tokens"][:B, :max_new_tokens].copy()
        return tokens[0] if ids.ndim == 1 else tokens

    def prefill_logits(self, batch: int) -> np.ndarray:
        """The next-token logits [B, V] of the prompts of the last ``generate``."""
        return self.group.arrays["logits"][:batch].copy()

    def _check(self, batch: np.ndarray, new: int, m: int) -> None:
        for row in batch:
            self.model.check_tokens(row)
        B, T = batch.shape
        if not (is_integer(new, 1) and is_integer(m, 1, self.max_mb)) or B % m:
            raise InvalidInputError(f"max_new_tokens must be >= 1 and micro_batches an integer from 1 to "
                                    f"{self.max_mb} dividing the batch of {B}; got {new!r} and {m!r}")
        if B > self.max_batch or T + new > min(self.max_tokens, self.model.config.n_positions):
            raise InvalidInputError(f"{B} prompts of {T} + {new} tokens exceed max_batch={self.max_batch}, "
                                    f"max_tokens={self.max_tokens} or n_ctx={self.model.config.n_positions}")
