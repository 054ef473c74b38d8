"""Chapter 5's engine: prefix caching, chunked prefill, parallel sampling and paged attention, together.

* Every request gets the tokens it gets alone (chapter 2's ``kv_cache.generate``, greedy; sample ``i`` of a
  request with ``n`` samples gets those of a lone request seeded ``seed + i``) under each feature, all of them,
  and preemption; and chapter 4's logits within 1e-5 (the K/V a hit shares were computed in another batch:
  float32 rounding, not other numbers).
* Random workloads with shared prefixes on random small pools (hypothesis) always finish with those tokens and
  leave the pool free and consistent.
* Chunked prefill: no step holds more than ``max_num_batched_tokens`` tokens, and every running decode gets its
  token in every step while a long prompt is prefilled in chunks.
* Bad input (``n`` < 1 or not an integer, more samples than places, a prompt over the context) is a clear error
  that leaves the other requests running.
"""

import numpy as np
import pytest
from helpers import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from gpt2_core import GPT2Config, kv_cache
from gpt2_core.ch05_sharing.caching_engine import CachingLLMEngine
from gpt2_core.ch03_batching.engine import LLMEngine
from gpt2_core.errors import InvalidInputError
from gpt2_core.ch01_forward.generation import positions_needed
from gpt2_core.ch04_paged.paged_kv_store import PagedKVStore
from gpt2_core.ch05_sharing.prefix_cache import PrefixCachingKVStore
from gpt2_core.ch01_forward.sampling import SamplingParams
from gpt2_core.ch03_batching.sequence import FinishReason, Request

CFG = GPT2Config(vocab_size=101, n_positions=64, n_embd=24, n_head=3, n_layer=2, eos_token_id=100)
MODEL = tiny_model(config=CFG)
SYSTEM = np.random.default_rng(0).integers(0, 100, 20).tolist()  # a "system prompt" the requests share


def shared_prefix_requests(n, seed=1, logits_log=None):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        head = SYSTEM[:int(rng.integers(0, len(SYSTEM) + 1))]  # some share all of it, some part, some none
        prompt = head + rng.integers(0, 100, size=int(rng.integers(1, 9))).tolist()
        proc = None
        if logits_log is not None:
            logits_log[i] = []
            proc = (lambda log: (lambda ids, logits: log.append(np.array(logits)) or logits))(logits_log[i])
        out.append(Request(i, prompt, max_new_tokens=int(rng.integers(1, 12)), stop_at_eos=False,
                           logits_processor=proc))
    return out


def alone(r, temperature=0.0, seed=None):
    return kv_cache.generate(MODEL, r.prompt_token_ids, r.max_new_tokens, temperature=temperature, seed=seed,
                             stop_at_eos=False)


FEATURES = {  # name -> (num_blocks, block_size, max_num_batched_tokens, prefix caching, chunked prefill)
    "paged attention only": (64, 4, 64, False, False),
    "prefix caching": (64, 4, 64, True, False),
    "chunked prefill": (64, 4, 7, False, True),
    "all": (64, 4, 7, True, True),
    "all, preempting": (10, 4, 7, True, True),
    "all, block size 1, preempting": (36, 1, 5, True, True),
    "prefix caching, preempting": (12, 4, 64, True, False),
}


@pytest.mark.parametrize("feature", FEATURES)
def test_every_feature_gives_the_tokens_of_running_alone_and_chapter_4s_logits(feature, run_cost_tokens):
    num_blocks, bs, budget, caching, chunking = FEATURES[feature]
    log4, log5 = {}, {}
    chapter4 = LLMEngine(MODEL, store=PagedKVStore(CFG, 256, 4), max_num_seqs=4)
    chapter4.generate_many(shared_prefix_requests(14, logits_log=log4))
    store = PrefixCachingKVStore(CFG, num_blocks, bs)
    engine = CachingLLMEngine(MODEL, store, max_num_seqs=4, max_num_batched_tokens=budget,
                              enable_prefix_caching=caching, enable_chunked_prefill=chunking)
    outputs = engine.generate_many(shared_prefix_requests(14, logits_log=log5))
    for r, o in zip(shared_prefix_requests(14), outputs):
        assert o.finish_reason is FinishReason.LENGTH, o.error
        assert o.output_token_ids == alone(r)
        assert len(log5[r.request_id]) == r.max_new_tokens  # no logits sampled mid-prompt
        for a, b in zip(log5[r.request_id], log4[r.request_id]):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    stats = engine.prefix_cache_stats()
    assert (stats["hit_tokens"] > 0) == caching
    if "preempting" in feature:
        assert engine.scheduler.num_preemptions > 0
    if chunking:
        assert max(s.num_batched_tokens for s in engine.step_stats) <= budget
        assert any(s.num_prefill_seqs and s.num_decode_seqs for s in engine.step_stats)  # mixed steps
    assert store.manager.num_free_blocks == num_blocks and store.slots == {} and store.runs == {}
    store.check_invariants()


def test_prefix_caching_computes_only_what_is_not_cached():
    store = PrefixCachingKVStore(CFG, 64, 4)
    engine = CachingLLMEngine(MODEL, store, max_num_seqs=4, enable_chunked_prefill=False)
    first = Request("a", SYSTEM + [1, 2], 3, stop_at_eos=False)
    engine.generate_many([first])
    assert engine.prefix_cache_stats()["prefill_tokens_computed"] == 22
    second = Request("b", SYSTEM + [3], 3, stop_at_eos=False)  # 21 tokens: the 5 full blocks of SYSTEM are cached
    out = engine.generate_many([second])
    stats = engine.prefix_cache_stats()
    assert stats["hit_tokens"] == 20 and stats["queried_tokens"] == 22 + 21
    assert stats["prefill_tokens_computed"] == 22 + 1  # only its last token
    assert out[0].output_token_ids == alone(second)
    assert engine.num_cached_tokens == 20


def test_a_finished_conversation_turn_is_cached_for_the_next_turn_including_its_generated_tokens():
    store = PrefixCachingKVStore(CFG, 64, 4)
    engine = CachingLLMEngine(MODEL, store, max_num_seqs=2)
    turn1 = Request("t1", SYSTEM[:10], 9, stop_at_eos=False)
    reply = engine.generate_many([turn1])[0].output_token_ids
    turn2 = Request("t2", SYSTEM[:10] + reply + [5, 6], 4, stop_at_eos=False)  # resends the history
    out = engine.generate_many([turn2])[0]
    # prompt and the reply's first 8 tokens were computed (the 9th was never fed back): 18 tokens, 4 full blocks
    assert engine.prefix_cache_stats()["hit_tokens"] == 16
    assert out.output_token_ids == alone(turn2)


@pytest.mark.parametrize("prompt_len", [22, 24])
def test_n_samples_share_the_prompts_blocks_and_each_is_a_seeded_lone_run(prompt_len, run_cost_tokens):
    store = PrefixCachingKVStore(CFG, 64, 4)
    engine = CachingLLMEngine(MODEL, store, max_num_seqs=6)
    params = SamplingParams(temperature=1.0, seed=11)
    r = Request("x", (SYSTEM * 2)[:prompt_len], 6, sampling_params=params, stop_at_eos=False)
    engine.add_request(r, n=4)
    engine.step()  # the prefill: one sequence computes the prompt, then forks into 4
    assert engine.num_prefill_tokens == prompt_len
    tables = [store.block_table(s.seq_id) for s in engine.scheduler.running]
    assert len(tables) == 4 and all(t == tables[0] for t in tables)  # shared, not copied
    assert store.manager.num_used_blocks() == -(-prompt_len // 4)
    engine.step()  # each writes its first token: the partly filled last block is copied on write
    copies = 3 if prompt_len % 4 else 0  # 3 of the 4 copy; the last keeps the original
    assert store.manager.num_used_blocks() == -(-prompt_len // 4) + copies + (0 if prompt_len % 4 else 4)
    engine.run_until_done()
    samples = engine.samples("x")
    assert [o.request_id for o in samples] == ["x", ("x", 1), ("x", 2), ("x", 3)]
    for i, o in enumerate(samples):
        assert o.output_token_ids == alone(r, temperature=1.0, seed=11 + i)
    assert len({tuple(o.output_token_ids) for o in samples}) > 1
    assert store.manager.num_free_blocks == 64
    store.check_invariants()


def test_greedy_samples_are_all_the_lone_greedy_run_also_when_preempted(run_cost_tokens):
    store = PrefixCachingKVStore(CFG, 9, 4)  # 36 positions: 3 samples of 22 + 10 tokens cannot all run at once
    engine = CachingLLMEngine(MODEL, store, max_num_seqs=4, max_num_batched_tokens=8)
    r = Request("g", SYSTEM + [1, 2], 10, stop_at_eos=False)
    engine.add_request(r, n=3)
    other = Request("o", [9, 8, 7], 5, stop_at_eos=False)
    engine.add_request(other)
    engine.run_until_done()
    assert engine.scheduler.num_preemptions > 0
    assert [o.output_token_ids for o in engine.samples("g")] == [alone(r)] * 3
    assert engine.samples("o")[0].output_token_ids == alone(other)
    store.check_invariants()


def test_chunked_prefill_never_stalls_the_running_decodes():
    store = PrefixCachingKVStore(CFG, 64, 4)
    engine = CachingLLMEngine(MODEL, store, max_num_seqs=4, max_num_batched_tokens=8)
    decoders = [Request(f"d{i}", [i + 1, 2, 3], 20, stop_at_eos=False) for i in range(3)]
    for r in decoders:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    long = Request("long", list(range(40)), 2, stop_at_eos=False)
    engine.add_request(long)
    steps_before = engine.num_steps
    while engine.get_sequence("long").num_computed_tokens < 40:
        produced = dict(engine.step())
        assert all(f"d{i}" in produced for i in range(3))  # every decode got its token in this step
        assert engine.step_stats[-1].num_batched_tokens <= 8
    assert engine.num_steps - steps_before == 8  # 40 tokens in chunks of 8 - 3 = 5
    engine.run_until_done()
    for r in decoders + [long]:
        assert engine.get_sequence(r.request_id).output_token_ids == alone(r)


def test_without_chunked_prefill_a_prompt_over_the_budget_is_refused_with_it_it_runs():
    long = Request("long", list(range(30)), 3, stop_at_eos=False)
    whole = CachingLLMEngine(MODEL, PrefixCachingKVStore(CFG, 64, 4), max_num_seqs=2, max_num_batched_tokens=16,
                             enable_chunked_prefill=False)
    out = whole.generate_many([long])[0]
    assert out.finish_reason is FinishReason.ERROR and "max_num_batched_tokens=16" in out.error
    chunked = CachingLLMEngine(MODEL, PrefixCachingKVStore(CFG, 64, 4), max_num_seqs=2, max_num_batched_tokens=16)
    assert chunked.generate_many([long])[0].output_token_ids == alone(long)


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "2", None])
def test_a_bad_number_of_samples_is_a_clear_error_and_the_others_run(n):
    engine = CachingLLMEngine(MODEL, PrefixCachingKVStore(CFG, 64, 4), max_num_seqs=4)
    ok = Request("ok", [1, 2, 3], 5, stop_at_eos=False)
    engine.add_request(ok)
    engine.step()
    with pytest.raises(InvalidInputError, match="n .the number of samples. must be an integer >= 1"):
        engine.add_request(Request("bad", [1, 2], 3), n=n)
    with pytest.raises(InvalidInputError, match="n=5 samples run at once, more than max_num_seqs=4"):
        engine.add_request(Request("many", [1, 2], 3), n=5)
    engine.run_until_done()
    assert engine.get_sequence("ok").output_token_ids == alone(ok)
    assert set(engine._by_request) == {"ok"}  # nothing else was queued


def test_a_prompt_over_the_context_fails_alone_and_sample_ids_are_reserved():
    engine = CachingLLMEngine(MODEL, PrefixCachingKVStore(CFG, 64, 4), max_num_seqs=4, max_num_batched_tokens=8)
    too_long = Request("too_long", list(range(60)), 10, stop_at_eos=False)  # 60 + 9 positions > n_ctx = 64
    ok = Request("ok", SYSTEM, 4, stop_at_eos=False)
    engine.add_request(ok, n=2)
    engine.add_request(too_long)
    with pytest.raises(InvalidInputError, match="is taken by a sample of request 'ok'"):
        engine.add_request(Request(("ok", 1), [1], 1))
    engine.run_until_done()
    failed = engine.get_sequence("too_long")
    assert failed.finish_reason is FinishReason.ERROR and "exceeds the context n_ctx=64" in failed.error
    assert [o.output_token_ids for o in engine.samples("ok")] == [alone(ok)] * 2


def test_the_engine_needs_a_caching_store_and_boolean_switches():
    with pytest.raises(InvalidInputError, match="needs a PrefixCachingKVStore, got PagedKVStore"):
        CachingLLMEngine(MODEL, PagedKVStore(CFG, 8, 4))
    with pytest.raises(InvalidInputError, match="enable_chunked_prefill must be True or False"):
        CachingLLMEngine(MODEL, PrefixCachingKVStore(CFG, 8, 4), enable_chunked_prefill="yes")
    engine = CachingLLMEngine(MODEL)  # the default store: room for max_num_seqs full contexts
    assert engine.store.capacity_tokens() == 32 * CFG.n_positions


def test_a_request_whose_own_sampling_fails_fails_alone_after_a_fork():
    engine = CachingLLMEngine(MODEL, PrefixCachingKVStore(CFG, 64, 4), max_num_seqs=4)

    def broken(ids, logits):
        if len(ids) > len(SYSTEM) + 1:
            raise RuntimeError("boom")
        return logits

    engine.add_request(Request("b", SYSTEM, 5, stop_at_eos=False, logits_processor=broken), n=2)
    ok = Request("ok", [4, 5, 6], 5, stop_at_eos=False)
    engine.add_request(ok)
    engine.run_until_done()
    for o in engine.samples("b"):
        assert o.finish_reason is FinishReason.ERROR and "boom" in o.error and len(o.output_token_ids) == 2
    assert engine.get_sequence("ok").output_token_ids == alone(ok)
    assert engine.store.manager.num_free_blocks == 64


@settings(max_examples=40, derandomize=True, deadline=None, database=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(6, 24), block_size=st.sampled_from([1, 2, 4, 8]),
       max_num_seqs=st.integers(1, 5), budget=st.integers(5, 40), caching=st.booleans(), chunking=st.booleans(),
       n=st.integers(1, 10))
def test_random_workloads_with_shared_prefixes_always_finish_with_the_tokens_of_running_alone(
        seed, num_blocks, block_size, max_num_seqs, budget, caching, chunking, n):
    budget = max(budget, max_num_seqs)
    store = PrefixCachingKVStore(CFG, num_blocks, block_size)
    engine = CachingLLMEngine(MODEL, store, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                              enable_prefix_caching=caching, enable_chunked_prefill=chunking)
    reqs = shared_prefix_requests(n, seed=seed)
    outputs = engine.generate_many(reqs)
    for r, o in zip(reqs, outputs):
        total = positions_needed(len(r.prompt_token_ids), r.max_new_tokens)
        if total > store.max_tokens_per_seq() or (not chunking and total > budget):
            assert o.finish_reason is FinishReason.ERROR  # refused at admission, never deadlocks
        else:
            assert o.output_token_ids == alone(r), (r, o)
    assert not engine.has_unfinished()
    assert store.manager.num_free_blocks == num_blocks
    store.check_invariants()
