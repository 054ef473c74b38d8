"""Serving: priority scheduling beside continuous batching (chapter 5's chunked scheduler, in another order).

A request may carry a ``priority``: an integer, **lower = more urgent** (as vLLM's server takes it); a request
without one has priority 0. Chapter 5's scheduler serves first come, first served. This one orders by urgency:

* **admission**: waiting sequences are offered a place by (effective priority, arrival time): the most urgent
  first, and among equals the earliest. As in chapter 5, the first one that does not fit stops the rest (no
  overtaking within the order), so a long urgent prompt is not starved by short ones behind it;
* **preemption**: when the store runs out of room, the victim is the running sequence that is least urgent and,
  among equals, arrived last (vLLM's priority policy). Running sequences are kept in that order, most urgent
  first, so the chunked scheduler's "the newest is preempted" rule (``running[-1]``) picks exactly that victim and
  the most urgent prompts get their chunks first.

**Aging** (so that no request starves): a sequence's *effective* priority is its priority minus one for every
``aging_s`` seconds since it arrived::

    effective_priority = priority - floor((now - arrival_time) / aging_s)

A request of priority ``p`` therefore competes, after waiting ``(p - q) * aging_s`` seconds, as an equal of a
request of priority ``q`` that has just arrived, and wins the tie by having arrived first: however many urgent
requests keep coming, it is admitted at most ``(p - q) * aging_s`` seconds (plus the time the requests ahead of it
take) after it would have been as an urgent one. Without priorities every request ages at the same rate, so the
order is arrival order: first come, first served, as chapter 5.

Priorities are bounded (``MAX_ABS_PRIORITY``) so that the wait aging guarantees is bounded too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..ch05_sharing.chunked_prefill import ChunkedPrefillScheduler, ChunkedSchedulerOutput
from ..errors import InvalidInputError, is_integer, is_real
from ..ch03_batching.sequence import Request, Sequence

MAX_ABS_PRIORITY = 1_000_000


@dataclass
class PriorityRequest(Request):
    """A ``Request`` with a priority: lower is more urgent, 0 by default (vLLM's convention)."""

    priority: int = 0


def priority_of(seq: Sequence) -> int:
    """``seq``'s priority: its request's ``priority`` (a plain ``Request`` has none: 0)."""
    p = getattr(seq.request, "priority", 0)
    if not is_integer(p, -MAX_ABS_PRIORITY, MAX_ABS_PRIORITY):
        raise InvalidInputError(f"priority must be an integer in [-{MAX_ABS_PRIORITY}, {MAX_ABS_PRIORITY}], got {p!r}")
    return int(p)


def effective_priority(priority: int, waited_s: float, aging_s: float) -> int:
    """The aging rule: one step more urgent for every ``aging_s`` seconds waited (``math.inf``: no aging)."""
    return priority - (math.floor(max(waited_s, 0.0) / aging_s) if math.isfinite(aging_s) else 0)


class PriorityScheduler(ChunkedPrefillScheduler):
    """Chapter 5's chunked-prefill scheduler, admitting and preempting by (effective priority, arrival time).

    ``clock`` must be the engine's (the sequences' arrival times are stamped with it); ``aging_s`` is the aging
    rule's period (``math.inf`` turns aging off, and then a stream of urgent requests can starve the rest)."""

    def __init__(self, store, max_num_seqs: int = 32, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, enable_chunked_prefill: bool = True,
                 enable_prefix_caching: bool = True, aging_s: float = 60.0,
                 clock: Callable[[], float] = time.perf_counter):
        super().__init__(store, max_num_seqs, max_num_batched_tokens, max_model_len, enable_chunked_prefill,
                         enable_prefix_caching)
        if not (is_real(aging_s) or aging_s == math.inf) or aging_s <= 0:
            raise InvalidInputError(f"aging_s must be a number of seconds > 0 (or math.inf), got {aging_s!r}")
        self.aging_s, self.clock = float(aging_s), clock

    def check_fits(self, seq: Sequence) -> str | None:
        try:
            priority_of(seq)
        except InvalidInputError as e:
            return str(e)
        return super().check_fits(seq)

    def urgency(self, seq: Sequence, now: float) -> tuple[int, float, int]:
        """The sort key: (effective priority, arrival time, sequence id); smaller is served first."""
        arrival = seq.metrics.arrival_time
        return effective_priority(priority_of(seq), now - arrival, self.aging_s), arrival, seq.seq_id

    def schedule(self) -> ChunkedSchedulerOutput:
        """Chapter 5's step, with the running sequences in urgency order: the most urgent get their chunks first
        and ``running[-1]``, the sequence chapter 5 preempts, is the least urgent, latest arrived."""
        now = self.clock()
        self.running.sort(key=lambda s: self.urgency(s, now))
        return super().schedule()

    def admission_order(self) -> list[Sequence]:
        """Waiting sequences, most urgent first (effective priority, then arrival)."""
        now = self.clock()
        return sorted(self.waiting, key=lambda s: self.urgency(s, now))
