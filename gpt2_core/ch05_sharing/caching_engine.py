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

Decode attention reads the blocks in place, or gathers a sequence whose blocks lie scattered
(``PagedAttentionKVStore``), through chapter 3's ``model_step`` (the
``ragged_forward`` of the model's architecture).
The step itself is chapter 3's: this engine passes in its scheduler and store and overrides two hooks,
``_after_forward`` (register blocks, skip the middle of a prompt, fork) and ``_samples_of`` (a request's forks).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from ..ch04_paged.block_manager import blocks_needed
from ..ch04_paged.paged_kv_store import FP32, KVCodec
from .chunked_prefill import ChunkedPrefillScheduler
from ..ch03_batching.engine import LLMEngine, ModelForward, RequestOutput
from ..errors import InvalidInputError, is_integer
from ..ch03_batching.model_runner import Chunk, model_step
from .prefix_cache import PrefixCachingKVStore
from ..ch01_forward.sampling import Sampler
from ..ch03_batching.sequence import Request, Sequence, SequenceStatus
from ..loading.weights import GPT2Model


class CachingLLMEngine(LLMEngine):
    """Continuous batching with prefix caching, chunked prefill, parallel sampling and paged attention.

    ``store``: a ``PrefixCachingKVStore`` (default: ``make_kv_store``, room for ``max_num_seqs`` full contexts in
    blocks of 16). ``enable_prefix_caching`` / ``enable_chunked_prefill`` switch the two scheduling features (both
    on, as in vLLM V1); with both off the engine schedules as chapter 3's, over the paged-attention store.
    ``scheduler_cls`` and ``forward`` are chapter 3's; the scheduler also gets the two switches.
    """

    def __init__(self, model: GPT2Model, store: PrefixCachingKVStore | None = None, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, clock: Callable[[], float] = time.perf_counter,
                 scheduler_cls: Callable[..., ChunkedPrefillScheduler] = ChunkedPrefillScheduler,
                 forward: ModelForward = model_step, kv_codec: KVCodec | None = None):
        for name, flag in (("enable_prefix_caching", enable_prefix_caching),
                           ("enable_chunked_prefill", enable_chunked_prefill)):
            if not isinstance(flag, (bool, np.bool_)):
                raise InvalidInputError(f"{name} must be True or False, got {flag!r}")
        if store is not None and kv_codec is not None:
            raise InvalidInputError("kv_codec is for the default store; a store passed in has its own codec")
        if store is not None and not isinstance(store, PrefixCachingKVStore):
            raise InvalidInputError(f"the caching engine needs a PrefixCachingKVStore, got {type(store).__name__}")
        self.kv_codec = FP32 if kv_codec is None else kv_codec  # read by make_kv_store, during super().__init__
        scheduler_cls = functools.partial(scheduler_cls, enable_chunked_prefill=enable_chunked_prefill,
                                          enable_prefix_caching=enable_prefix_caching)
        super().__init__(model, store=store, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         clock=clock, scheduler_cls=scheduler_cls, forward=forward)
        self.num_prefill_tokens = 0  # prompt (and recomputed) tokens run through the model
        self._sample_ids: set = set()  # (request_id, i) of the samples requests with n > 1 will fork
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache instead

    def make_kv_store(self, max_num_seqs: int, max_len: int | None = None) -> PrefixCachingKVStore:
        """The default store: room for ``max_num_seqs`` sequences of ``max_len`` tokens (the context) in blocks of
        16, K/V kept by the ``kv_codec`` given (chapter 4's float32 by default; chapter 6's ``Int8Codec``, say)."""
        blocks = max_num_seqs * blocks_needed(max_len or self.model.config.n_positions, 16)
        return PrefixCachingKVStore(self.model.config, num_blocks=blocks, block_size=16, codec=self.kv_codec)

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
        if n > 1:  # the scheduler keeps n places for it until it forks
            self.scheduler.num_samples[request.request_id] = int(n)
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
        return [RequestOutput.from_sequence(s) for s in self._samples_of(request_id)]

    def _samples_of(self, request_id) -> list[Sequence]:
        """The request's own sequence, then the samples forked from it so far."""
        forked = (self._by_request.get((request_id, i)) for i in range(1, self._num_samples(request_id)))
        return [self.get_sequence(request_id), *(s for s in forked if s is not None)]

    def _num_samples(self, request_id) -> int:
        return self.scheduler.num_samples.get(request_id, 1)

    def release_request(self, request_id) -> None:
        n = self._num_samples(request_id)
        super().release_request(request_id)
        self.scheduler.num_samples.pop(request_id, None)
        self._sample_ids.difference_update((request_id, i) for i in range(1, n))

    def prefix_cache_stats(self) -> dict:
        m = self.store.manager
        return {"queried_tokens": m.num_queried_tokens, "hit_tokens": m.num_hit_tokens, "hit_rate": m.hit_rate,
                "cached_blocks": m.allocator.num_cached_blocks, "evictions": m.allocator.num_evictions,
                "prefill_tokens_computed": self.num_prefill_tokens}

    def kv_stats(self) -> dict:
        """Chapter 3's numbers, and the blocks: in use, free, in all, and the prefix cache's lookups and hits."""
        m = self.store.manager
        return {**super().kv_stats(), "num_blocks": m.num_blocks, "num_used_blocks": m.num_used_blocks(),
                "num_free_blocks": m.num_free_blocks, "queried_tokens": m.num_queried_tokens,
                "hit_tokens": m.num_hit_tokens, "hit_rate": m.hit_rate}

    # -- one step: chapter 3's, with two hooks ----------------------------------------------------------------------
    def _run_model(self, plan, chunks: list[Chunk]) -> np.ndarray:
        logits = super()._run_model(plan, chunks)
        self.num_prefill_tokens += plan.num_batched_tokens - plan.num_decode_seqs
        self.num_cached_tokens += plan.num_cached_tokens
        return logits

    def _after_forward(self, seq: Sequence, logits: np.ndarray, now: float) -> list[tuple[object, int]]:
        """Register the blocks ``seq``'s chunk filled; sample only if the chunk reached its last token, forking the
        samples of a request with ``n > 1`` at its first token (each sample then draws from the same logits)."""
        if self.scheduler.enable_prefix_caching:
            self.store.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        if seq.num_computed_tokens < seq.num_tokens:
            return []  # a chunk in the middle of its prompt: its logits predict a token the prompt has
        forks = self._fork(seq) if not seq.output_token_ids else []  # before seq's token: seq may finish with it
        outputs = []
        for s in [seq, *forks]:  # each sample with its own seeded sampler, as chapter 3 samples
            outputs += super()._after_forward(s, logits, now)
        return outputs

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Samples 1 .. n-1 of ``parent``'s request, each a new running sequence sharing ``parent``'s blocks."""
        children, params = [], parent.sampler.params
        for i in range(1, self._num_samples(parent.request_id)):
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
