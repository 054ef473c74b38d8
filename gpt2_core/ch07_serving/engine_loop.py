"""One thread owns the engine; HTTP handlers talk to it through a queue.

The engine (chapter 5's ``CachingLLMEngine`` with the ``PriorityScheduler``) is not thread-safe, and needs no
lock if one thread alone touches it. That thread loops: take new requests and aborts from ``inbox``, run one
``step()``, hand every request's new tokens (as text, cut at its stop strings) to the request's ``emit`` (which
puts them on the handler's asyncio queue), update the metrics. Handlers never touch the engine.

Faults stay small: a request the engine refuses finishes alone with an error; a step that raises fails the
requests that were in the engine, and the loop goes on; a handler whose client went away sends ``abort`` and the
request's blocks are freed before the next step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .priority_scheduler import PriorityRequest
from ..ch01_forward.sampling import SamplingParams
from ..ch03_batching.sequence import FinishReason
from .protocol import BadRequest, CompletionRequest, TextStream, token_logprobs

log = logging.getLogger("gpt2_core.ch07_serving")
MAX_STEP_STATS = 1000  # the engine's per-step records a long-running server keeps


@dataclass
class Job:
    """One HTTP request inside the engine thread: its checked fields and where its events go.

    Events passed to ``emit``: ``("token", i, text, token_id, logprobs)`` for each token of sample ``i`` (``text``
    may be "" while a possible stop string is held back; ``logprobs`` is None unless asked for) and
    ``("finish", i, reason, error, num_tokens)`` once per sample."""

    request_id: str
    request: CompletionRequest
    emit: Callable[[tuple], None]
    arrival_time: float = field(default_factory=time.perf_counter)
    texts: list = field(default_factory=list)  # a TextStream per sample
    sent: list = field(default_factory=list)  # tokens handed out per sample
    finished: list = field(default_factory=list)  # per sample
    rows: dict = field(default_factory=dict)  # token history -> log-probabilities of the next token (logprobs)
    error_status: int = 400  # HTTP status of an error before any token: the request's fault, unless a step failed


class EngineLoop:
    def __init__(self, engine, tokenizer, metrics, max_waiting: int = 64):
        self.engine, self.tokenizer, self.metrics = engine, tokenizer, metrics
        self.max_waiting = int(max_waiting)
        self.step_delay_s = 0.0  # sleep after each step, as a slower model would (tests, demos)
        self.inbox: queue.Queue = queue.Queue()
        self.active: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._queued = 0  # submitted, not yet taken from the inbox
        self._engine_waiting = 0  # the scheduler's waiting queue, as of the last step
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="gpt2-engine", daemon=True)

    # -- the handlers' side (the event loop's thread) -------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is still in the engine, end the thread."""
        self._stop.set()
        self.inbox.put(("wake",))
        self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self._stop.is_set()

    def num_waiting(self) -> int:
        return self._queued + self._engine_waiting

    def submit(self, *jobs: Job) -> None:
        """Queue ``jobs`` (the prompts of one HTTP request: all or none), or a 429 ``BadRequest`` at once if they
        would make more than ``max_waiting`` requests wait."""
        with self._lock:
            if self._stop.is_set():
                raise BadRequest("the server is shutting down", None, 503, "server_error")
            if self._queued + self._engine_waiting + len(jobs) > self.max_waiting:
                raise BadRequest(f"the server is at capacity: {self.max_waiting} requests are waiting already; "
                                 f"retry later", None, 429, "rate_limit_error")
            self._queued += len(jobs)
        for job in jobs:
            self.inbox.put(("add", job))

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    def abort_all(self) -> None:
        """Abort every request in the engine (the grace period of a shutdown is over): each ends with finish
        reason ``abort``, its stream closed properly, its blocks freed."""
        self.inbox.put(("abort_all",))

    # -- the engine's thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._take_inbox(block=not self.engine.has_unfinished())
            if self._stop.is_set():
                for request_id in list(self.active):
                    self._abort(request_id)
                self._deliver()
                return
            if self.engine.has_unfinished():
                try:
                    self.engine.step()
                except Exception as e:  # a bug or a fault in the step itself: its requests fail, the loop goes on
                    self._step_failed(e)
                if self.step_delay_s:
                    time.sleep(self.step_delay_s)
            self._deliver()
            with self._lock:
                self._engine_waiting = self.engine.kv_stats()["num_waiting"]
            self.metrics.update(self.engine, self.num_waiting())
            del self.engine.step_stats[:-MAX_STEP_STATS]

    def _take_inbox(self, block: bool) -> None:
        try:
            message = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            while True:
                if message[0] == "add":
                    with self._lock:
                        self._queued -= 1
                        self._engine_waiting += 1
                    self._add(message[1])
                elif message[0] == "abort":
                    self._abort(message[1])
                elif message[0] == "abort_all":
                    for request_id in list(self.active):
                        self._abort(request_id)
                message = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _add(self, job: Job) -> None:
        r = job.request
        job.texts = [TextStream(self.tokenizer, r.stop) for _ in range(r.n)]
        job.sent, job.finished = [0] * r.n, [False] * r.n
        self.active[job.request_id] = job
        self.metrics.prompt_tokens.inc(len(r.prompt_token_ids))
        try:  # anything refused here fails this request alone: the engine's thread goes on
            params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=max(r.top_k, 0) or None,
                                    seed=r.seed)
            request = PriorityRequest(job.request_id, r.prompt_token_ids, r.max_tokens, params, priority=r.priority,
                                      logits_processor=self._recorder(job) if r.logprobs is not None else None)
            self.engine.add_request(request, arrival_time=job.arrival_time, n=r.n)
        except Exception as e:  # refused whole (e.g. n above max_num_seqs): the request fails alone
            self._fail(job, f"{type(e).__name__}: {e}")

    @staticmethod
    def _recorder(job: Job):
        """A logits processor that records each step's log-probabilities under the token history, unchanged logits."""
        def record(token_ids, logits):
            z = logits.astype(np.float64)
            z = z - z.max()
            job.rows[tuple(token_ids)] = z - np.log(np.exp(z).sum())
            return logits
        return record

    def _abort(self, request_id: str) -> None:
        if request_id in self.active:
            try:
                self.engine.abort_request(request_id)
            except Exception:  # not in the engine (refused at add): nothing holds memory
                pass

    def _step_failed(self, error: Exception) -> None:
        log.error("engine step failed; failing the requests in the engine:\n%s", traceback.format_exc())
        self.metrics.step_errors.inc()
        for request_id in list(self.active):
            self._abort(request_id)
            self.active[request_id].error_status = 500
            for seq in self._samples(self.active[request_id]):
                if seq is not None and seq.finish_reason is FinishReason.ABORT:
                    seq.finish_reason, seq.error = FinishReason.ERROR, f"engine step failed: {error!r}"

    def _samples(self, job: Job) -> list:
        by = self.engine._by_request
        return [by.get(job.request_id), *(by.get((job.request_id, i)) for i in range(1, job.request.n))]

    def _deliver(self) -> None:
        """Every active request's new tokens and finishes to its handler; finished requests leave the engine."""
        for job in list(self.active.values()):
            samples = self._samples(job)
            parent = samples[0]
            for i, seq in enumerate(samples):
                if seq is None:  # not forked (yet): if the parent ended before forking, so does this sample
                    if parent is not None and parent.is_finished and not job.finished[i]:
                        self._emit(job, ("finish", i, parent.finish_reason.value, parent.error, 0))
                        job.finished[i] = True
                    continue
                self._deliver_sample(job, i, seq)
            job.rows.clear()
            if all(job.finished):
                self._done(job, [s for s in samples if s is not None])

    def _deliver_sample(self, job: Job, i: int, seq) -> None:
        text, k = job.texts[i], job.request.logprobs
        for j in range(job.sent[i], len(seq.output_token_ids)):
            if job.finished[i]:
                break
            token = seq.output_token_ids[j]
            piece = text.add(token)
            lp = None
            if k is not None:
                row = job.rows.get(tuple(seq.prompt_token_ids + seq.output_token_ids[:j]))
                lp = token_logprobs(self.tokenizer, token, row, k) if row is not None else None
            job.sent[i] = j + 1
            self.metrics.generation_tokens.inc()  # as they go out: a dashboard's tokens/s is smooth
            self._emit(job, ("token", i, piece, token, lp))
            if text.stopped:  # a stop string: this sample ends here, its blocks freed now
                self.engine.finish_request(seq.request_id, FinishReason.STOP)  # if not finished already
                seq.finish_reason = FinishReason.STOP
        if seq.is_finished and not job.finished[i]:
            rest = text.finish()
            if rest:
                self._emit(job, ("token", i, rest, None, None))
            self._emit(job, ("finish", i, seq.finish_reason.value, seq.error, job.sent[i]))
            job.finished[i] = True

    def _fail(self, job: Job, error: str) -> None:
        for i in range(job.request.n):
            self._emit(job, ("finish", i, FinishReason.ERROR.value, error, 0))
        job.finished = [True] * job.request.n
        self.active.pop(job.request_id, None)
        self.metrics.finish(FinishReason.ERROR.value)

    def _done(self, job: Job, samples: list) -> None:
        for seq in samples:
            self.metrics.observe(seq)
        r = job.request
        self.metrics.observe_request(len(r.prompt_token_ids), sum(job.sent), r.n, r.max_tokens)
        self.metrics.finish(samples[0].finish_reason.value if samples else FinishReason.ERROR.value)
        self.engine.release_request(job.request_id)
        del self.active[job.request_id]

    @staticmethod
    def _emit(job: Job, event: tuple) -> None:
        try:
            job.emit(event)
        except Exception:  # the handler's event loop is gone (shutting down): nobody is listening
            pass
