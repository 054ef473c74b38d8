"""Chapter 3: iteration-level scheduling. Before every model step, decide which sequences run and with which tokens.

Policy (vLLM's, without chunked prefill):

1. **Running sequences decode first**, oldest first, one token each. Each needs room for one more token in the KV
   store (``store.can_ensure``). If there is none, the scheduler **preempts by recompute**: it frees the KV of the
   most recently admitted running sequence and puts it back at the *front* of the waiting queue, keeping its
   output tokens; when it is readmitted its prompt + outputs so far are prefilled again. If the sequence that needs
   room is itself the newest, it is the one preempted. The oldest sequence therefore always makes progress, so
   there is no livelock.
2. **Waiting sequences are admitted first come, first served** while there is a free place
   (``max_num_seqs``), the step's token budget (``max_num_batched_tokens``) holds their whole prompt, and the store
   can allocate it. The queue's head blocks the rest (strict FCFS). Nothing is admitted in a step that preempted.
   The policy is one method, ``Scheduler.admit``: a subclass can admit in another order (vLLM's
   ``scheduler_cls``; ``LLMEngine(scheduler_cls=...)``).

A request that could never run, even alone — longer than the context, than one sequence's room in the store, or
than the token budget — is refused when it arrives (``check_fits``), instead of waiting forever.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from itertools import islice
from dataclasses import dataclass, field

from ..errors import InvalidInputError, is_integer
from ..ch01_forward.generation import positions_needed
from .kv_store import KVStore
from .sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """What one step runs: ``scheduled`` sequences (decodes first, then new prefills), the tokens each feeds, and
    what was preempted."""

    scheduled: list = field(default_factory=list)  # [Sequence]
    num_scheduled_tokens: dict = field(default_factory=dict)  # seq_id -> tokens it feeds (decode 1, prefill its prompt)
    num_batched_tokens: int = 0
    num_prefill_seqs: int = 0
    num_decode_seqs: int = 0
    preempted: list = field(default_factory=list)  # [Sequence] preempted while building this step

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_batched_tokens - self.num_decode_seqs


def num_to_admit(waiting_lens, num_running: int, max_num_seqs: int, num_batched_tokens: int,
                 max_num_batched_tokens: int) -> int:
    """First come, first served: how many sequences from the front of the queue can join this step?

    ``waiting_lens`` are the tokens each waiting sequence must prefill, in queue order. A sequence joins if a place
    is free (``num_running`` + joined < ``max_num_seqs``) and its tokens fit the step's budget; the first one that
    does not fit stops the rest — no overtaking, so a long prompt cannot be starved by short ones.
    """
    n = 0
    for length in waiting_lens:
        if num_running + n >= max_num_seqs or num_batched_tokens + length > max_num_batched_tokens:
            break
        num_batched_tokens += length
        n += 1
    return n


def check_limits(max_num_seqs, max_num_batched_tokens) -> None:
    """The scheduler's two limits, or an ``InvalidInputError`` naming the one that is wrong."""
    for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
        if not is_integer(value, 1):
            raise InvalidInputError(f"{name} must be a positive integer, got {value!r}")
    if max_num_batched_tokens < max_num_seqs:
        raise InvalidInputError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_num_seqs="
                                f"{max_num_seqs}: every running sequence needs one token per step")


class Scheduler:
    def __init__(self, store: KVStore, max_num_seqs: int = 32, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, clock: Callable[[], float] = time.perf_counter):
        check_limits(max_num_seqs, max_num_batched_tokens)
        self.store, self.clock = store, clock  # the engine's clock, for a policy that depends on time
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.max_model_len = store.config.n_positions if max_model_len is None else max_model_len
        self.waiting: deque[Sequence] = deque()  # FCFS; preempted sequences go back to the front
        self.running: list[Sequence] = []  # in admission order: running[-1] is the most recently admitted
        self.num_preemptions = 0

    # -- admission control ----------------------------------------------------------------------------------------
    def check_fits(self, seq: Sequence) -> str | None:
        """Why ``seq`` could never run even alone, or None. Refusing it now avoids a deadlock later."""
        total = positions_needed(seq.num_prompt_tokens, seq.max_new_tokens)  # the last token is never fed back
        what = (f"prompt of {seq.num_prompt_tokens} tokens + max_new_tokens={seq.max_new_tokens} needs {total} "
                f"positions")
        if total > self.max_model_len:
            return f"{what}, which exceeds the context n_ctx={self.max_model_len}"
        room = self.store.max_tokens_per_seq()
        if total > room:
            return f"{what}, which exceeds the KV store's room for one sequence ({room} tokens): it could never fit"
        if total > self.max_num_batched_tokens:
            return (f"{what}, which exceeds max_num_batched_tokens={self.max_num_batched_tokens}: its prefill (or its "
                    f"recompute after a preemption) could never be scheduled")
        return None

    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """This step's plan: every running sequence decodes one token (the newest are preempted if the store has
        no room), then the admission policy lets waiting sequences in with their whole prompt (prefill)."""
        out = SchedulerOutput()
        # 1. decodes: every running sequence feeds its last token, if the store can hold one more
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            assert seq.num_uncomputed_tokens == 1, seq  # running sequences are always one token behind
            if self._make_room(seq, seq.num_tokens, out):  # else seq itself was preempted: running[i] is the next
                self._add(out, seq, 1)
                i += 1
        # 2. prefills: the admission policy picks waiting sequences, the store must have room for each
        if not out.preempted:
            for seq in self.admit(out.num_batched_tokens):
                n = seq.num_uncomputed_tokens  # the prompt, plus the outputs so far after a preemption
                if not self.store.can_allocate(n):
                    break  # no KV room for it: it waits, and so does everyone the policy put after it
                self.store.allocate(seq.seq_id, n)
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                self._add(out, seq, n)
        assert len(self.running) <= self.max_num_seqs
        assert out.num_batched_tokens <= self.max_num_batched_tokens
        return out

    def admit(self, num_batched_tokens: int) -> list[Sequence]:
        """The admission policy: the waiting sequences that join this step, in the order they join, given that
        the step's decodes already use ``num_batched_tokens`` of the budget. First come, first served
        (``num_to_admit``); a subclass may choose others, within ``max_num_seqs`` and ``max_num_batched_tokens``."""
        lens = [s.num_uncomputed_tokens for s in islice(self.waiting, self.max_num_seqs - len(self.running))]
        n = num_to_admit(lens, len(self.running), self.max_num_seqs, num_batched_tokens, self.max_num_batched_tokens)
        return list(islice(self.waiting, n))

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Grow running ``seq``'s KV room to ``num_tokens``, preempting the most recently admitted sequences while
        the store has too little (``out.preempted`` lists them). False if ``seq`` itself had to go."""
        while not self.store.can_ensure(seq.seq_id, num_tokens):
            victim = self.running[-1]  # the most recently admitted (may be seq itself)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        self.store.ensure(seq.seq_id, num_tokens)
        return True

    @staticmethod
    def _add(out: SchedulerOutput, seq: Sequence, n: int) -> None:
        """``seq`` joins the step with ``n`` tokens: a decode (its one last token) or a prefill (prompt tokens)."""
        out.scheduled.append(seq)
        out.num_scheduled_tokens[seq.seq_id] = n
        out.num_batched_tokens += n
        if n == 1 and seq.output_token_ids and seq.num_uncomputed_tokens == 1:
            out.num_decode_seqs += 1
        else:
            out.num_prefill_seqs += 1

    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop the KV, keep the tokens, queue it first (``requeue``), and count it."""
        self.requeue(seq)
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1

    def requeue(self, seq: Sequence) -> None:
        """Put ``seq`` back at the front of the queue, its KV room freed and its tokens kept: a preemption, or the
        undoing of a model step that failed (which counts no preemption). Called for a step's sequences in reverse order, it
        leaves them at the front of the queue in their order."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.store.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take ``seq`` out of the queues for good and free its KV room."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.store.free(seq.seq_id)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
