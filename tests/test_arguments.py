"""A NumPy number is a number everywhere, and a bool never is.

Learners sweep parameters with NumPy: ``for b in np.arange(1, 9)`` gives ``np.int64`` and a float32 array gives
``np.float32`` (which, unlike ``np.float64``, is not a Python ``float``). Every public argument check goes through
``errors.is_integer`` / ``errors.is_real``, accepts both kinds and stores plain Python numbers, so the result is
the same as with ``int`` / ``float``; ``True`` (an ``int`` to Python) is refused with the parameter's name.
"""

import json

import numpy as np
import pytest
from helpers import TINY, tiny_model

from gpt2_core import kv_cache
from gpt2_core.ch04_paged.block_manager import BlockAllocator, BlockManager
from gpt2_core.loading.config import GPT2Config
from gpt2_core.bench.replay import replay
from gpt2_core.ch03_batching.engine import LLMEngine
from gpt2_core.errors import CheckpointError, InvalidInputError, is_integer, is_real
from gpt2_core.ch01_forward.generation import check_generation
from gpt2_core.ch03_batching.kv_store import ContiguousKVStore
from gpt2_core.bench.common import median_time
from gpt2_core.ch04_paged.paged_kv_store import PagedKVStore
from gpt2_core.ch01_forward.sampling import SamplingParams
from gpt2_core.ch03_batching.scheduler import Scheduler
from gpt2_core.ch03_batching.sequence import Request


def test_is_integer_takes_python_and_numpy_integers_in_range_and_nothing_else():
    for value in (3, np.int64(3), np.int32(3), np.uint8(3)):
        assert is_integer(value) and is_integer(value, 3, 3) and not is_integer(value, 4) and not is_integer(value, 0, 2)
    for value in (True, np.True_, 3.0, np.float32(3), "3", None, [3]):
        assert not is_integer(value), value
    assert is_integer(-5) and not is_integer(-5, 0)


def test_is_real_takes_finite_python_and_numpy_numbers_and_nothing_else():
    for value in (0, 0.5, np.float32(0.5), np.float64(0.5), np.float16(0.5), np.int64(2)):
        assert is_real(value), value
    for value in (True, np.True_, float("nan"), np.float32("inf"), -np.inf, 10**400, "0.5", None):
        assert not is_real(value), value


def test_sampling_params_accept_numpy_scalars_and_store_python_numbers():
    p = SamplingParams(temperature=np.float32(0.75), top_k=np.int64(5), top_p=np.float32(0.5), seed=np.uint32(7))
    assert p == SamplingParams(temperature=0.75, top_k=5, top_p=0.5, seed=7)  # 0.75 and 0.5 are exact in float32
    assert [type(v) for v in (p.temperature, p.top_k, p.top_p, p.seed)] == [float, int, float, int]
    for bad in ({"temperature": True}, {"top_k": True}, {"top_k": np.float32(5)}, {"top_p": np.float32(0)},
                {"top_p": np.float64("nan")}, {"seed": np.float64(1)}, {"seed": np.int64(-1)}):
        name = next(iter(bad))
        with pytest.raises(InvalidInputError, match=name):
            SamplingParams(**bad)


def test_numpy_sampling_params_give_the_same_tokens_as_python_ones():
    model = tiny_model()
    numpy_params = dict(temperature=np.float32(0.75), top_k=np.int64(20), top_p=np.float32(0.875), seed=np.int64(3))
    python_params = dict(temperature=0.75, top_k=20, top_p=0.875, seed=3)
    assert (kv_cache.generate(model, [1, 2, 3], np.int64(8), **numpy_params)
            == kv_cache.generate(model, [1, 2, 3], 8, **python_params))


def test_config_accepts_numpy_integers_and_stays_json():
    config = GPT2Config(vocab_size=np.int64(101), n_positions=np.int32(16), n_embd=np.int64(24), n_head=np.int64(3),
                        n_layer=np.int64(2), layer_norm_epsilon=np.float32(1e-5), eos_token_id=np.int64(100))
    assert config.n_layer == 2 and type(config.n_layer) is int and type(config.eos_token_id) is int
    assert type(config.layer_norm_epsilon) is float
    json.dumps(config.to_dict())  # np.int64 would not serialise
    with pytest.raises(CheckpointError, match="n_layer"):
        GPT2Config(n_layer=True)
    with pytest.raises(CheckpointError, match="eos_token_id"):
        GPT2Config(vocab_size=10, eos_token_id=np.int64(10))


def test_block_manager_and_allocator_accept_numpy_integers():
    allocator = BlockAllocator(np.int64(4))
    assert allocator.ref_count == [0, 0, 0, 0]  # a list: [0] * np.int64(4) would be the array [0]
    manager = BlockManager(np.int64(4), block_size=np.int32(2))
    assert type(manager.block_size) is int and type(manager.num_blocks) is int
    manager.allocate("a", np.int64(3))
    manager.fork("a", "b", np.int64(2))
    manager.ensure("b", np.int64(3))
    assert manager.block_tables["b"][0] == manager.block_tables["a"][0]
    assert all(type(n) is int for n in manager.num_tokens.values())
    for bad in (True, 2.0, -1):
        with pytest.raises(InvalidInputError, match="num_tokens"):
            manager.allocate("c", bad)
        with pytest.raises(InvalidInputError, match="num_tokens"):
            manager.ensure("a", bad)
    assert "c" not in manager.block_tables  # a refused call changes nothing
    for kwargs, name in (({"num_blocks": True}, "num_blocks"), ({"num_blocks": 4, "block_size": 2.0}, "block_size")):
        with pytest.raises(InvalidInputError, match=name):
            BlockManager(**kwargs)


def test_stores_caches_and_the_scheduler_check_their_counts():
    store = ContiguousKVStore(TINY, num_slots=np.int64(2), max_len=np.int64(8))
    assert store.capacity_tokens() == 16 and type(store.max_len) is int
    paged = PagedKVStore(TINY, num_blocks=np.int64(4), block_size=np.int64(4))
    assert type(paged.num_blocks) is int and type(paged.block_size) is int and paged.capacity_tokens() == 16
    json.dumps({"num_blocks": paged.num_blocks, "block_size": paged.block_size})  # benchmark records stay JSON
    with pytest.raises(InvalidInputError, match="block_size"):
        PagedKVStore(TINY, num_blocks=4, block_size=4.0)
    for kwargs, name in (({"num_slots": 2.5}, "num_slots"), ({"num_slots": 2, "max_len": 3.5}, "max_len"),
                         ({"num_slots": 2, "max_len": TINY.n_positions + 1}, "max_len"),
                         ({"num_slots": True}, "num_slots")):
        with pytest.raises(InvalidInputError, match=name):
            ContiguousKVStore(TINY, **kwargs)
    scheduler = Scheduler(store, max_num_seqs=np.int64(2), max_num_batched_tokens=np.int64(32))
    assert type(scheduler.max_num_seqs) is int and type(scheduler.max_num_batched_tokens) is int
    with pytest.raises(InvalidInputError, match="max_num_seqs"):
        Scheduler(store, max_num_seqs=2.0)
    assert type(kv_cache.KVCache(TINY, capacity=np.int64(8)).capacity) is int
    with pytest.raises(InvalidInputError, match="capacity"):
        kv_cache.KVCache(TINY, capacity=8.0)


def test_an_engine_built_and_fed_with_numpy_numbers_gives_the_tokens_of_python_numbers():
    model = tiny_model()

    def run(n, x):  # n: int or np.int64 wherever a count goes, x: float or np.float32 wherever a number goes
        engine = LLMEngine(model, max_num_seqs=n(2), max_num_batched_tokens=n(32), max_len=n(12))
        requests = [Request(i, [1 + i, 2, 3], max_new_tokens=n(5), stop_token_id=n(99), arrival_s=x(i),
                            sampling_params={"temperature": x(0.75), "seed": n(i)}) for i in range(3)]
        return [o.output_token_ids for o in replay(engine, requests, clock="steps")]

    assert run(np.int64, np.float32) == run(int, float)
    assert all(len(t) == 5 for t in run(int, float))


def test_generation_and_timing_counts_accept_numpy_integers_and_refuse_bools():
    model = tiny_model()
    assert check_generation(model, [1, 2], np.int64(3)) == [1, 2]
    with pytest.raises(InvalidInputError, match="max_new_tokens"):
        check_generation(model, [1, 2], True)
    assert median_time(lambda: None, repeats=np.int64(2), warmup=np.int64(0)) >= 0
    with pytest.raises(ValueError, match="repeats"):
        median_time(lambda: None, repeats=True)
