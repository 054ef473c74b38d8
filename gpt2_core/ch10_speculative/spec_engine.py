"""Chapter 10 inside chapter 5's engine: every running sequence drafts, and verifies in the one ragged step.

A step of ``SpeculativeEngine``:

1. **propose**: the drafter guesses up to k tokens for every running sequence that decodes (one call for all of
   them: a draft model batches them);
2. **schedule**: while the scheduler plans, each sequence's drafts sit after its last token (vLLM's
   ``num_tokens_with_spec``): it feeds 1 + k tokens, they count against the step's token budget and get KV room
   like any other (or preempt, as chapter 5 does when room runs out). The scheduler is chapter 5's, unchanged;
3. **verify**: one ragged pass runs the prompt chunks, the plain decodes and the verify rows together; the LM head
   runs on every verify row (``ragged_forward``'s ``logits_indices``), on the last row of the other chunks;
4. **accept and roll back**: each sequence keeps its accepted drafts and one token of the target
   (``acceptance.accept``), then ``truncate`` frees the KV room of the rest (``rollback``).

A request with a ``logits_processor`` (the server's logprobs) and a prompt still in chunks are not drafted for: they
step as in chapter 5. Greedy tokens are the plain engine's; sampled ones follow the same distribution.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import numpy as np

from ..ch03_batching.model_runner import Chunk, model_step
from ..ch03_batching.scheduler import check_limits
from ..ch03_batching.sequence import FinishReason, Sequence
from ..ch04_paged.block_manager import blocks_needed
from ..ch05_sharing.caching_engine import CachingLLMEngine
from ..ch07_serving.priority_scheduler import PriorityScheduler
from ..errors import InvalidInputError
from ..loading.weights import GPT2Model
from .acceptance import SpecStats, accept
from .drafters import DraftRequest, check_k, make_drafter
from .rollback import SpeculativeKVStore


@contextmanager
def drafts_attached(running: list[Sequence], drafts: dict):
    """Each running sequence's draft tokens appended to its output while the block runs (the scheduler plans), and
    taken off again, whatever happens: a preempted sequence keeps only its real tokens."""
    seqs = [s for s in running if s.seq_id in drafts]
    for s in seqs:
        s.output_token_ids.extend(drafts[s.seq_id].tokens)
    try:
        yield
    finally:
        for s in seqs:
            del s.output_token_ids[len(s.output_token_ids) - len(drafts[s.seq_id].tokens):]


class SpeculativeEngine(CachingLLMEngine):
    """Chapter 5's engine with a ``drafter`` proposing up to ``num_speculative_tokens`` tokens per sequence and step.

    ``store``: a ``SpeculativeKVStore`` (default: room for ``max_num_seqs`` full contexts in blocks of 16).
    ``forward(model, store, chunks, logits_indices) -> [R, V]``: chapter 3's ``model_step`` by default (the
    ``ragged_forward`` of the model's architecture: chapter 9's Llama runs too).
    ``spec_stats`` counts drafts and acceptances (vLLM's ``spec_decode`` counters).
    """

    def __init__(self, model: GPT2Model, drafter, num_speculative_tokens: int = 4,
                 store: SpeculativeKVStore | None = None, max_num_seqs: int = 32, forward=model_step,
                 **kwargs):
        self.k = check_k(num_speculative_tokens)
        if not all(callable(getattr(drafter, m, None)) for m in ("propose", "retain")):
            raise InvalidInputError(f"a drafter needs propose(requests) and retain(keys) methods, got {drafter!r}")
        if store is None:
            check_limits(max_num_seqs, kwargs.get("max_num_batched_tokens", 2048))  # before the store takes memory
            blocks = int(max_num_seqs) * blocks_needed(model.config.n_positions, 16)
            store = SpeculativeKVStore(model.config, num_blocks=blocks, block_size=16)
        elif not isinstance(store, SpeculativeKVStore):
            raise InvalidInputError(f"the speculative engine needs a SpeculativeKVStore (it rolls back), got "
                                    f"{type(store).__name__}")
        super().__init__(model, store, max_num_seqs=max_num_seqs, **kwargs)
        self.drafter, self.forward = drafter, forward
        self.spec_stats = SpecStats()

    def step(self) -> list[tuple[object, int]]:
        """Propose, schedule, run one ragged pass, accept and roll back, sample the rest. Returns the
        ``(request_id, token)`` pairs produced (a sequence may produce several)."""
        with self._one_step_at_a_time():
            return self._speculative_step()

    def _speculative_step(self) -> list[tuple[object, int]]:
        start = self.clock()
        drafts = self.propose()  # 1. guesses: seq_id -> Proposal
        with drafts_attached(self.scheduler.running, drafts):
            plan = self.scheduler.schedule()  # 2. chapter 5's scheduler, the drafts counted as tokens to compute
        if not plan.scheduled:
            self._check_progress(plan)
            return []
        stats = self._begin_stats(plan, start)
        chunks = [self.chunk_of(seq, plan.num_scheduled_tokens[seq.seq_id], drafts) for seq in plan.scheduled]
        verify = [seq.seq_id in drafts for seq in plan.scheduled]
        rows = self._run_verify(plan, chunks, verify)  # 3. one pass: a list of [rows, V] per sequence
        now = self.clock()
        self.num_cached_tokens += plan.num_cached_tokens
        outputs = []
        for seq, chunk, logits, verifying in zip(plan.scheduled, chunks, rows, verify):
            if verifying:  # 4. accept and roll back
                outputs += self.accept_drafts(seq, drafts[seq.seq_id], logits, now)
            else:
                outputs += self._advance(seq, len(chunk.token_ids), logits[-1], now)
        self._end_stats(stats, now)
        self._call_back(outputs, now)
        self.drafter.retain([s.seq_id for s in self.scheduler.running])  # a finished sequence's drafter state goes
        return outputs

    def num_drafts(self, seq: Sequence) -> int:
        """How many tokens to draft for ``seq``: k, if it decodes (its one last token to compute), has no logits
        processor, and its context, its budget and the store's room for one sequence leave space for them."""
        if seq.num_uncomputed_tokens != 1 or not seq.output_token_ids or seq.request.logits_processor is not None:
            return 0
        limit = min(seq.max_num_tokens - 1, self.scheduler.max_model_len, self.store.max_tokens_per_seq())
        return max(0, min(self.k, limit - seq.num_tokens))  # positions 0 .. num_tokens - 1 + k

    def propose(self) -> dict:
        """The drafter's proposals for the running sequences, by seq_id (sequences it proposed nothing for left out)."""
        requests = [DraftRequest(s.seq_id, s.token_ids, n, s.sampler.params, s.sampler.rng)
                    for s in self.scheduler.running if (n := self.num_drafts(s)) > 0]
        proposals = self.drafter.propose(requests) if requests else []
        return {r.key: p for r, p in zip(requests, proposals) if p.tokens}

    @staticmethod
    def chunk_of(seq: Sequence, n: int, drafts: dict) -> Chunk:
        """``seq``'s ``n`` tokens of this step: its next prompt chunk, its last token, or its last token and drafts."""
        a = seq.num_computed_tokens
        tokens = seq.token_ids + (drafts[seq.seq_id].tokens if seq.seq_id in drafts else [])
        return Chunk(seq.seq_id, np.asarray(tokens[a:a + n], dtype=np.int64), a)

    def _run_verify(self, plan, chunks: list[Chunk], verify: list[bool]) -> list[np.ndarray]:
        """The step's one pass: logits of every row of a verify chunk, of the last row of the others. If it raises
        (Ctrl-C included), every sequence of the step goes back to the queue, as in chapters 3 and 5."""
        ends = np.cumsum([len(c.token_ids) for c in chunks])
        spans = [np.arange(e - len(c.token_ids) if v else e - 1, e) for c, e, v in zip(chunks, ends, verify)]
        try:
            logits = self.forward(self.model, self.store, chunks, np.concatenate(spans))  # [R, V]
        except BaseException:
            for seq in reversed(plan.scheduled):
                self.scheduler.requeue(seq)
            raise
        return np.split(logits, np.cumsum([len(s) for s in spans])[:-1])

    def accept_drafts(self, seq: Sequence, proposal, logits: np.ndarray, now: float) -> list[tuple[object, int]]:
        """Keep the drafts the target agrees with and one token of its own, roll the rest of the KV back, emit."""
        drafts = proposal.tokens[:len(logits) - 1]  # the budget may have cut the verify chunk short
        probs = None if proposal.probs is None else proposal.probs[:len(drafts)]
        try:
            tokens = accept(drafts, probs, logits, seq.sampler)
        except Exception as e:  # the request's own numbers failed (NaN logits): it fails alone
            seq.error = f"request {seq.request_id!r}: sampling raised {type(e).__name__}: {e}"
            self._finish(seq, FinishReason.ERROR, now)
            return []
        if drafts:
            self.spec_stats.record(len(drafts), len(tokens) - 1, len(tokens))
        seq.num_computed_tokens += len(tokens)  # the last token and the accepted drafts: their K/V are right
        self.store.truncate(seq.seq_id, seq.num_computed_tokens)  # the rejected drafts' room goes back
        if self.scheduler.enable_prefix_caching:
            self.store.cache_blocks(seq.seq_id, seq.token_ids + tokens[:-1], seq.num_computed_tokens)
        out = []
        for token in tokens:
            self._append_token(seq, token, now)  # a stop token or the budget ends it here
            out.append((seq.request_id, token))
            if seq.is_finished:
                break
        return out

    def _advance(self, seq: Sequence, n: int, row: np.ndarray, now: float) -> list[tuple[object, int]]:
        """A chunk without drafts, as chapter 5 steps it: the tokens computed, blocks registered, a token sampled if
        the chunk reached the end of the sequence (the samples of ``n > 1`` forked first)."""
        if not (n == 1 and seq.output_token_ids and seq.num_uncomputed_tokens == 1):  # not a decode
            self.num_prefill_tokens += n  # a prompt chunk, or tokens recomputed after a preemption
        seq.num_computed_tokens += n
        if self.scheduler.enable_prefix_caching:
            self.store.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        if seq.num_computed_tokens < seq.num_tokens:
            return []  # a chunk in the middle of its prompt
        samples = [seq]
        if not seq.output_token_ids and self._num_samples(seq.request_id) > 1:
            samples += self._fork(seq)
        out = []
        for s in samples:
            token = self._sample(s, row, now)
            if token is not None:
                self._append_token(s, token, now)
                out.append((s.request_id, token))
        return out

    def spec_decode_stats(self) -> dict:
        return self.spec_stats.as_dict()


def build_speculative_engine(model: GPT2Model, spec: str, max_num_seqs: int = 32, max_num_batched_tokens: int = 512,
                             num_blocks: int | None = None, block_size: int = 16,
                             aging_s: float = 60.0) -> SpeculativeEngine:
    """Chapter 7's server engine (``build_engine``: the priority scheduler, room for ``max_num_seqs`` full contexts
    by default) with speculation as ``spec`` says (``drafters.make_drafter``: ``ngram:K``, ``draft:int8:K``, ...).
    ``python -m gpt2_core serve --speculative ngram:4`` serves with it."""
    check_limits(max_num_seqs, max_num_batched_tokens)
    if num_blocks is None:
        num_blocks = max_num_seqs * blocks_needed(model.config.n_positions, block_size)
    drafter, k = make_drafter(spec, model, num_blocks)
    engine = SpeculativeEngine(model, drafter, k, SpeculativeKVStore(model.config, num_blocks, block_size),
                               max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                               scheduler_cls=functools.partial(PriorityScheduler, aging_s=aging_s))
    engine.scheduler.clock = engine.clock  # arrival times are stamped with the engine's clock (as build_engine does)
    return engine
