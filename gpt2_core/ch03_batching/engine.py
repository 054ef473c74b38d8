"""Chapter 3: the engine. Requests in, a stream of tokens per request out, one ragged model step at a time.

``LLMEngine.step()`` is the whole idea of continuous batching (iteration-level scheduling):

1. the ``Scheduler`` picks this step's sequences: every running one decodes one token, and newly admitted ones
   bring their whole prompt (prefill);
2. ``ragged_forward`` runs all those chunks as **one** ``[total_tokens, n_embd]`` matrix through every weight
   matmul — prefill and decode share the step, so each weight is read once for both — while each sequence
   attends to its own K/V in the ``KVStore``;
3. each sequence samples its next token with its own seeded ``Sampler``; finished sequences leave at once and
   free their KV room, so a waiting request can take their place in the very next step.

A later chapter changes one part and keeps the step: it passes a part in (``scheduler_cls``, a ``store`` or
``make_kv_store``, the ``forward`` that runs the model) or overrides a hook (``_after_forward``: what a sequence
does with its logits; ``_samples_of``: the sequences of one request).

A request that is invalid, or whose own sampling or ``on_token`` callback raises, fails alone (``FinishReason.ERROR`` with a message);
the others are not disturbed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ..errors import CacheCapacityError, InvalidInputError, is_integer, is_real
from .kv_store import ContiguousKVStore, KVStore
from .model_runner import Chunk, model_step
from ..ch01_forward.sampling import Sampler
from .scheduler import Scheduler, check_limits
from .sequence import FinishReason, Request, Sequence, SequenceMetrics, SequenceStatus, check_request
from ..loading.weights import GPT2Model


@dataclass
class StepStats:
    """What one engine step did (for the per-step metrics and the plots)."""

    step: int
    start_time: float
    end_time: float
    num_seqs: int  # sequences in the step's batch
    num_prefill_seqs: int
    num_decode_seqs: int
    num_batched_tokens: int  # rows of the [N, E] matrix
    num_running: int  # sequences holding KV room after the step
    num_waiting: int
    kv_slots_in_use: int  # sequences holding KV room during the step
    kv_reserved_tokens: int  # token positions the store has set aside for them
    kv_used_tokens: int  # token positions actually filled
    num_preempted: int


@dataclass
class RequestOutput:
    """The result of one request: its tokens, why it stopped, and its metrics."""

    request_id: object
    prompt_token_ids: list
    output_token_ids: list
    finish_reason: FinishReason | None
    error: str | None
    metrics: SequenceMetrics

    @classmethod
    def from_sequence(cls, seq: Sequence) -> "RequestOutput":
        return cls(seq.request_id, list(seq.prompt_token_ids), list(seq.output_token_ids), seq.finish_reason,
                   seq.error, seq.metrics)


def check_store_fits(store: KVStore, model: GPT2Model) -> None:
    """A store holds K/V of one shape: the model's layers x heads x head_dim, or the step would fail inside."""
    have, want = store.config, model.config
    if (have.n_layer, have.n_kv_head, have.head_dim) != (want.n_layer, want.n_kv_head, want.head_dim):
        raise InvalidInputError(f"the KV store holds {have.n_layer} layers x {have.n_kv_head} heads x head_dim "
                                f"{have.head_dim}; the model needs {want.n_layer} x {want.n_kv_head} x {want.head_dim}")


def check_own_store(store: KVStore, model: GPT2Model) -> KVStore:
    """``store``, if it fits the model and holds no one else's sequences (their ids would collide with ours)."""
    check_store_fits(store, model)
    if store.reserved_tokens():
        raise InvalidInputError(f"the KV store already holds room for {store.reserved_tokens()} tokens of "
                                f"other sequences; an engine needs a store of its own")
    return store


ModelForward = Callable[[GPT2Model, KVStore, list], np.ndarray]  # (model, store, chunks) -> logits [B, V]


class LLMEngine:
    """Continuous batching over a ``KVStore`` (default: ``make_kv_store``, one contiguous slot of ``max_len`` per
    sequence). ``scheduler_cls`` is called with the store, the two limits, the context and ``clock=``;
    ``forward(model, store, chunks)`` runs the model step (chapter 8 passes one that runs on worker processes)."""

    def __init__(self, model: GPT2Model, store: KVStore | None = None, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 2048, max_len: int | None = None,
                 clock: Callable[[], float] = time.perf_counter, scheduler_cls: type[Scheduler] = Scheduler,
                 forward: ModelForward = model_step):
        check_limits(max_num_seqs, max_num_batched_tokens)  # before a default store takes its memory
        if max_len is not None and not is_integer(max_len, 1):
            raise InvalidInputError(f"max_len must be a positive integer, got {max_len!r}")
        if max_len is not None and store is not None:
            raise InvalidInputError("max_len sizes the default store; a store passed in has its own size")
        if not callable(forward):
            raise InvalidInputError(f"forward must be a function (model, store, chunks) -> logits, got {forward!r}")
        self.model, self.clock, self.forward = model, clock, forward
        if store is None:
            store = self.make_kv_store(int(max_num_seqs), max_len)
        self.store = check_own_store(store, model)
        self.scheduler = scheduler_cls(self.store, int(max_num_seqs), int(max_num_batched_tokens),
                                       model.config.n_positions, clock=clock)
        self.sequences: dict[int, Sequence] = {}  # seq_id -> Sequence, all ever added
        self.step_stats: list[StepStats] = []  # one record per step, for the metrics and the plots
        self.num_steps = 0
        self._next_id = 0
        self._by_request: dict[object, Sequence] = {}
        self._callbacks: dict[int, Callable] = {}  # seq_id -> on_token
        self._pending: dict[int, list[int]] = {}  # tokens produced but not yet taken by stream()
        self._in_step = False  # see step(): a step must not start inside another

    def add_request(self, request: Request, arrival_time: float | None = None,
                    on_token: Callable[[Sequence, int], None] | None = None) -> int:
        """Queue a request; return its sequence id. An invalid request is finished at once with an error.

        ``on_token(seq, token)`` is called for each new token; after the last one ``seq.is_finished`` is True.
        """
        seq = self._new_sequence(request, arrival_time, on_token)  # checked; finished at once if it cannot run
        if not seq.is_finished:
            self.scheduler.add(seq)  # WAITING, until the scheduler admits it
        return seq.seq_id

    def step(self) -> list[tuple[object, int]]:
        """One iteration: schedule, run one ragged model step, sample. Returns the ``(request_id, new_token)``
        pairs produced."""
        with self._one_step_at_a_time():
            start = self.clock()
            plan = self.scheduler.schedule()  # 1. who runs: every running sequence decodes, new ones prefill
            if not plan.scheduled:
                self._check_progress(plan)
                return []
            chunks = []
            for seq in plan.scheduled:  # the tokens each feeds: a whole prompt, or one token
                a, b = seq.num_computed_tokens, seq.num_computed_tokens + plan.num_scheduled_tokens[seq.seq_id]
                chunks.append(Chunk(seq.seq_id, np.asarray(seq.token_ids[a:b], dtype=np.int64), a))
            stats = self._begin_stats(plan, start)
            logits = self._run_model(plan, chunks)  # 2. ragged_forward: all chunks in one pass -> [B, V]
            now = self.clock()
            outputs = []
            for seq, chunk, row in zip(plan.scheduled, chunks, logits):  # 3. each sequence samples its next token
                seq.num_computed_tokens += len(chunk.token_ids)  # their K/V are in the store now
                outputs += self._after_forward(seq, row, now)
            self._end_stats(stats, now)
            self._call_back(outputs, now)  # only once every sequence's state is up to date
            return outputs

    def _after_forward(self, seq: Sequence, logits: np.ndarray, now: float) -> list[tuple[object, int]]:
        """The hook after the model step, for each scheduled sequence (its chunk's K/V now in the store): sample its
        next token from ``logits`` [V] with its own seeded sampler and append it. Returns the ``(request_id,
        token)`` pairs produced: none if the request's own code raised (``_sample``)."""
        token = self._sample(seq, logits, now)
        if token is None:
            return []
        self._append_token(seq, token, now)
        return [(seq.request_id, token)]

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        """``token`` joins ``seq``'s output; a stop token or a spent budget finishes ``seq`` and frees its KV."""
        seq.output_token_ids.append(token)
        seq.metrics.token_times.append(now)
        self._pending[seq.seq_id].append(token)
        r = seq.request
        if (r.stop_at_eos and token == self.model.config.eos_token_id) or token == r.stop_token_id:
            self._finish(seq, FinishReason.STOP, now)
        elif len(seq.output_token_ids) >= seq.max_new_tokens:
            self._finish(seq, FinishReason.LENGTH, now)

    def _finish(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        self.scheduler.finish(seq, reason)  # out of the queues, its KV room freed for the next step
        seq.metrics.finished_time = now

    def _samples_of(self, request_id) -> list[Sequence]:
        """The hook naming the sequences of one request: here the request's own sequence (a later chapter adds the
        samples it forks)."""
        return [self.get_sequence(request_id)]

    def finish_request(self, request_id, reason: FinishReason = FinishReason.ABORT) -> None:
        """Finish the sequence ``request_id`` names now with ``reason``, freeing its KV room; one already finished is
        left as it is. Call it between steps (a server does, when a stop string ends a sample)."""
        seq = self.get_sequence(request_id)
        if not seq.is_finished:
            self._finish(seq, reason, self.clock())

    def abort_request(self, request_id) -> None:
        """Finish ``request_id`` and every sample of it now with ``FinishReason.ABORT`` (``finish_request``). Call it
        between steps (a server does, when its client goes away)."""
        for seq in self._samples_of(request_id):
            self.finish_request(seq.request_id, FinishReason.ABORT)

    def release_request(self, request_id) -> None:
        """Forget a finished request (and its samples): a long-running server calls this once it has handed the
        output over, so that the engine does not keep every request it ever served."""
        samples = self._samples_of(request_id)
        if not all(s.is_finished for s in samples):
            raise InvalidInputError(f"request {request_id!r} is not finished: abort it first")
        for s in samples:
            for table in (self.sequences, self._pending, self._callbacks):
                table.pop(s.seq_id, None)
            self._by_request.pop(s.request_id, None)

    def kv_stats(self) -> dict:
        """The numbers a server's metrics read between steps: sequences running and waiting, preemptions so far,
        and the KV store's room (token positions reserved, capacity, usage)."""
        s, store = self.scheduler, self.store
        return {"num_running": len(s.running), "num_waiting": len(s.waiting), "num_preemptions": s.num_preemptions,
                "reserved_tokens": store.reserved_tokens(), "capacity_tokens": store.capacity_tokens(),
                "usage": store.usage()}

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def run_until_done(self) -> None:
        while self.has_unfinished():
            self.step()

    # -- the rest: the default store, checking requests, failing them alone, the step's record, callbacks, streams
    def make_kv_store(self, max_num_seqs: int, max_len: int | None) -> KVStore:
        """The store an engine makes when none is passed in: ``max_num_seqs`` contiguous slots of ``max_len`` tokens
        (default: the context). Chapter 5's engine makes a paged store with prefix caching."""
        return ContiguousKVStore(self.model.config, num_slots=max_num_seqs, max_len=max_len)

    def _new_sequence(self, request: Request, arrival_time: float | None, on_token) -> Sequence:
        """``request`` as a new ``Sequence`` of this engine, checked. One that cannot run (invalid, or too big for
        the context, the store or the token budget) is finished at once with ``FinishReason.ERROR`` and a message;
        one with ``max_new_tokens=0`` with ``FinishReason.LENGTH``."""
        self._check_new([request])
        if arrival_time is not None and not is_real(arrival_time):
            raise InvalidInputError(f"arrival_time must be a finite number (clock seconds), got {arrival_time!r}")
        if on_token is not None and not callable(on_token):
            raise InvalidInputError(f"on_token must be a function (seq, token) or None, got {on_token!r}")
        seq_id, self._next_id = self._next_id, self._next_id + 1
        now = self.clock() if arrival_time is None else arrival_time
        seq = Sequence(seq_id, request, arrival_time=now)
        self.sequences[seq_id] = seq
        self._by_request[request.request_id] = seq
        self._pending[seq_id] = []
        if on_token is not None:
            self._callbacks[seq_id] = on_token
        try:
            error = self._validate(seq)
        except Exception as e:  # whatever is wrong with it, the request fails alone and the engine stays sound
            error = f"invalid request ({type(e).__name__}: {e})"
        if error is not None:
            seq.error = f"request {request.request_id!r}: {error}"
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason.ERROR
            seq.metrics.finished_time = now
        elif seq.max_new_tokens == 0:
            self._finish(seq, FinishReason.LENGTH, now)
        return seq

    def _check_new(self, requests: list) -> None:
        """Refuse, before anything is queued, what is not a ``Request`` or reuses a ``request_id``."""
        ids = set()
        for r in requests:
            if not all(hasattr(r, a) for a in ("request_id", "prompt_token_ids", "max_new_tokens")):  # duck-typed:
                raise InvalidInputError(f"expected a Request, got {type(r).__name__}")  # a notebook's own class too
            try:
                hash(r.request_id)
            except TypeError:
                raise InvalidInputError(f"request_id must be hashable (a str or an int), got {r.request_id!r}") from None
            if r.request_id in self._by_request or r.request_id in ids:
                raise InvalidInputError(f"request_id {r.request_id!r} is already in this engine")
            ids.add(r.request_id)

    def _validate(self, seq: Sequence) -> str | None:
        """Why ``seq`` cannot be served (``check_request``, then ``Scheduler.check_fits``), or None; a valid
        sequence gets its checked prompt, budget and sampler."""
        try:
            checked = check_request(seq.request, self.model)
        except InvalidInputError as e:
            return str(e)
        seq.prompt_token_ids, seq.max_new_tokens = checked.prompt_token_ids, checked.max_new_tokens
        seq.sampler = Sampler(checked.sampling_params)
        return self.scheduler.check_fits(seq)

    def get_sequence(self, request_id) -> Sequence:
        try:
            return self._by_request[request_id]
        except (KeyError, TypeError):
            raise InvalidInputError(f"no request {request_id!r} in this engine") from None

    @contextmanager
    def _one_step_at_a_time(self):
        """A step cannot start inside another: an ``on_token`` callback or a ``logits_processor`` that calls
        ``step`` (or ``stream``, ``run_until_done``, ``generate_many``) gets an ``InvalidInputError``, so its own
        request fails and the step in progress finishes as if it had not been called."""
        if self._in_step:
            raise InvalidInputError("step() was called from inside a step (from an on_token callback or a "
                                    "logits_processor); return instead, the caller steps again")
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False

    def _check_progress(self, plan) -> None:
        """A step that schedules no one while requests wait and none runs or was preempted will never schedule
        anyone: something outside the engine holds the store's memory."""
        if self.scheduler.waiting and not (self.scheduler.running or plan.preempted):
            raise CacheCapacityError(f"{len(self.scheduler.waiting)} request(s) wait, none is running, and the "
                                     f"KV store has no room for the first: something else holds its memory")

    def _run_model(self, plan, chunks: list[Chunk]) -> np.ndarray:
        """``forward`` (default ``model_step``: the ``ragged_forward`` of the model's architecture) over the step's
        chunks -> [B, V]. If it raises (Ctrl-C included), nothing was sampled: every sequence of the step goes back
        to the front of the queue, to be computed again."""
        try:
            return self.forward(self.model, self.store, chunks)
        except BaseException:
            for seq in reversed(plan.scheduled):
                self.scheduler.requeue(seq)
            raise

    def _sample(self, seq: Sequence, logits: np.ndarray, now: float) -> int | None:
        """``seq``'s next token from its own sampler (after its ``logits_processor``), or None if that raised: the
        request's own code failed, so it alone ends with ``FinishReason.ERROR``."""
        try:
            if seq.request.logits_processor is not None:
                logits = np.asarray(seq.request.logits_processor(seq.token_ids, logits))
                V = self.model.config.vocab_size
                if logits.shape != (V,) or not np.issubdtype(logits.dtype, np.floating):
                    raise InvalidInputError(f"logits_processor must return float logits of shape ({V},), got "
                                            f"{logits.dtype} {logits.shape}")
            token = seq.sampler(logits)
            if not 0 <= token < self.model.config.vocab_size:
                raise InvalidInputError(f"sampled token {token} is outside the vocabulary")
            return token
        except Exception as e:
            seq.error = f"request {seq.request_id!r}: sampling raised {type(e).__name__}: {e}"
            self._finish(seq, FinishReason.ERROR, now)
            return None

    def _begin_stats(self, plan, start: float) -> StepStats:
        """The step's record as the model starts (``_end_stats`` completes it); first-scheduled times stamped."""
        for seq in plan.scheduled:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = start
        return StepStats(
            step=self.num_steps, start_time=start, end_time=start, num_seqs=len(plan.scheduled),
            num_prefill_seqs=plan.num_prefill_seqs, num_decode_seqs=plan.num_decode_seqs,
            num_batched_tokens=plan.num_batched_tokens, num_running=0, num_waiting=0,
            kv_slots_in_use=len(self.scheduler.running), kv_reserved_tokens=self.store.reserved_tokens(),
            kv_used_tokens=sum(seq.num_tokens for seq in self.scheduler.running), num_preempted=len(plan.preempted))

    def _end_stats(self, stats: StepStats, now: float) -> None:
        stats.end_time, stats.num_running = now, len(self.scheduler.running)
        stats.num_waiting = len(self.scheduler.waiting)
        self.step_stats.append(stats)
        self.num_steps += 1

    def _call_back(self, outputs, now: float) -> None:
        """Hand each new token to its request's ``on_token``. A callback is the caller's code: if it raises, its
        request ends with ``FinishReason.ERROR`` (its KV room freed) and the other requests go on. A Ctrl-C in one
        callback still lets the others have this step's token (each callback sees every token, in order), then
        stops the caller."""
        for i, (request_id, token) in enumerate(outputs):
            seq = self._by_request[request_id]
            callback = self._callbacks.get(seq.seq_id)
            if callback is None:
                continue
            try:
                callback(seq, token)
            except Exception as e:
                seq.error = f"request {request_id!r}: on_token raised {type(e).__name__}: {e}"
                self._finish(seq, FinishReason.ERROR, now)
                self._callbacks.pop(seq.seq_id, None)  # no more tokens for a callback that failed
            except BaseException:  # KeyboardInterrupt, SystemExit: the rest first, then the interrupt goes on
                self._call_back(outputs[i + 1:], now)
                raise

    # -- outputs --------------------------------------------------------------------------------------------------
    def stream(self, request_id) -> Iterator[int]:
        """Yield ``request_id``'s tokens as they are produced, stepping the engine (and so every request) as needed."""
        seq = self.get_sequence(request_id)
        pending = self._pending[seq.seq_id]
        while True:
            while pending:
                yield pending.pop(0)
            if seq.is_finished:
                return
            self.step()

    def generate_many(self, requests: Iterable[Request]) -> list[RequestOutput]:
        """Add all ``requests`` now (arrival times ignored) and step until every one has finished; in input order.
        A list with a repeated or taken ``request_id`` is refused whole, before any request is queued."""
        requests = list(requests)
        self._check_new(requests)
        ids = [self.add_request(r) for r in requests]
        self.run_until_done()
        return [RequestOutput.from_sequence(self.sequences[i]) for i in ids]

    def outputs(self) -> list[RequestOutput]:
        return [RequestOutput.from_sequence(s) for s in self.sequences.values()]
