"""The priority scheduler: without priorities it is chapter 5's (same tokens); with them it admits by priority then
arrival and preempts the least urgent, latest arrival; the aging rule bounds every request's wait."""

import functools
import math

import pytest

from gpt2_core.ch04_paged.block_manager import blocks_needed
from gpt2_core.ch05_sharing.caching_engine import CachingLLMEngine
from gpt2_core.errors import InvalidInputError
from gpt2_core.ch05_sharing.prefix_cache import PrefixCachingKVStore
from gpt2_core.ch07_serving.priority_scheduler import PriorityRequest, PriorityScheduler, effective_priority
from gpt2_core.ch03_batching.sequence import FinishReason, Request
from helpers import tiny_model


class Clock:
    """A clock the test moves: one second per engine step."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def engine_with(model, clock=None, aging_s=10.0, num_blocks=None, max_num_seqs=4, priority=True):
    store = PrefixCachingKVStore(model.config, num_blocks or max_num_seqs * blocks_needed(16, 4), block_size=4)
    kwargs = {"clock": clock} if clock is not None else {}
    if priority:
        kwargs["scheduler_cls"] = functools.partial(PriorityScheduler, aging_s=aging_s,
                                                    **({"clock": clock} if clock is not None else {}))
    return CachingLLMEngine(model, store, max_num_seqs=max_num_seqs, max_num_batched_tokens=32, **kwargs)


def test_effective_priority_is_the_stated_rule():
    assert [effective_priority(3, w, 2.0) for w in (0, 1.9, 2.0, 5.9, 6.0, 100)] == [3, 3, 2, 1, 0, -47]
    assert effective_priority(3, 1e9, math.inf) == 3


def test_without_priorities_the_tokens_are_chapter_5s_even_under_preemption():
    model = tiny_model()
    requests = [Request(i, [(7 * i + j) % 100 for j in range(3 + i % 4)], 8, {"temperature": 0.8, "seed": i})
                for i in range(10)]
    outs = []
    for priority in (False, True):  # a store of 6 blocks of 4 for up to 4 sequences of up to 14 tokens: preemptions
        engine = engine_with(model, num_blocks=6, priority=priority)
        outs.append([(o.output_token_ids, o.finish_reason) for o in engine.generate_many(requests)])
        assert engine.scheduler.num_preemptions > 0
    assert outs[0] == outs[1]


def admitted_order(engine, clock, requests, arrivals):
    for r, t in zip(requests, arrivals):
        engine.add_request(r, arrival_time=t)
    order = []
    while engine.has_unfinished():
        for request_id, _ in engine.step():
            if request_id not in order:
                order.append(request_id)
        clock.t += 1
    return order


def test_admission_is_by_priority_then_arrival():
    model, clock = tiny_model(), Clock()
    engine = engine_with(model, clock, max_num_seqs=1)
    requests = [PriorityRequest(name, [1, 2, 3], 2, priority=p) for name, p in
                [("a", 1), ("b", 0), ("c", 1), ("d", 0), ("e", -2)]]
    assert admitted_order(engine, clock, requests, [0, 0.1, 0.2, 0.3, 0.4]) == ["e", "b", "d", "a", "c"]


def test_under_kv_pressure_the_least_urgent_latest_arrival_is_preempted():
    model, clock = tiny_model(), Clock()
    # 4 blocks of 4 tokens; three sequences of 4-token prompts admitted, each needing a second block to decode
    engine = engine_with(model, clock, num_blocks=4, max_num_seqs=3)
    for name, p, t in [("urgent-late", 0, 0.2), ("lax-early", 5, 0.0), ("lax-late", 5, 0.1)]:
        engine.add_request(PriorityRequest(name, [1, 2, 3, 4], 6, priority=p), arrival_time=t)
    preempted = []
    while engine.has_unfinished():
        before = {s.request_id: s.metrics.num_preemptions for s in engine.sequences.values()}
        engine.step()
        preempted += [s.request_id for s in engine.sequences.values() if s.metrics.num_preemptions > before[s.request_id]]
    assert preempted and preempted[0] == "lax-late"
    assert engine.get_sequence("urgent-late").metrics.num_preemptions == 0
    assert all(s.finish_reason is FinishReason.LENGTH for s in engine.sequences.values())


@pytest.mark.parametrize("aging_s, admitted_within", [(2.0, 8), (math.inf, None)])
def test_aging_admits_a_lax_request_despite_a_stream_of_urgent_ones(aging_s, admitted_within):
    """One place; a priority-3 request waits while a new priority-0 request arrives every second (step). With
    aging every 2 s it competes as priority 0 after 6 s and wins the tie by arriving first: admitted by step 8.
    Without aging it is never admitted while urgent requests keep coming (starvation)."""
    model, clock = tiny_model(), Clock()
    engine = engine_with(model, clock, aging_s=aging_s, max_num_seqs=1)
    engine.add_request(PriorityRequest("lax", [1, 2, 3], 1, priority=3), arrival_time=0.0)
    admitted_at = None
    for step in range(40):
        engine.add_request(PriorityRequest(f"urgent{step}", [4, 5, 6], 1, priority=0), arrival_time=clock.t)
        if any(rid == "lax" for rid, _ in engine.step()):
            admitted_at = step
        clock.t += 1
    if admitted_within is None:
        assert admitted_at is None
    else:
        assert admitted_at is not None and admitted_at <= admitted_within


def test_a_bad_priority_fails_its_request_alone():
    engine = engine_with(tiny_model())
    engine.add_request(PriorityRequest("bad", [1, 2], 2, priority=10**9))
    engine.add_request(PriorityRequest("flag", [1, 2], 2, priority=True))
    engine.add_request(PriorityRequest("good", [1, 2], 2, priority=-4))
    engine.run_until_done()
    for name in ("bad", "flag"):
        s = engine.get_sequence(name)
        assert s.finish_reason is FinishReason.ERROR and "priority must be an integer" in s.error
    assert engine.get_sequence("good").finish_reason is FinishReason.LENGTH
    with pytest.raises(InvalidInputError, match="aging_s"):
        engine_with(tiny_model(), aging_s=0)


def test_abort_and_release_free_everything():
    engine = engine_with(tiny_model())
    engine.add_request(PriorityRequest("r", [1, 2, 3], 10, {"temperature": 1.0, "seed": 0}), n=3)
    engine.step()
    engine.step()
    assert engine.store.manager.num_used_blocks() > 0
    with pytest.raises(InvalidInputError, match="not finished"):
        engine.release_request("r")
    engine.abort_request("r")
    assert [o.finish_reason for o in engine.samples("r")] == [FinishReason.ABORT] * 3
    assert engine.store.manager.num_used_blocks() == 0 and not engine.has_unfinished()
    engine.release_request("r")
    assert not engine.sequences and not engine._by_request and not engine._sample_ids
    engine.add_request(PriorityRequest("r", [1, 2, 3], 2), n=2)  # the name is free again
    engine.run_until_done()
