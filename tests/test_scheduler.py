"""Chapter 3's scheduler: admission, token budget, preemption by recompute, and invariants under random workloads.

The contiguous store never runs out of room mid-sequence (each slot is preallocated to max_len), so preemption
is exercised with ``PoolKVStore``: a test store whose sequences share one pool of token positions, grown one token
at a time, the way a paged store behaves with blocks of one token.
"""

import numpy as np
import pytest
from helpers import TINY, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpt2_core import kv_cache
from gpt2_core.bench.replay import replay
from gpt2_core.ch03_batching.engine import LLMEngine
from gpt2_core.errors import CacheCapacityError, InvalidInputError
from gpt2_core.ch01_forward.generation import positions_needed
from gpt2_core.ch03_batching.kv_store import ContiguousKVStore, KVStore
from gpt2_core.ch03_batching.scheduler import Scheduler
from gpt2_core.ch03_batching.sequence import FinishReason, Request, Sequence, SequenceStatus

MODEL = tiny_model()


class PoolKVStore(KVStore):
    """``capacity`` token positions shared by all sequences; a sequence holds exactly what it was given."""

    def __init__(self, config, capacity: int):
        self.config, self.dtype, self.capacity = config, np.dtype(np.float32), capacity
        self.room: dict = {}  # seq_id -> tokens reserved
        self.k: dict = {}
        self.v: dict = {}

    def can_allocate(self, num_tokens):
        return self.reserved_tokens() + num_tokens <= self.capacity

    def allocate(self, seq_id, num_tokens):
        assert seq_id not in self.room, f"{seq_id} allocated twice"
        if not self.can_allocate(num_tokens):
            raise CacheCapacityError("pool full")
        c = self.config
        self.room[seq_id] = num_tokens
        self.k[seq_id] = np.full((c.n_layer, c.n_head, c.n_positions, c.head_dim), np.nan, np.float32)
        self.v[seq_id] = np.full_like(self.k[seq_id], np.nan)  # NaN: reading an unwritten position shows

    def can_ensure(self, seq_id, num_tokens):
        return seq_id in self.room and self.reserved_tokens() - self.room[seq_id] + num_tokens <= self.capacity

    def ensure(self, seq_id, num_tokens):
        if not self.can_ensure(seq_id, num_tokens):
            raise CacheCapacityError("pool full")
        self.room[seq_id] = max(self.room[seq_id], num_tokens)

    def update(self, seq_id, layer, start, k, v):
        end = start + k.shape[1]
        assert end <= self.room[seq_id], f"{seq_id} writes position {end - 1} beyond its room {self.room[seq_id]}"
        self.k[seq_id][layer, :, start:end] = k
        self.v[seq_id][layer, :, start:end] = v
        return self.k[seq_id][layer, :, :end], self.v[seq_id][layer, :, :end]

    def free(self, seq_id):
        if seq_id not in self.room:
            raise InvalidInputError(f"{seq_id} has nothing to free")
        del self.room[seq_id], self.k[seq_id], self.v[seq_id]

    def reserved_tokens(self):
        return sum(self.room.values())

    def capacity_tokens(self):
        return self.capacity


class NeverGrowsStore(ContiguousKVStore):
    """A contiguous store whose ``can_ensure`` fails for chosen sequences: forces preemption decisions."""

    def __init__(self, *args, refuse=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.refuse = set(refuse)

    def can_ensure(self, seq_id, num_tokens):
        return seq_id not in self.refuse and super().can_ensure(seq_id, num_tokens)


def greedy_alone(request):
    return kv_cache.generate(MODEL, request.prompt_token_ids, request.max_new_tokens, stop_at_eos=request.stop_at_eos)


def make_seq(seq_id, prompt_len, max_new=4):
    seq = Sequence(seq_id, Request(seq_id, list(range(1, prompt_len + 1)), max_new_tokens=max_new), arrival_time=0.0)
    seq.prompt_token_ids = list(range(1, prompt_len + 1))
    return seq


def test_admission_is_fcfs_within_max_num_seqs_and_the_token_budget():
    store = ContiguousKVStore(TINY, num_slots=4, max_len=16)
    sched = Scheduler(store, max_num_seqs=3, max_num_batched_tokens=10)
    for s in [make_seq(i, n) for i, n in enumerate([4, 5, 1, 1])]:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq_id for s in out.scheduled] == [0, 1, 2]  # 4 + 5 + 1 = 10 tokens; seq 3 is past max_num_seqs
    assert out.num_batched_tokens == 10 and out.num_prefill_seqs == 3
    assert [s.seq_id for s in sched.waiting] == [3]
    assert all(s.status is SequenceStatus.RUNNING for s in out.scheduled)
    assert len(store.slot_of) == 3


def test_the_head_of_the_queue_blocks_the_rest():
    store = ContiguousKVStore(TINY, num_slots=4, max_len=16)
    sched = Scheduler(store, max_num_seqs=4, max_num_batched_tokens=10)
    for s in [make_seq(0, 4), make_seq(1, 7), make_seq(2, 1)]:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq_id for s in out.scheduled] == [0]  # seq 1 (7 tokens) does not fit 10 - 4; seq 2 waits behind it
    assert out.num_prefill_seqs == 1 and out.num_batched_tokens == 4
    assert [s.seq_id for s in sched.waiting] == [1, 2]


def test_running_sequences_decode_before_new_prefills_share_the_budget():
    store = ContiguousKVStore(TINY, num_slots=4, max_len=16)
    sched = Scheduler(store, max_num_seqs=4, max_num_batched_tokens=8)
    a = make_seq(0, 6)
    sched.add(a)
    sched.schedule()
    a.num_computed_tokens, a.output_token_ids = 6, [9]  # as the engine leaves it after a prefill step
    for s in (make_seq(1, 6), make_seq(2, 1), make_seq(3, 1)):
        sched.add(s)
    out = sched.schedule()
    assert [s.seq_id for s in out.scheduled] == [0, 1, 2]  # 1 decode + 6 + 1 = 8 tokens: seq 3 waits
    assert (out.num_decode_seqs, out.num_prefill_seqs, out.num_batched_tokens) == (1, 2, 8)


def test_preemption_frees_the_newest_and_requeues_it_first_keeping_its_tokens():
    store = NeverGrowsStore(TINY, num_slots=3, max_len=16)
    sched = Scheduler(store, max_num_seqs=3, max_num_batched_tokens=32)
    seqs = [make_seq(i, 3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    sched.schedule()
    for s in seqs:
        s.num_computed_tokens, s.output_token_ids = 3, [7]
    store.refuse = {1}  # seq 1 cannot grow: the newest (seq 2) is preempted first, then seq 1 itself
    out = sched.schedule()
    assert [s.seq_id for s in out.preempted] == [2, 1]
    assert [s.seq_id for s in out.scheduled] == [0]
    assert [s.seq_id for s in sched.waiting] == [1, 2]  # front of the queue, oldest first
    for s in (seqs[1], seqs[2]):
        assert s.status is SequenceStatus.WAITING and s.num_computed_tokens == 0 and s.output_token_ids == [7]
        assert s.metrics.num_preemptions == 1 and s.seq_id not in store.slot_of
    assert sched.num_preemptions == 2
    assert out.num_prefill_seqs == 0  # nothing is admitted in a step that preempted
    store.refuse = set()
    seqs[0].output_token_ids, seqs[0].num_computed_tokens = [7, 8], 4  # seq 0 decoded once more
    out = sched.schedule()
    assert [s.seq_id for s in out.scheduled] == [0, 1, 2]
    assert [s.num_uncomputed_tokens for s in out.scheduled] == [1, 4, 4]  # prompt + output recomputed


def test_preemption_under_a_small_pool_still_gives_chapter_2_tokens():
    # 3 requests of up to 5 + 8 = 13 tokens, a pool of 16 positions: they cannot all grow at once
    store = PoolKVStore(TINY, capacity=16)
    engine = LLMEngine(MODEL, store, max_num_seqs=3, max_num_batched_tokens=16)
    rng = np.random.default_rng(3)
    requests = [Request(i, rng.integers(0, 100, size=5).tolist(), max_new_tokens=8, stop_at_eos=False)
                for i in range(3)]
    outs = engine.generate_many(requests)
    assert engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == engine.scheduler.num_preemptions
    for r, o in zip(requests, outs):
        assert o.finish_reason is FinishReason.LENGTH
        assert o.output_token_ids == greedy_alone(r), r.request_id
    assert store.reserved_tokens() == 0 and not store.room


def test_a_request_larger_than_the_whole_store_is_refused_not_deadlocked():
    store = PoolKVStore(TINY, capacity=10)
    engine = LLMEngine(MODEL, store, max_num_seqs=2, max_num_batched_tokens=16)
    big = Request("big", [1, 2, 3, 4, 5, 6], max_new_tokens=6)
    ok = Request("ok", [1, 2, 3], max_new_tokens=4, stop_at_eos=False)
    outs = engine.generate_many([big, ok])
    assert outs[0].finish_reason is FinishReason.ERROR and "could never fit" in outs[0].error
    assert outs[1].output_token_ids == greedy_alone(ok)
    slot = ContiguousKVStore(TINY, num_slots=4, max_len=8)
    out = LLMEngine(MODEL, slot, max_num_seqs=4).generate_many([Request("x", [1, 2, 3], max_new_tokens=7)])[0]
    assert out.finish_reason is FinishReason.ERROR and "room for one sequence (8 tokens)" in out.error
    out = LLMEngine(MODEL, max_num_seqs=2, max_num_batched_tokens=4).generate_many([Request("y", [1, 2], 4)])[0]
    assert out.finish_reason is FinishReason.ERROR and "max_num_batched_tokens=4" in out.error


def test_scheduler_rejects_bad_limits():
    store = ContiguousKVStore(TINY, num_slots=2)
    for kwargs in [dict(max_num_seqs=0), dict(max_num_batched_tokens=0), dict(max_num_seqs=8, max_num_batched_tokens=4),
                   dict(max_num_seqs=2.5)]:
        with pytest.raises(InvalidInputError):
            Scheduler(store, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Properties over random workloads

request_st = st.fixed_dictionaries({
    "prompt_len": st.integers(0, 12),  # 0 = invalid (empty prompt)
    "max_new_tokens": st.integers(0, 8),
    "arrival_s": st.integers(0, 12),  # in steps
    "bad_token": st.booleans() | st.just(False),
    "sampled": st.booleans(),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(request_st, min_size=1, max_size=10), st.integers(1, 4), st.integers(4, 20),
       st.sampled_from(["contiguous", "pool"]), st.integers(1, 4), st.integers(6, 40), st.integers(0, 2**16))
def test_random_workloads_finish_every_valid_request_within_limits(specs, max_num_seqs, max_num_batched_tokens,
                                                                   kind, num_slots, pool, seed):
    max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
    rng = np.random.default_rng(seed)
    if kind == "contiguous":
        store = ContiguousKVStore(TINY, num_slots=num_slots, max_len=int(rng.integers(4, TINY.n_positions + 1)))
    else:
        store = PoolKVStore(TINY, capacity=pool)
    engine = LLMEngine(MODEL, store, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    requests = []
    for i, s in enumerate(specs):
        prompt = rng.integers(0, TINY.vocab_size, size=s["prompt_len"]).tolist()
        if s["bad_token"] and prompt:
            prompt[0] = TINY.vocab_size + 3
        params = {"temperature": 0.8, "seed": i} if s["sampled"] else {}
        requests.append(Request(i, prompt, max_new_tokens=s["max_new_tokens"], sampling_params=params,
                                arrival_s=s["arrival_s"], stop_at_eos=bool(i % 2)))
    limit = min(TINY.n_positions, store.max_tokens_per_seq(), max_num_batched_tokens)
    valid = {r.request_id: 0 < len(r.prompt_token_ids) <= TINY.n_positions and
             all(0 <= t < TINY.vocab_size for t in r.prompt_token_ids) and
             positions_needed(len(r.prompt_token_ids), r.max_new_tokens) <= limit for r in requests}

    outs = replay(engine, requests, clock="steps")

    assert engine.num_steps < 1000  # no livelock
    for st_ in engine.step_stats:
        assert st_.num_seqs <= max_num_seqs and st_.num_batched_tokens <= max_num_batched_tokens
        assert st_.kv_slots_in_use <= max_num_seqs
    assert not engine.has_unfinished()
    assert store.reserved_tokens() == 0  # every slot / position freed
    by_id = {o.request_id: o for o in outs}
    assert set(by_id) == set(valid)
    for r in requests:
        o = by_id[r.request_id]
        if not valid[r.request_id]:
            assert o.finish_reason is FinishReason.ERROR and o.error, o
            continue
        assert o.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), o.error
        params = r.sampling_params
        alone = kv_cache.generate(MODEL, r.prompt_token_ids, r.max_new_tokens, stop_at_eos=r.stop_at_eos, **params)
        assert o.output_token_ids == alone, (r.request_id, kind)


def test_num_to_admit_is_fcfs_with_places_and_budget():
    from gpt2_core.ch03_batching.scheduler import num_to_admit

    assert num_to_admit([4, 5, 1, 1], 0, 3, 0, 10) == 3
    assert num_to_admit([4, 7, 1], 0, 4, 0, 10) == 1  # 7 does not fit: 1 waits behind it
    assert num_to_admit([2, 2], 3, 4, 0, 100) == 1  # one place left
    assert num_to_admit([3], 0, 4, 8, 10) == 0  # decodes already used 8 of 10 tokens
    assert num_to_admit([], 0, 4, 0, 10) == 0


class ShortestFirst(Scheduler):
    """Another admission policy, as a learner writes one: shortest prompt first, within the same two budgets."""

    def admit(self, num_batched_tokens):
        from gpt2_core.ch03_batching.scheduler import num_to_admit

        queue = sorted(self.waiting, key=lambda s: s.num_uncomputed_tokens)
        lens = [s.num_uncomputed_tokens for s in queue]
        return queue[:num_to_admit(lens, len(self.running), self.max_num_seqs, num_batched_tokens,
                                   self.max_num_batched_tokens)]


def test_a_subclass_admits_in_its_own_order_and_the_store_decides_as_before():
    store = ContiguousKVStore(TINY, num_slots=2, max_len=16)
    sched = ShortestFirst(store, max_num_seqs=3, max_num_batched_tokens=10)
    for s in [make_seq(0, 7), make_seq(1, 2), make_seq(2, 5), make_seq(3, 1)]:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq_id for s in out.scheduled] == [3, 1]  # 1 + 2 + 5 tokens fit, but the store has 2 slots
    assert [s.seq_id for s in sched.waiting] == [0, 2] and sorted(store.slot_of) == [1, 3]
    assert out.num_batched_tokens == 3 and out.num_prefill_seqs == 2


def test_the_engine_takes_a_scheduler_class_and_every_request_keeps_its_chapter_2_tokens():
    rng = np.random.default_rng(3)
    requests = [Request(i, rng.integers(0, TINY.vocab_size, size=int(rng.integers(1, 9))).tolist(),
                        max_new_tokens=int(rng.integers(1, 6)), stop_at_eos=False) for i in range(9)]
    engine = LLMEngine(MODEL, max_num_seqs=3, max_num_batched_tokens=12, max_len=16, scheduler_cls=ShortestFirst)
    assert type(engine.scheduler) is ShortestFirst
    outs = engine.generate_many(requests)
    assert [o.output_token_ids for o in outs] == [greedy_alone(r) for r in requests]
    start = engine.step_stats[0].start_time
    first_step = sorted(s.num_prompt_tokens for s in engine.sequences.values()
                        if s.metrics.first_scheduled_time == start)
    n = engine.step_stats[0].num_prefill_seqs
    assert n == len(first_step) >= 2 and first_step == sorted(len(r.prompt_token_ids) for r in requests)[:n]


def test_a_policy_that_breaks_a_budget_is_stopped_before_the_model_runs():
    class Greedy(Scheduler):
        def admit(self, num_batched_tokens):
            return list(self.waiting)  # everyone, whatever the budgets

    store = ContiguousKVStore(TINY, num_slots=4, max_len=16)
    sched = Greedy(store, max_num_seqs=4, max_num_batched_tokens=6)
    for s in [make_seq(0, 4), make_seq(1, 4)]:
        sched.add(s)
    with pytest.raises(AssertionError):
        sched.schedule()
