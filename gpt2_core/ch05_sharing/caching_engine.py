"""Chapter 5's engine: chapter 3's ``LLMEngine`` over a store that shares blocks, with a scheduler that chunks.

What a step does differently from chapter 3's:

* the scheduler (``ChunkedPrefillScheduler``) gives each sequence a number of tokens: 1 for a decode, a chunk of
  its prompt for a prefill, after the prefix of the prompt found cached;
* after the model step every sequence's newly full blocks are registered in the prefix cache, and a sequence
  samples only if its chunk reached its last token (a chunk in the middle of a prompt predicts a token it already
  has);
* a request with ``n > 1`` samples (parallel sampling) is prefilled once; when its first token is sampled it
  **forks** into ``n`` sequences that share the prompt's blocks (chapter 4's ``fork``; the partly filled last block
  is copied on the first write). Sample ``i`` samples with seed ``seed + i``, as vLLM seeds its samples, so it
  gives the tokens of a lone request with that seed.

Decode attention reads the blocks in place (``PagedAttentionKVStore``), through chapter 3's ``model_step`` (the
``ragged_forward`` of the model's architecture).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from ..ch04_paged.block_manager import blocks_needed
from .chunked_prefill import ChunkedPrefillScheduler
from ..ch03_batching.engine import LLMEngine, RequestOutput
from ..errors import CacheCapacityError, InvalidInputError, is_integer
from ..ch03_batching.model_runner import Chunk, model_step
from .prefix_cache import PrefixCachingKVStore
from ..ch01_forward.sampling import Sampler
from ..ch03_batching.scheduler import check_limits
from ..ch03_batching.sequence import Request, Sequence, SequenceStatus
from ..loading.weights import GPT2Model


class CachingLLMEngine(LLMEngine):
    """Continuous batching with prefix caching, chunked prefill, parallel sampling and paged attention.

    ``store``: a ``PrefixCachingKVStore`` (default: room for ``max_num_seqs`` full contexts in blocks of 16).
    ``enable_prefix_caching`` / ``enable_chunked_prefill`` switch the two scheduling features (both on, as in vLLM
    V1); with both off the engine schedules as chapter 3's, over the paged-attention store.
    """

    def __init__(self, model: GPT2Model, store: PrefixCachingKVStore | None = None, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, clock: Callable[[], float] = time.perf_counter,
                 scheduler_cls: Callable[..., ChunkedPrefillScheduler] = ChunkedPrefillScheduler):
        check_limits(max_num_seqs, max_num_batched_tokens)  # before the default store takes its memory
        for name, flag in (("enable_prefix_caching", enable_prefix_caching),
                           ("enable_chunked_prefill", enable_chunked_prefill)):
            if not isinstance(flag, (bool, np.bool_)):
                raise InvalidInputError(f"{name} must be True or False, got {flag!r}")
        if store is None:
            blocks = int(max_num_seqs) * blocks_needed(model.config.n_positions, 16)
            store = PrefixCachingKVStore(model.config, num_blocks=blocks, block_size=16)
        elif not isinstance(store, PrefixCachingKVStore):
            raise InvalidInputError(f"the caching engine needs a PrefixCachingKVStore, got {type(store).__name__}")
        super().__init__(model, store=store, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, clock=clock)
        # scheduler_cls: called with the store, the limits and the two switches, it returns a ChunkedPrefillScheduler
        # that may order its queues otherwise (the server's PriorityScheduler)
        self.scheduler = scheduler_cls(self.store, int(max_num_seqs), int(max_num_batched_tokens),
                                                 model.config.n_positions, enable_chunked_prefill,
                                                 enable_prefix_caching)
        self.num_prefill_tokens = 0  # prompt (and recomputed) tokens run through the model
        self._sample_ids: set = set()  # (request_id, i) of the samples requests with n > 1 will fork
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache instead

    def add_request(self, request: Request, arrival_time: float | None = None,
                    on_token: Callable[[Sequence, int], None] | None = None, n: int = 1) -> int:
        """Chapter 3's ``add_request``; ``n > 1`` asks for ``n`` samples of the request (``samples``). A bad ``n``
        is an ``InvalidInputError`` before anything is queued."""
        if not is_integer(n, 1):
            raise InvalidInputError(f"n (the number of samples) must be an integer >= 1, got {n!r}")
        if n > self.scheduler.max_num_seqs:
            raise InvalidInputError(f"n={n} samples run at once, more than max_num_seqs={self.scheduler.max_num_seqs}")
        sample_ids = [(getattr(request, "request_id", None), i) for i in range(1, n)]
        taken = [i for i in sample_ids if i in self._by_request or i in self._sample_ids]
        if taken:
            raise InvalidInputError(f"request_id {taken[0]!r} is taken: sample i of request r is named (r, i)")
        seq_id = super().add_request(request, arrival_time, on_token)
        self.sequences[seq_id].num_samples = int(n)
        self._sample_ids.update(sample_ids)
        return seq_id

    def _check_new(self, requests: list) -> None:
        super()._check_new(requests)
        for r in requests:
            if r.request_id in self._sample_ids:
                raise InvalidInputError(f"request_id {r.request_id!r} is taken by a sample of request "
                                        f"{r.request_id[0]!r}")

    def samples(self, request_id) -> list[RequestOutput]:
        """The outputs of every sample of ``request_id``: sample 0 is the request's own sequence, sample ``i`` the
        sequence forked for it (``request_id`` ``(request_id, i)``)."""
        seq = self.get_sequence(request_id)
        n = getattr(seq, "num_samples", 1)
        forked = [self._by_request.get((request_id, i)) for i in range(1, n)]
        return [RequestOutput.from_sequence(s) for s in [seq, *forked] if s is not None]

    def release_request(self, request_id) -> None:
        n = getattr(self.get_sequence(request_id), "num_samples", 1)
        super().release_request(request_id)
        self._sample_ids.difference_update((request_id, i) for i in range(1, n))

    def prefix_cache_stats(self) -> dict:
        m = self.store.manager
        return {"queried_tokens": m.num_queried_tokens, "hit_tokens": m.num_hit_tokens, "hit_rate": m.hit_rate,
                "cached_blocks": m.allocator.num_cached_blocks, "evictions": m.allocator.num_evictions,
                "prefill_tokens_computed": self.num_prefill_tokens}

    # -- one step -------------------------------------------------------------------------------------------------
    def step(self) -> list[tuple[object, int]]:
        """Schedule, run one ragged model step, register the blocks it filled, sample where a chunk reached the end
        of its sequence (forking the samples of a request with ``n > 1``). Returns the ``(request_id, token)`` pairs
        produced. A step cannot start inside another (from an ``on_token`` callback or a ``logits_processor``)."""
        if self._in_step:
            raise InvalidInputError("step() was called from inside a step (from an on_token callback or a "
                                    "logits_processor); return instead, the caller steps again")
        self._in_step = True
        try:
            return self._caching_step()
        finally:
            self._in_step = False

    def _caching_step(self) -> list[tuple[object, int]]:
        start = self.clock()
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            if self.scheduler.waiting and not (self.scheduler.running or plan.preempted):  # no one will free room
                raise CacheCapacityError(f"{len(self.scheduler.waiting)} request(s) wait, none is running, and the "
                                         f"KV store has no room for the first: something else holds its memory")
            return []
        stats = self._begin_stats(plan, start)
        chunks = []
        for seq in plan.scheduled:
            a = seq.num_computed_tokens
            b = a + plan.num_scheduled_tokens[seq.seq_id]
            chunks.append(Chunk(seq.seq_id, np.asarray(seq.token_ids[a:b], dtype=np.int64), a))
        try:
            logits = model_step(self.model, self.store, chunks)  # [B, V]
        except BaseException:  # incl. Ctrl-C: nothing was sampled, so every sequence of the step waits again
            for seq in reversed(plan.scheduled):
                self.scheduler.requeue(seq)
            raise
        now = self.clock()
        self.num_prefill_tokens += plan.num_batched_tokens - plan.num_decode_seqs
        self.num_cached_tokens += plan.num_cached_tokens
        outputs = []
        for seq, row in zip(plan.scheduled, logits):
            seq.num_computed_tokens += plan.num_scheduled_tokens[seq.seq_id]
            if self.scheduler.enable_prefix_caching:
                self.store.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a chunk in the middle of its prompt: its logits predict a token the prompt has
            samples = [seq]
            if not seq.output_token_ids and getattr(seq, "num_samples", 1) > 1:
                samples += self._fork(seq)  # before seq's own token: seq may finish and free its blocks with it
            for s in samples:
                token = self._sample(s, row, now)  # each sample with its own seeded sampler
                if token is not None:
                    self._append_token(s, token, now)
                    outputs.append((s.request_id, token))
        stats.end_time, stats.num_running = now, len(self.scheduler.running)
        stats.num_waiting = len(self.scheduler.waiting)
        self.step_stats.append(stats)
        self.num_steps += 1
        self._call_back(outputs, now)  # only once every sequence's state is up to date
        return outputs

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Samples 1 .. n-1 of ``parent``'s request, each a new running sequence sharing ``parent``'s blocks."""
        children, params = [], parent.sampler.params
        for i in range(1, parent.num_samples):
            child = Sequence(self._next_id, parent.request, arrival_time=parent.metrics.arrival_time)
            self._next_id += 1
            child.request_id = (parent.request_id, i)
            child.prompt_token_ids, child.max_new_tokens = list(parent.prompt_token_ids), parent.max_new_tokens
            child.sampler = Sampler(params if params.seed is None else replace(params, seed=params.seed + i))
            child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
            self.store.fork(parent.seq_id, child.seq_id)  # shares every block, ref counts + 1
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = SequenceStatus.RUNNING
            self.scheduler.running.append(child)
            self.sequences[child.seq_id], self._by_request[child.request_id] = child, child
            self._pending[child.seq_id] = []
            if parent.seq_id in self._callbacks:
                self._callbacks[child.seq_id] = self._callbacks[parent.seq_id]
            children.append(child)
        return children
