"""The appendix's decode attention in one kernel call per layer (``a1_cpu_kernels.attention``): chapter 3's step
hands its store every decoding token of a layer at once (``attend_decodes``), and ``SlotAttentionKVStore`` answers
with chapter 3's numbers (to float32 rounding), writes exactly what chapter 3's store writes, refuses what it
refuses, and gives an engine the same tokens."""

import numpy as np
import pytest
from helpers import tiny_model

from gpt2_core.a1_cpu_kernels import accelerate, is_accelerated
from gpt2_core.a1_cpu_kernels import attention as A
from gpt2_core.ch03_batching.engine import LLMEngine
from gpt2_core.ch03_batching.kv_store import ContiguousKVStore
from gpt2_core.ch03_batching.model_runner import Chunk, ragged_forward
from gpt2_core.ch03_batching.sequence import Request
from gpt2_core.ch06_quantization.quant_kernels import numba_available
from gpt2_core.errors import CacheCapacityError
from gpt2_core.loading.config import GPT2Config

CONFIG = GPT2Config(vocab_size=64, n_positions=48, n_embd=32, n_layer=2, n_head=4)
needs_numba = pytest.mark.skipif(not numba_available(), reason="numba (the kernels extra) is not installed")


def filled_pair(starts, num_slots=5, max_len=40, seed=0):
    """Chapter 3's store and the appendix's with the same random K/V, a sequence per start, slots out of order."""
    rng = np.random.default_rng(seed)
    stores = [ContiguousKVStore(CONFIG, num_slots, max_len), A.SlotAttentionKVStore(CONFIG, num_slots, max_len)]
    k, v = (rng.standard_normal(stores[0].k.shape, dtype=np.float32) for _ in range(2))
    for store in stores:
        store.k[...], store.v[...] = k, v
        store.allocate("warm-up", 1), store.allocate("gap", 1)  # the sequences below get slots 2, 3, ...
        store.free("warm-up")
        for i, start in enumerate(starts):
            store.allocate(i, start + 1)
    return stores


@needs_numba
@pytest.mark.parametrize("starts", [[0], [5, 0, 39, 17], [39, 38, 1]])
def test_one_call_attends_every_sequence_as_chapter_3s_loop_and_writes_the_same(starts):
    ch3, slot = filled_pair(starts)
    H, D, B = CONFIG.n_head, CONFIG.head_dim, len(starts)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((H, B, D), dtype=np.float32) for _ in range(3))
    ids = list(range(B))
    for layer in range(CONFIG.n_layer):
        want = ch3.attend_decodes(ids, layer, starts, q, k, v)
        got = slot.attend_decodes(ids, layer, starts, q, k, v)
        assert got.shape == want.shape == (H, B, D) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert np.array_equal(slot.k, ch3.k) and np.array_equal(slot.v, ch3.v)  # the new tokens, at their starts only
    assert all(np.array_equal(slot.k[ch3.slot_of[i], :, :, s], np.broadcast_to(k[:, i], slot.k[0, :, :, 0].shape))
               for i, s in enumerate(starts))


@needs_numba
def test_the_kernel_runs_with_the_worker_thread_and_without(monkeypatch):
    """Half the (sequence, head) pairs go to the tiles' worker thread; a machine of one core runs them all."""
    starts = [3, 30, 12]
    H, D = CONFIG.n_head, CONFIG.head_dim
    q, k, v = (np.random.default_rng(2).standard_normal((H, 3, D), dtype=np.float32) for _ in range(3))
    with_worker = filled_pair(starts)[1].attend_decodes([0, 1, 2], 1, starts, q, k, v)
    monkeypatch.setattr(A, "worker", lambda: None)
    alone = filled_pair(starts)[1].attend_decodes([0, 1, 2], 1, starts, q, k, v)
    assert np.array_equal(with_worker, alone)  # the same pairs, the same arithmetic, whichever thread


def test_bad_calls_are_refused_as_chapter_3_refuses_them():
    """A position past the slot, or a sequence without one, gets chapter 3's error (from chapter 3's loop)."""
    for store in filled_pair([4, 6]):
        q = np.zeros((CONFIG.n_head, 2, CONFIG.head_dim), dtype=np.float32)
        with pytest.raises(CacheCapacityError, match="past its slot"):
            store.attend_decodes([0, 1], 0, [4, 40], q, q, q)
        with pytest.raises(KeyError):
            store.attend_decodes([0, "unknown"], 0, [4, 6], q, q, q)


@pytest.mark.parametrize("numba_here", [True, False])
def test_without_numba_or_float32_the_store_is_chapter_3s(monkeypatch, numba_here):
    """No numba (the kernels extra), or K/V kept in float16: chapter 3's loop, its exact numbers."""
    monkeypatch.setattr(A, "numba_available", lambda: numba_here)
    H, D = CONFIG.n_head, CONFIG.head_dim
    q, k, v = (np.random.default_rng(3).standard_normal((H, 2, D), dtype=np.float32) for _ in range(3))
    dtype = np.float32 if not numba_here else np.float16
    stores = [ContiguousKVStore(CONFIG, 2, 16, dtype=dtype), A.SlotAttentionKVStore(CONFIG, 2, 16, dtype=dtype)]
    for store in stores:
        store.allocate("a", 8), store.allocate("b", 3)
    monkeypatch.setattr(A, "slot_attention_kernel", lambda: pytest.fail("the kernel ran"))
    outs = [s.attend_decodes(["a", "b"], 0, [7, 2], q, k, v) for s in stores]
    assert np.array_equal(outs[0], outs[1])


def test_the_step_hands_every_decoding_token_of_a_layer_to_the_store_in_one_call():
    """Chapter 3's step: one ``attend_decodes`` per layer with every one-token chunk (rows, ids, starts in the
    step's order), prefill chunks through ``update``."""
    calls = []

    class Counting(ContiguousKVStore):
        def attend_decodes(self, seq_ids, layer, starts, q, k, v):
            calls.append((layer, list(seq_ids), list(starts), q.shape))
            return super().attend_decodes(seq_ids, layer, starts, q, k, v)

    model = tiny_model(config=CONFIG)
    store = Counting(CONFIG, 3, 32)
    for seq, n in (("p", 6), ("d1", 9), ("d2", 4)):
        store.allocate(seq, n)
    chunks = [Chunk("d1", np.array([1]), 8), Chunk("p", np.arange(6), 0), Chunk("d2", np.array([2]), 3)]
    ragged_forward(model, store, chunks)
    assert calls == [(layer, ["d1", "d2"], [8, 3], (CONFIG.n_head, 2, CONFIG.head_dim))
                     for layer in range(CONFIG.n_layer)]


@needs_numba
def test_an_engine_on_the_slot_store_gives_chapter_3s_tokens():
    """Greedy requests of mixed lengths (prefills beside decodes, sequences leaving and arriving) on an accelerated
    model: the same tokens in chapter 3's store and in the appendix's."""
    model = accelerate(tiny_model(config=CONFIG))
    rng = np.random.default_rng(4)
    requests = [Request(f"r{i}", rng.integers(0, CONFIG.vocab_size, int(n)).tolist(), max_new_tokens=int(m),
                        stop_at_eos=False) for i, (n, m) in enumerate(zip(rng.integers(1, 20, 9),
                                                                            rng.integers(1, 20, 9)))]
    tokens = []
    for cls in (ContiguousKVStore, A.SlotAttentionKVStore):
        engine = LLMEngine(model, store=cls(CONFIG, num_slots=4, max_len=CONFIG.n_positions), max_num_seqs=4)
        tokens.append({o.request_id: o.output_token_ids for o in engine.generate_many(requests)})
    assert tokens[0] == tokens[1] and all(len(t) == r.max_new_tokens for t, r in zip(tokens[0].values(), requests))


def test_is_accelerated_tells_an_accelerated_model():
    model = tiny_model(config=CONFIG)
    assert not is_accelerated(model) and is_accelerated(accelerate(model))


@needs_numba
def test_making_the_store_compiles_the_kernel_so_no_step_pays_for_it(monkeypatch):
    monkeypatch.setattr(A, "_kernel", None)
    A.SlotAttentionKVStore(CONFIG, 2, 8)
    assert A._kernel is not None and A._kernel.signatures  # compiled for its one signature, before any step
