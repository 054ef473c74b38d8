"""Chapter 5's scheduler: one token budget per step shared by decodes, prompts in chunks, and cached prefixes.

Chapter 3's scheduler admits a prompt only when the whole of it fits the step's budget. One long prompt then makes
one long step, and every running sequence waits that long for its next token (the *prefill stall*). Here, as in
vLLM V1 and Sarathi-Serve, each sequence's ``num_computed_tokens`` catches up with its tokens within one budget of
``max_num_batched_tokens`` per step:

1. **Running sequences, oldest first.** A decoding sequence takes 1 token. One still in its prompt takes the next
   *chunk* of it: as many tokens as the budget holds after one for each decode behind it, so decodes are never
   stalled. No room in the store for them: preempt the newest, as chapter 3 does.
2. **Waiting sequences, first come first served** (``admission_order``), unless this step preempted. With prefix
   caching the store first says how many of the prompt's tokens are cached; those start computed. With chunked
   prefill the last one admitted may get only the first chunk of the rest; without, the whole rest must fit.

A sequence that will fork into ``n`` samples (parallel sampling: ``num_samples[request_id] = n``) holds that many
of the ``max_num_seqs`` places from its admission on (``num_places``). The engine samples only for sequences whose
chunk reached the end of their tokens; a chunk in the middle of a prompt produces no token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..ch01_forward.generation import positions_needed
from ..ch03_batching.scheduler import Scheduler, SchedulerOutput
from ..ch03_batching.sequence import Sequence, SequenceStatus


@dataclass
class ChunkedSchedulerOutput(SchedulerOutput):
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache by this step's admissions


class ChunkedPrefillScheduler(Scheduler):
    def __init__(self, store, max_num_seqs: int = 32, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, enable_chunked_prefill: bool = True,
                 enable_prefix_caching: bool = True, clock: Callable[[], float] = time.perf_counter):
        super().__init__(store, max_num_seqs, max_num_batched_tokens, max_model_len, clock)
        self.enable_chunked_prefill = bool(enable_chunked_prefill)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.num_samples: dict = {}  # request_id -> n, for a request whose sequence will fork into n > 1 samples

    def num_places(self, seq: Sequence) -> int:
        """Places among ``max_num_seqs`` that ``seq`` holds: its samples-to-be until it forks them, then 1."""
        return 1 if seq.output_token_ids else self.num_samples.get(seq.request_id, 1)

    def check_fits(self, seq: Sequence) -> str | None:
        """Chapter 3's checks; with chunked prefill a prompt longer than the budget is fine (it comes in chunks)."""
        why = super().check_fits(seq)
        total = positions_needed(seq.num_prompt_tokens, seq.max_new_tokens)
        if why is not None and self.enable_chunked_prefill and total <= min(self.max_model_len,
                                                                            self.store.max_tokens_per_seq()):
            return None  # only the token budget was too small for the whole prompt at once
        return why

    def schedule(self) -> ChunkedSchedulerOutput:
        out = ChunkedSchedulerOutput()
        budget = self.max_num_batched_tokens
        # 1. running sequences, oldest first: a decode takes 1 token, a prompt in progress its next chunk
        decodes_behind = sum(s.num_uncomputed_tokens == 1 for s in self.running)
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            decodes_behind -= seq.num_uncomputed_tokens == 1
            n = min(seq.num_uncomputed_tokens, budget - out.num_batched_tokens - decodes_behind)
            if n < 1:  # the rest of its prompt waits for the next step; the decodes behind it run
                i += 1
                continue
            num_preempted = len(out.preempted)
            if self._make_room(seq, seq.num_computed_tokens + n, out):  # chapter 3's preemption loop
                self._add(out, seq, n)
                i += 1
            if len(out.preempted) > num_preempted:  # the newest left the running list: recount the decodes behind
                decodes_behind = sum(s.num_uncomputed_tokens == 1 for s in self.running[i:])
        # 2. waiting sequences, in admission order, while places, budget and KV room last
        if not out.preempted:
            places = self.max_num_seqs - sum(self.num_places(s) for s in self.running)
            for seq in self.admission_order():
                left = budget - out.num_batched_tokens
                if left < 1 or self.num_places(seq) > places:
                    break
                num_cached = self.store.num_cached_tokens(seq.token_ids) if self.enable_prefix_caching else 0
                rest = seq.num_tokens - num_cached  # the prompt (+ outputs, after a preemption) not yet cached
                if rest > left and not self.enable_chunked_prefill:
                    break
                n = min(rest, left)
                if not self._allocate(seq, num_cached, n):
                    break  # no KV room for it: it waits, and so does everyone after it
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                places -= self.num_places(seq)
                out.num_cached_tokens += num_cached
                self._add(out, seq, n)
        assert sum(self.num_places(s) for s in self.running) <= self.max_num_seqs
        assert out.num_batched_tokens <= self.max_num_batched_tokens
        return out

    def admission_order(self) -> list[Sequence]:
        """The order in which waiting sequences are offered a place: first come, first served."""
        return list(self.waiting)

    def _allocate(self, seq: Sequence, num_cached: int, n: int) -> bool:
        """Room for ``seq``'s first ``num_cached + n`` tokens, its cached blocks shared; False if there is none."""
        if self.enable_prefix_caching:
            if not self.store.can_allocate_prefix(seq.token_ids, num_cached + n):
                return False
            seq.num_computed_tokens = self.store.allocate_prefix(seq.seq_id, seq.token_ids, num_cached + n)
            assert seq.num_computed_tokens == num_cached
        else:
            if not self.store.can_allocate(n):
                return False
            self.store.allocate(seq.seq_id, n)
        return True
