"""Chapter 5: decode attention that reads K/V blocks where they lie, with an online softmax.

* ``paged_decode_attention`` over any split of the positions into runs equals chapter 3's ``decode_attention`` on
  the gathered K/V within 1e-5 (float32: the online softmax adds the same terms in another order and rescales
  them), also with scores above 100, where a softmax without its maximum subtracted overflows.
* Through chapter 3's ``ragged_forward`` and engine, the paged-attention store gives chapter 4's logits within
  1e-5 and the same greedy tokens, with sequences whose blocks interleave in the pool and under preemption.
* The store reads in place while a sequence's runs are few for its length (at most 1 + S / ``run_cost_tokens``)
  and gathers beyond, with the same logits either way.
"""

import numpy as np
import pytest
from helpers import tiny_model

from gpt2_core import kv_cache
from gpt2_core.ch03_batching.engine import LLMEngine
from gpt2_core.errors import CacheCapacityError
from gpt2_core.ch01_forward.model import decode_attention
from gpt2_core.ch03_batching.model_runner import Chunk, ragged_forward
from gpt2_core.ch05_sharing import paged_attention
from gpt2_core.ch05_sharing.paged_attention import PagedAttentionKVStore, contiguous_runs, paged_decode_attention
from gpt2_core.ch04_paged.paged_kv_store import PagedKVStore
from gpt2_core.ch03_batching.sequence import FinishReason, Request

MODEL = tiny_model()
CFG = MODEL.config


def test_contiguous_runs_split_where_the_next_slot_is_not_the_one_after():
    assert contiguous_runs(np.array([4, 5, 6, 7, 12, 13, 2, 3])) == [(4, 8), (12, 14), (2, 4)]
    assert contiguous_runs(np.array([9])) == [(9, 10)]
    assert contiguous_runs(np.arange(32, 64)) == [(32, 64)]
    assert contiguous_runs(np.array([3, 2, 1])) == [(3, 4), (2, 3), (1, 2)]  # position order, not slot order


def random_pool_and_runs(rng, num_tokens, H=4, D=8, block_size=4, scale=1.0):
    """A pool whose blocks are scattered (a random block table), and the runs holding ``num_tokens`` positions."""
    num_blocks = -(-num_tokens // block_size)
    table = rng.permutation(3 * num_blocks)[:num_blocks]
    slots = (table[:, None] * block_size + np.arange(block_size)).reshape(-1)[:num_tokens]
    pool = rng.standard_normal((3 * num_blocks * block_size, 2, H, D), dtype=np.float32)
    q = (rng.standard_normal((H, 1, D), dtype=np.float32) * np.float32(scale / np.sqrt(D)))
    return q, pool, slots


@pytest.mark.parametrize("num_tokens,block_size", [(1, 4), (5, 4), (16, 4), (37, 1), (64, 16), (200, 3)])
def test_online_softmax_over_runs_equals_attention_on_the_gathered_kv(num_tokens, block_size):
    rng = np.random.default_rng(num_tokens * 7 + block_size)
    q, pool, slots = random_pool_and_runs(rng, num_tokens, block_size=block_size)
    k, v = pool[slots, 0].transpose(1, 0, 2), pool[slots, 1].transpose(1, 0, 2)  # the gather, [H, S, D]
    want = decode_attention(q, k, v)
    got = paged_decode_attention(q, pool, contiguous_runs(slots))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    one_by_one = [(int(s), int(s) + 1) for s in slots]  # every position its own run: the most rescaling
    np.testing.assert_allclose(paged_decode_attention(q, pool, one_by_one), want, atol=1e-5, rtol=0)


def test_online_softmax_with_scores_above_100_is_finite_and_exact():
    rng = np.random.default_rng(3)
    q, pool, slots = random_pool_and_runs(rng, 50, scale=300.0)
    k, v = pool[slots, 0].transpose(1, 0, 2), pool[slots, 1].transpose(1, 0, 2)
    scores = q @ k.transpose(0, 2, 1)
    assert np.abs(scores).max() > 100  # exp() of these overflows float32 without the running maximum
    s64 = scores.astype(np.float64)
    p = np.exp(s64 - s64.max(axis=-1, keepdims=True))
    want = (p / p.sum(axis=-1, keepdims=True)) @ v.astype(np.float64)  # float64 reference
    runs = contiguous_runs(slots)
    assert len(runs) > 5
    got = paged_decode_attention(q, pool, runs)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    # the largest score in the last run: everything before is rescaled by exp(m_old - m_new) ~ 0, still exact
    q_last = pool[slots[-1], 0][:, None, :] * np.float32(40)
    s = (q_last @ k.transpose(0, 2, 1)).astype(np.float64)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(paged_decode_attention(q_last, pool, runs),
                               (p / p.sum(-1, keepdims=True)) @ v.astype(np.float64), atol=1e-5, rtol=0)


def interleaved_steps(store, prompts, steps):
    """Prefill ``prompts`` then decode ``steps`` greedy tokens for all, in turns (so their blocks interleave);
    every step's logits [B, V]."""
    seqs = [list(p) for p in prompts]
    for i, p in enumerate(prompts):
        store.allocate(i, len(p))
    chunks = [Chunk(i, np.array(p), 0) for i, p in enumerate(prompts)]
    out = []
    for _ in range(steps):
        logits = ragged_forward(MODEL, store, chunks)
        out.append(logits)
        for i, s in enumerate(seqs):
            s.append(int(np.argmax(logits[i])))
            store.ensure(i, len(s))
        chunks = [Chunk(i, np.array(s[-1:]), len(s) - 1) for i, s in enumerate(seqs)]
    return out, seqs


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_paged_attention_store_gives_chapter_4s_logits(block_size):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, CFG.vocab_size, size=n).tolist() for n in (5, 1, 7, 3)]
    gathered, tokens = interleaved_steps(PagedKVStore(CFG, num_blocks=64, block_size=block_size), prompts, 8)
    store = PagedAttentionKVStore(CFG, num_blocks=64, block_size=block_size)
    store.run_cost_tokens = 0  # in place however scattered: the online softmax over many runs is what is checked
    in_place, paged_tokens = interleaved_steps(store, prompts, 8)
    assert paged_tokens == tokens
    for a, b in zip(in_place, gathered):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    if block_size < 16:  # the sequences grew in turns: their blocks interleave, several runs each
        assert max(len(contiguous_runs(store.slots[i][:len(s) - 1])) for i, s in enumerate(tokens)) > 1


def test_the_store_reads_in_place_exactly_where_the_rule_says_and_gathers_elsewhere(monkeypatch):
    reads = []  # (runs, tokens, read in place?) of every decode attention
    in_place = []
    real_read = paged_attention.paged_decode_attention
    monkeypatch.setattr(paged_attention, "paged_decode_attention", lambda *a: in_place.append(1) or real_read(*a))
    real_attend = PagedAttentionKVStore.attend_decode

    def attend(self, seq_id, layer, start, q, k, v):
        runs, before = len(contiguous_runs(self.slots[seq_id][:start + 1])), len(in_place)
        out = real_attend(self, seq_id, layer, start, q, k, v)
        reads.append((runs, start + 1, len(in_place) > before))
        return out

    monkeypatch.setattr(PagedAttentionKVStore, "attend_decode", attend)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, CFG.vocab_size, size=n).tolist() for n in (6, 2, 5)]
    gathered, tokens = interleaved_steps(PagedKVStore(CFG, num_blocks=64, block_size=2), prompts, 6)
    for cost in (0, 3, 1000):
        reads.clear()
        store = PagedAttentionKVStore(CFG, num_blocks=64, block_size=2)
        store.run_cost_tokens = cost
        got, got_tokens = interleaved_steps(store, prompts, 6)
        assert got_tokens == tokens  # the same tokens and logits whichever way each read went
        for a, b in zip(got, gathered):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
        assert store.written == {i: len(s) - 1 for i, s in enumerate(tokens)}  # each new token written once
        assert len(reads) == 5 * len(prompts) * CFG.n_layer  # the steps after the prefill x sequences x layers
        assert all(read == ((runs - 1) * cost <= n) for runs, n, read in reads)  # the rule, both ways
        several_runs = [read for runs, _, read in reads if runs > 1]
        assert several_runs and {0: {True}, 3: {True, False}, 1000: {False}}[cost] == set(several_runs)
    assert PagedAttentionKVStore.run_cost_tokens == paged_attention.RUN_COST_TOKENS == 100


def test_decode_outside_the_reserved_room_is_an_error_that_writes_nothing():
    store = PagedAttentionKVStore(CFG, num_blocks=4, block_size=4)
    store.allocate("a", 3)
    before = store.kv.copy()
    q = np.zeros((CFG.n_head, 1, CFG.head_dim), np.float32)
    for start in (3, -1):
        with pytest.raises(CacheCapacityError, match="outside its 3 reserved slots"):
            store.attend_decode("a", 0, start, q, q, q)
    np.testing.assert_array_equal(store.kv, before)


def requests(n, seed=0):
    rng = np.random.default_rng(seed)
    return [Request(i, rng.integers(0, CFG.vocab_size, size=int(rng.integers(1, 8))).tolist(),
                    max_new_tokens=int(rng.integers(1, 9)), stop_at_eos=False) for i in range(n)]


def test_chapter_3s_engine_over_the_paged_attention_store_gives_the_tokens_of_running_alone_with_preemptions(
        run_cost_tokens):
    store = PagedAttentionKVStore(CFG, num_blocks=5, block_size=4)
    engine = LLMEngine(MODEL, store=store, max_num_seqs=8)
    outputs = engine.generate_many(requests(12))
    assert engine.scheduler.num_preemptions > 0
    for r, o in zip(requests(12), outputs):
        assert o.finish_reason is FinishReason.LENGTH
        assert o.output_token_ids == kv_cache.generate(MODEL, r.prompt_token_ids, r.max_new_tokens, stop_at_eos=False)
    assert store.manager.num_free_blocks == store.num_blocks and store.runs == {}
    store.check_invariants()
