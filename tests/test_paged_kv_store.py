"""Chapter 4: the paged KV store.

* It holds exactly what chapter 3's contiguous store holds: the same K/V, the same logits (within 1e-5; in
  practice bit for bit, the gathered arrays hold the very same float32 numbers) through ``ragged_forward``.
* Under chapter 3's unchanged engine and scheduler it gives every request the greedy tokens it gets with the
  contiguous store and alone with chapter 2's ``kv_cache.generate`` — also when the pool is so small that
  sequences are preempted and recomputed.
* Property tests: random allocate / append / fork / free / preempt operations on a store that really writes K/V
  never corrupt a sequence's data (which is what handing one block to two sequences would do), never leak a block,
  and end with the whole pool free; random workloads on random small pools always finish with the right tokens.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT, run_counted_state_machine, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpt2_core import GPT2Config, kv_cache
from gpt2_core.ch04_paged.block_manager import blocks_needed
from gpt2_core.ch03_batching.engine import LLMEngine
from gpt2_core.errors import CacheCapacityError, InvalidInputError
from gpt2_core.ch01_forward.generation import positions_needed
from gpt2_core.ch03_batching.kv_store import ContiguousKVStore
from gpt2_core.ch03_batching.model_runner import Chunk, ragged_forward
from gpt2_core.ch04_paged.paged_kv_store import PagedKVStore, slot_indices
from gpt2_core.ch03_batching.sequence import FinishReason, Request
from gpt2_core.ch03_batching.static_batching import static_generate
from gpt2_core.loading.weights import random_model

MODEL = tiny_model()
CFG = MODEL.config
SMALL = GPT2Config(vocab_size=11, n_positions=64, n_embd=8, n_head=2, n_layer=2)  # for store-only tests

# ----------------------------------------------------------------------------------------------------------------
# The store on its own


def resident_bytes() -> int:
    """This process's resident memory (Linux: /proc/self/statm, in pages)."""
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


STORE_IN_A_FRESH_PROCESS = """
import os, sys
from gpt2_core import GPT2Config
from gpt2_core.ch03_batching.kv_store import ContiguousKVStore
from gpt2_core.ch04_paged.paged_kv_store import PagedKVStore

def resident_bytes():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

config = GPT2Config(vocab_size=11, n_positions=1024, n_embd=256, n_head=4, n_layer=4)  # 8 KiB per token
before = resident_bytes()
if sys.argv[1] == "contiguous":
    store = ContiguousKVStore(config, num_slots=8, max_len=1024)
    arrays = [store.k, store.v]
else:
    store = PagedKVStore(config, num_blocks=512, block_size=16)
    arrays = [store.kv]
print(store.nbytes, resident_bytes() - before, any(a.any() for a in arrays))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from Linux's /proc")
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_a_store_takes_its_memory_when_built_not_on_first_use(kind):
    """Built in a fresh process: in this one, memory freed by earlier tests may be reused without growing it."""
    out = subprocess.run([sys.executable, "-c", STORE_IN_A_FRESH_PROCESS, kind], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    nbytes, grown, nonzero = int(out[0]), int(out[1]), out[2] == "True"
    assert nbytes == 64 * 2**20
    assert grown >= 0.9 * nbytes, f"built a {nbytes:,}-byte store, resident memory grew {grown:,} bytes"
    assert not nonzero  # and it holds zeros, like np.zeros


@pytest.mark.parametrize("make,names", [
    (lambda m: ContiguousKVStore(m.config, num_slots=8, max_len=1024), ["contiguous KV store of 8 slots",
                                                                          "max_len=1024"]),
    (lambda m: PagedKVStore(m.config, num_blocks=512, block_size=16), ["paged KV pool of 512 blocks", "num_blocks"]),
    (lambda m: LLMEngine(m, max_num_seqs=8), ["8 slots x max_len=1024", "max_num_seqs"]),  # its default store
    (lambda m: static_generate(m, [[1, 2]] * 8, 1022), ["static batch's KV cache of 8 rows x 1024 columns"])],
    ids=["contiguous", "paged", "engine-default-store", "static-batch"])
def test_a_store_larger_than_the_memory_available_is_refused_before_it_is_written(make, names, monkeypatch):
    import gpt2_core.ch03_batching.kv_store

    monkeypatch.setattr(gpt2_core.ch03_batching.kv_store, "available_memory_bytes", lambda: 48 * 2**20)  # 48 MiB left
    model = random_model(GPT2Config(vocab_size=11, n_positions=1024, n_embd=256, n_head=4, n_layer=4))
    before = resident_bytes()
    with pytest.raises(CacheCapacityError) as error:
        make(model)  # each store would be 64 MiB
    message = str(error.value)
    assert "needs 64.0 MiB, but only 48.0 MiB of memory is available" in message, message
    assert all(name in message for name in names), message
    assert resident_bytes() - before < 8 * 2**20  # refused before writing (the 64 MiB were never touched)


def test_available_memory_is_the_smaller_of_the_system_and_the_container_limit(tmp_path):
    from gpt2_core.loading.memory import available_memory_bytes

    def write(path, text):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)

    assert available_memory_bytes(str(tmp_path)) is None  # the system says nothing
    write("proc/meminfo", "MemTotal:  4000 kB\nMemFree:  1000 kB\nMemAvailable:  3000 kB\n")
    assert available_memory_bytes(str(tmp_path)) == 3000 * 1024
    write("sys/fs/cgroup/memory.max", "max\n")  # cgroup v2 without a limit
    write("sys/fs/cgroup/memory.current", "999999\n")
    assert available_memory_bytes(str(tmp_path)) == 3000 * 1024
    write("sys/fs/cgroup/memory.max", "2097152\n")  # a 2 MiB container with 1.5 MiB in use
    write("sys/fs/cgroup/memory.current", "1572864\n")
    assert available_memory_bytes(str(tmp_path)) == 524288
    write("sys/fs/cgroup/memory/memory.limit_in_bytes", "1048576\n")  # cgroup v1, fuller still
    write("sys/fs/cgroup/memory/memory.usage_in_bytes", "1048576\n")
    assert available_memory_bytes(str(tmp_path)) == 0


def test_available_memory_is_read_from_the_system():
    from gpt2_core.loading.memory import available_memory_bytes

    available = available_memory_bytes()
    if os.path.exists("/proc/meminfo"):
        assert isinstance(available, int) and available > 0
    else:
        assert available is None  # then stores are built unchecked


def test_slot_indices_map_positions_through_the_block_table():
    np.testing.assert_array_equal(slot_indices([3, 0, 5], 10, 4), [12, 13, 14, 15, 0, 1, 2, 3, 20, 21])
    assert slot_indices([], 0, 16).shape == (0,)


def test_from_budget_fills_the_budget_with_whole_blocks():
    per_token = kv_cache.kv_cache_bytes(CFG, 1)
    store = PagedKVStore.from_budget(CFG, budget_bytes=10 * 4 * per_token + 123, block_size=4)
    assert store.num_blocks == 10 and store.capacity_tokens() == 40
    assert store.nbytes == kv_cache.kv_cache_bytes(CFG, 40) <= 10 * 4 * per_token + 123
    with pytest.raises(InvalidInputError, match="holds no block"):
        PagedKVStore.from_budget(CFG, budget_bytes=4 * per_token - 1, block_size=4)


def test_usage_counts_whole_blocks_like_vllms_kv_cache_usage():
    store = PagedKVStore(CFG, num_blocks=4, block_size=4)
    assert store.usage() == 0.0
    store.allocate("a", 5)  # 2 blocks
    assert store.reserved_tokens() == 8 and store.usage() == 0.5 and store.live_tokens() == 5
    store.free("a")
    assert store.usage() == 0.0 and store.max_tokens_per_seq() == 16


def test_update_scatters_then_gathers_in_position_order():
    rng = np.random.default_rng(0)
    store = PagedKVStore(SMALL, num_blocks=8, block_size=4)
    H, D = SMALL.n_head, SMALL.head_dim
    store.allocate("a", 3)
    store.allocate("b", 6)  # interleaved so that a's blocks are not adjacent
    store.ensure("a", 10)
    k, v = rng.standard_normal((2, H, 10, D), dtype=np.float32)
    k1, v1 = store.update("a", 1, 0, k[:, :7], v[:, :7])  # a prefill of 7 ...
    np.testing.assert_array_equal(k1, k[:, :7])
    np.testing.assert_array_equal(v1, v[:, :7])
    k2, v2 = store.update("a", 1, 7, k[:, 7:], v[:, 7:])  # ... then 3 more
    assert k2.shape == (H, 10, D)
    np.testing.assert_array_equal(k2, k)
    np.testing.assert_array_equal(v2, v)
    assert store.block_table("a") != list(range(store.block_table("a")[0], store.block_table("a")[0] + 3))
    np.testing.assert_array_equal(store.read("a", 1)[0], k)


def test_update_past_the_reserved_room_is_an_error():
    store = PagedKVStore(SMALL, num_blocks=8, block_size=4)
    store.allocate("a", 4)
    x = np.zeros((SMALL.n_head, 5, SMALL.head_dim), np.float32)
    with pytest.raises(CacheCapacityError, match="call ensure first"):
        store.update("a", 0, 0, x, x)
    with pytest.raises(CacheCapacityError, match="n_ctx"):
        store.ensure("a", SMALL.n_positions + 1)
    assert not store.can_allocate(SMALL.n_positions + 1) and not store.can_ensure("a", SMALL.n_positions + 1)
    with pytest.raises(InvalidInputError):
        store.free("nobody")


def test_fork_copies_on_write_so_parent_and_child_never_see_each_others_tokens():
    rng = np.random.default_rng(1)
    store = PagedKVStore(SMALL, num_blocks=8, block_size=4)
    H, D = SMALL.n_head, SMALL.head_dim
    store.allocate("p", 6)
    prefix = rng.standard_normal((2, H, 6, D), dtype=np.float32)
    for layer in range(SMALL.n_layer):
        store.update("p", layer, 0, prefix[0], prefix[1])
    store.fork("p", "c")
    assert store.block_table("c") == store.block_table("p")
    new_p, new_c = rng.standard_normal((2, 2, H, 1, D), dtype=np.float32)
    for seq, new in (("p", new_p), ("c", new_c)):
        store.ensure(seq, 7)
        for layer in range(SMALL.n_layer):
            store.update(seq, layer, 6, new[0], new[1])
    assert store.block_table("c")[0] == store.block_table("p")[0]  # the full prefix block is still shared
    assert store.block_table("c")[1] != store.block_table("p")[1]  # the written one was copied
    for seq, new in (("p", new_p), ("c", new_c)):
        for layer in range(SMALL.n_layer):
            k, v = store.read(seq, layer)
            np.testing.assert_array_equal(k, np.concatenate([prefix[0], new[0]], axis=1))
            np.testing.assert_array_equal(v, np.concatenate([prefix[1], new[1]], axis=1))
    store.free("p")
    store.free("c")
    assert store.manager.num_free_blocks == 8
    store.check_invariants()


# ----------------------------------------------------------------------------------------------------------------
# Paged == contiguous through chapter 3's model step


def run_steps(store, prompts, steps):
    """Prefill ``prompts`` together, then decode greedily ``steps`` times; newest prompt joins one step late."""
    first, last = prompts[:-1], prompts[-1]
    for i, p in enumerate(first):
        store.allocate(i, len(p))
    logits = [ragged_forward(MODEL, store, [Chunk(i, np.asarray(p), 0) for i, p in enumerate(first)])]
    seqs = [list(p) + [int(np.argmax(r))] for p, r in zip(first, logits[0])]
    j = len(first)
    store.allocate(j, len(last))
    chunks = [Chunk(i, np.array(s[-1:]), len(s) - 1) for i, s in enumerate(seqs)] + [Chunk(j, np.asarray(last), 0)]
    for i, s in enumerate(seqs):
        store.ensure(i, len(s))
    seqs.append(list(last))
    for _ in range(steps):
        out = ragged_forward(MODEL, store, chunks)
        logits.append(out)
        for s, r in zip(seqs, out):
            s.append(int(np.argmax(r)))
        for i, s in enumerate(seqs):
            store.ensure(i, len(s))
        chunks = [Chunk(i, np.array(s[-1:]), len(s) - 1) for i, s in enumerate(seqs)]
    return logits, seqs


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_paged_logits_equal_the_contiguous_store(block_size):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, CFG.vocab_size, size=n).tolist() for n in (5, 1, 7, 3)]
    steps = 6
    contiguous_store = ContiguousKVStore(CFG, num_slots=4, max_len=CFG.n_positions)
    contiguous, c_tokens = run_steps(contiguous_store, prompts, steps)
    paged_store = PagedKVStore(CFG, num_blocks=64, block_size=block_size)
    paged, p_tokens = run_steps(paged_store, prompts, steps)
    assert p_tokens == c_tokens
    for a, b in zip(paged, contiguous):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    for i, s in enumerate(p_tokens):  # the stored K/V: layer 0's are the very same numbers (they depend on no
        n, slot = len(s) - 1, contiguous_store.slot_of[i]  # attention); later layers' within float32 rounding
        for layer in range(CFG.n_layer):
            k, v = paged_store.read(i, layer, n)
            check = np.testing.assert_array_equal if layer == 0 else (
                lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0))
            check(k, contiguous_store.k[slot, layer, :, :n])
            check(v, contiguous_store.v[slot, layer, :, :n])


# ----------------------------------------------------------------------------------------------------------------
# Chapter 3's engine, unchanged, over the paged store


def requests(n, seed=0, max_prompt=7, max_new=8, logits_log=None):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(0, CFG.vocab_size, size=int(rng.integers(1, max_prompt + 1))).tolist()
        proc = None
        if logits_log is not None:
            logits_log[i] = []
            proc = (lambda log: (lambda ids, logits: log.append(np.array(logits)) or logits))(logits_log[i])
        out.append(Request(i, prompt, max_new_tokens=int(rng.integers(1, max_new + 1)), stop_at_eos=False,
                           logits_processor=proc))
    return out


def alone(r):
    return kv_cache.generate(MODEL, r.prompt_token_ids, r.max_new_tokens, stop_at_eos=False)


def test_engine_tokens_and_logits_paged_equal_contiguous_equal_alone_with_preemptions():
    log_c, log_p = {}, {}
    contiguous = LLMEngine(MODEL, max_num_seqs=8).generate_many(requests(12, logits_log=log_c))
    store = PagedKVStore(CFG, num_blocks=5, block_size=4)  # 20 token positions for 12 requests of up to 15
    engine = LLMEngine(MODEL, store=store, max_num_seqs=8)
    paged = engine.generate_many(requests(12, logits_log=log_p))
    assert engine.scheduler.num_preemptions > 0  # the pool really ran out, and sequences were recomputed
    assert sum(o.metrics.num_preemptions for o in paged) == engine.scheduler.num_preemptions
    for r, c, p in zip(requests(12), contiguous, paged):
        assert p.finish_reason is FinishReason.LENGTH
        assert p.output_token_ids == c.output_token_ids == alone(r)
        assert len(log_p[r.request_id]) == len(log_c[r.request_id]) == r.max_new_tokens
        for a, b in zip(log_p[r.request_id], log_c[r.request_id]):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert store.manager.num_free_blocks == store.num_blocks and store.slots == {}
    store.check_invariants()


def test_engine_reports_kv_usage_and_higher_utilisation_than_contiguous_slots():
    reqs = requests(6, seed=3)
    c_engine = LLMEngine(MODEL, max_num_seqs=6)
    c_engine.generate_many(reqs)
    p_engine = LLMEngine(MODEL, store=PagedKVStore(CFG, num_blocks=24, block_size=2), max_num_seqs=6)
    p_engine.generate_many(requests(6, seed=3))

    def utilisation(engine):
        s = [st for st in engine.step_stats if st.kv_reserved_tokens]
        return sum(x.kv_used_tokens for x in s) / sum(x.kv_reserved_tokens for x in s)

    assert utilisation(p_engine) > 0.8 > utilisation(c_engine)
    assert all(st.kv_used_tokens <= st.kv_reserved_tokens for st in p_engine.step_stats)


def test_a_request_larger_than_the_whole_pool_is_rejected_and_the_rest_run():
    store = PagedKVStore(CFG, num_blocks=2, block_size=4)  # 8 token positions in all
    engine = LLMEngine(MODEL, store=store, max_num_seqs=4)
    ok = Request("ok", [1, 2, 3], max_new_tokens=4, stop_at_eos=False)
    big = Request("big", [1, 2, 3, 4, 5], max_new_tokens=5, stop_at_eos=False)  # 5 + 5 - 1 = 9 > 8: never fits
    out = {o.request_id: o for o in engine.generate_many([big, ok])}
    assert out["big"].finish_reason is FinishReason.ERROR and "could never fit" in out["big"].error
    assert out["ok"].output_token_ids == alone(ok)
    assert store.manager.num_free_blocks == 2


@settings(max_examples=25, derandomize=True, deadline=None, database=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(4, 12), block_size=st.sampled_from([1, 2, 4, 8]),
       max_num_seqs=st.integers(1, 6), n=st.integers(1, 8))
def test_random_workloads_on_small_pools_always_finish_with_the_tokens_of_running_alone(
        seed, num_blocks, block_size, max_num_seqs, n):
    store = PagedKVStore(CFG, num_blocks=num_blocks, block_size=block_size)
    engine = LLMEngine(MODEL, store=store, max_num_seqs=max_num_seqs)
    reqs = requests(n, seed=seed)
    outputs = engine.generate_many(reqs)
    for r, o in zip(reqs, outputs):
        if positions_needed(len(r.prompt_token_ids), r.max_new_tokens) > store.max_tokens_per_seq():
            assert o.finish_reason is FinishReason.ERROR  # refused at admission, never deadlocks
        else:
            assert o.output_token_ids == alone(r), (r, o)
    assert not engine.has_unfinished()
    assert store.manager.num_free_blocks == num_blocks
    store.check_invariants()


# ----------------------------------------------------------------------------------------------------------------
# Property test on the store with real K/V: no block is ever handed to two sequences by accident


class PagedStoreMachine(RuleBasedStateMachine):
    """Every sequence writes K/V values unique to (sequence, position); a block shared by accident would let one
    sequence overwrite another's, and the check after every operation would see it."""

    operations = 0

    @initialize(num_blocks=st.integers(1, 16), block_size=st.sampled_from([1, 2, 4, 5]))
    def setup(self, num_blocks, block_size):
        self.store = PagedKVStore(SMALL, num_blocks=num_blocks, block_size=block_size)
        self.data = {}  # seq -> K values [H, n, D] of layer 0 it must read back (V = -K)
        self.preempted = []  # data of preempted sequences, recomputed (rewritten) on readmission
        self.next_id = 0
        self.stamp = 0

    def _values(self, n):
        H, D = SMALL.n_head, SMALL.head_dim
        self.stamp += 1
        return (self.stamp * 1000 + np.arange(n, dtype=np.float32))[None, :, None] * np.ones((H, 1, D), np.float32)

    def _write(self, seq, start, k):
        for layer in range(SMALL.n_layer):
            self.store.update(seq, layer, start, k + layer, -(k + layer))

    def _admit(self, k):
        seq, self.next_id = self.next_id, self.next_id + 1
        n = k.shape[1]
        if not self.store.can_allocate(n):
            with pytest.raises(CacheCapacityError):
                self.store.allocate(seq, n)
            return False
        self.store.allocate(seq, n)
        self._write(seq, 0, k)
        self.data[seq] = k
        return True

    @rule(n=st.integers(1, 20))
    def admit(self, n):
        type(self).operations += 1
        self._admit(self._values(n))

    @precondition(lambda self: self.data)
    @rule(data=st.data(), grow=st.integers(1, 6))
    def append(self, data, grow):
        type(self).operations += 1
        seq = data.draw(st.sampled_from(sorted(self.data)))
        n = self.data[seq].shape[1]
        if n + grow > SMALL.n_positions or not self.store.can_ensure(seq, n + grow):
            return
        self.store.ensure(seq, n + grow)
        new = self._values(grow)
        self._write(seq, n, new)
        self.data[seq] = np.concatenate([self.data[seq], new], axis=1)

    @precondition(lambda self: self.data)
    @rule(data=st.data())
    def fork(self, data):
        type(self).operations += 1
        parent = data.draw(st.sampled_from(sorted(self.data)))
        self.store.fork(parent, self.next_id)
        self.data[self.next_id] = self.data[parent]
        self.next_id += 1

    @precondition(lambda self: self.data)
    @rule(data=st.data())
    def finish(self, data):
        type(self).operations += 1
        seq = data.draw(st.sampled_from(sorted(self.data)))
        self.store.free(seq)
        del self.data[seq]

    @precondition(lambda self: self.data)
    @rule()
    def preempt_newest(self):
        type(self).operations += 1
        seq = max(self.data)
        self.store.free(seq)
        self.preempted.append(self.data.pop(seq))

    @precondition(lambda self: self.preempted)
    @rule()
    def readmit(self):
        type(self).operations += 1
        if self._admit(self.preempted[-1]):
            self.preempted.pop()

    @invariant()
    def every_sequence_reads_back_its_own_kv(self):
        for seq, k in self.data.items():
            for layer in range(SMALL.n_layer):
                got_k, got_v = self.store.read(seq, layer)
                np.testing.assert_array_equal(got_k, k + layer)
                np.testing.assert_array_equal(got_v, -(k + layer))
        self.store.check_invariants()
        used = self.store.manager.num_used_blocks()
        assert used <= sum(blocks_needed(k.shape[1], self.store.block_size) for k in self.data.values())

    def teardown(self):
        for seq in list(self.data):
            self.store.free(seq)
        assert self.store.manager.num_free_blocks == self.store.num_blocks
        assert self.store.reserved_tokens() == 0 and self.store.slots == {}
        self.store.check_invariants()


def test_random_store_operations_keep_every_sequences_kv_intact():
    run_counted_state_machine(PagedStoreMachine, max_examples=60, steps=60, min_operations=2_000)


# ----------------------------------------------------------------------------------------------------------------
# The benchmark's records (the timed runs themselves are a command, not a test)


def test_bench_records_have_the_shape_of_the_other_benches():
    from gpt2_core.bench.paged import block_size_sweep, contiguous_store, for_model, narrow_model, run
    from gpt2_core.bench.workload import standard_workload

    small = narrow_model()
    reqs = for_model(standard_workload(num_requests=6), small)
    budget = kv_cache.kv_cache_bytes(small.config, 2 * 512)
    c = run(small, contiguous_store(small.config, budget), reqs, max_num_seqs=2)
    p = run(small, PagedKVStore.from_budget(small.config, budget, 16), reqs, max_num_seqs=64, series=True)
    for r in (c, p):
        for key in ("method", "batch", "tokens_per_s", "max_concurrent", "kv_utilisation", "budget_bytes"):
            assert key in r, key
        assert r["budget_bytes"] == budget and r["num_errors"] == 0
    assert (c["method"], p["method"]) == ("contiguous", "paged")
    assert c["output_tokens"] == p["output_tokens"] == sum(r.max_new_tokens for r in reqs)
    assert p["max_concurrent"] > c["max_concurrent"] == 2 and p["kv_utilisation"] > 0.9 > c["kv_utilisation"]
    assert len(p["series"]["used_tokens"]) == p["num_steps"]
    rows = block_size_sweep(reqs, small.config, budget_tokens=1024, block_sizes=(1, 16, 256))
    assert rows[0]["internal_fragmentation"] == 0.0 < rows[1]["internal_fragmentation"] < rows[2]["internal_fragmentation"]


def test_a_fork_shares_only_what_the_parent_has_written():
    """The parent has room for 6 tokens but has written 4: the child shares those 4; the room for positions 4-5
    stays the parent's, so each one's next token is its own."""
    store = PagedKVStore(CFG, num_blocks=8, block_size=4)
    H, D = CFG.n_head, CFG.head_dim

    def kv(value, T=1):
        return np.full((H, T, D), value, np.float32)
    store.allocate("p", 6)
    store.update("p", 0, 0, kv(1, 4), kv(1, 4))
    store.fork("p", "c")
    assert store.block_table("c") == store.block_table("p")[:1]
    store.ensure("p", 6)
    store.update("p", 0, 4, kv(7), kv(7))
    store.ensure("c", 6)
    store.update("c", 0, 4, kv(9), kv(9))
    assert store.read("p", 0, 5)[0][0, :, 0].tolist() == [1, 1, 1, 1, 7]
    assert store.read("c", 0, 5)[0][0, :, 0].tolist() == [1, 1, 1, 1, 9]
    store.update("p", 0, 5, kv(8), kv(8))  # position 5 lies in a block of the parent's own
    assert store.read("c", 0, 5)[1][0, :, 0].tolist() == [1, 1, 1, 1, 9]
    store.check_invariants()
    store.free("p")
    store.free("c")
    assert store.manager.num_free_blocks == 8
    with pytest.raises(InvalidInputError, match="num_tokens must be an integer in \\[0, 0\\]"):
        m = store.manager
        m.allocate("x", 0)
        m.fork("x", "y", 3)
