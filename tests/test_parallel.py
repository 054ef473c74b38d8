"""Chapter 8: tensor parallelism across worker processes (and the process group under it).

Exactness: the split model's logits equal chapter 1's and chapter 2's within 1e-5 of the logits' scale (the
all-reduce adds the same products in another order, so float32 rounding differs, a few 1e-7 relative per layer),
and greedy tokens are identical. Faults: a killed worker gives a WorkerError naming it, and leaves no process and
no shared-memory segment behind.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import tiny_model

import gpt2_core
from gpt2_core import GPT2Config, kv_cache
from gpt2_core.errors import InvalidInputError, WorkerError
from gpt2_core.ch01_forward.model import forward, linear
from gpt2_core.ch03_batching.kv_store import ContiguousKVStore
from gpt2_core.ch03_batching.model_runner import ragged_forward
from gpt2_core.ch03_batching.sequence import Request
from gpt2_core.ch05_sharing.caching_engine import CachingLLMEngine
from gpt2_core.ch05_sharing.prefix_cache import PrefixCachingKVStore
from gpt2_core.ch08_parallel.tp_runner import RowParallelWeight, TensorParallelRunner
from gpt2_core.ch08_parallel.process_group import SHM_PREFIX, flatten, unflatten
from gpt2_core.ch08_parallel.tensor_parallel import (BatchKVCache, SharedMemoryAllReduce, TensorParallelModel, no_communication,
                                       part, qkv_columns, row_parallel, shard_forward, shard_params)

# 4 heads (2 per worker), an odd vocabulary (the two workers' shares differ by one token), 2 layers
TP_TINY = GPT2Config(vocab_size=101, n_positions=32, n_embd=32, n_head=4, n_layer=2, eos_token_id=100)


def close_enough(got, want, tol=1e-5):
    scale = max(1.0, float(np.abs(want).max()))
    assert np.abs(got - want).max() <= tol * scale, (np.abs(got - want).max(), scale)


def existing(names) -> list[str]:
    """Which of these shared-memory segments still exist (Linux shows them as files in /dev/shm)."""
    return [n for n in names if (Path("/dev/shm") / n).exists()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "zombie" in status.read_text())


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, config=TP_TINY)


@pytest.fixture(scope="module")
def tp(model):
    with TensorParallelModel(model, world_size=2) as tp:
        yield tp


# --- the split itself, in one process ------------------------------------------------------------------------------

def test_parts_cover_everything_once():
    for n, world in ((101, 2), (7, 3), (8, 2)):
        covered = np.concatenate([np.arange(n)[part(n, r, world)] for r in range(world)])
        assert covered.tolist() == list(range(n))
    assert qkv_columns(8, 1, 2).tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]


def test_row_parallel_partials_sum_to_the_whole_product():
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s, dtype=np.float32) for s in ((5, 12), (12, 7), (7,)))
    partials = [x[:, part(12, r, 2)] @ w[part(12, r, 2)] for r in range(2)]
    total = partials[0] + partials[1]
    got = row_parallel(x[:, :6], w[:6], b, all_reduce=lambda p: total)
    np.testing.assert_allclose(got, x @ w + b, rtol=1e-5, atol=1e-5)


def test_two_threads_with_the_shared_memory_all_reduce_equal_the_whole_model(model):
    """The workers' code, run by two threads on shards, with the real all-reduce over a plain array."""
    ids = np.array([[5, 17, 3, 99, 42]])  # [B=1, T]
    ref = forward(model, ids[0])
    slots, barrier, out = np.zeros((2, 2, 16, 32), np.float32), threading.Barrier(2), [None, None]

    def worker(rank):
        shard, reduce = shard_params(model.params, rank, 2), SharedMemoryAllReduce(slots, rank, barrier)
        cache = BatchKVCache(2, 1, 2, 8, 8)
        x = model.params["wte"][ids[0]] + model.params["wpe"][:5]
        out[rank] = shard_forward(shard, x, 2, 1e-5, 1, cache, reduce)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    close_enough(np.concatenate(out, axis=1), ref)


def test_a_world_of_one_is_the_whole_model_batched(model):
    prompts = np.array([[5, 17, 3], [8, 8, 1]])
    shard = shard_params(model.params, 0, 1)
    cache = BatchKVCache(2, 2, 4, 4, 8)
    x = (model.params["wte"][prompts] + model.params["wpe"][:3]).reshape(6, -1)
    logits = shard_forward(shard, x, 4, 1e-5, 2, cache, no_communication)
    for b in range(2):
        close_enough(logits[3 * b:3 * b + 3], forward(model, prompts[b]))


def test_flatten_round_trips_the_nested_params(model):
    flat = flatten(model.params)
    assert "h.1.attn.c_attn.weight" in flat
    again = unflatten(flat)
    assert again["h"][1]["mlp"]["c_fc"]["bias"] is model.params["h"][1]["mlp"]["c_fc"]["bias"]


# --- two worker processes ------------------------------------------------------------------------------------------

def test_prefill_logits_equal_chapter_1(tp, model):
    ids = [5, 17, 3, 99, 42, 0, 7]
    close_enough(tp.prefill(ids), forward(model, ids))


def test_decode_with_each_worker_caching_its_heads_equals_chapter_2(tp, model):
    ids = [5, 17, 3, 99]
    logits, cache = kv_cache.prefill(model, ids, capacity=10)
    close_enough(tp.prefill(ids, capacity=10), logits)
    for token in (11, 64, 2):
        close_enough(tp.decode_step(token), kv_cache.decode_step(model, token, cache))


def test_greedy_tokens_are_identical(tp, model):
    for prompt in ([1, 2, 3], [100, 50, 25, 12, 6]):
        want = kv_cache.generate(model, prompt, 12, stop_at_eos=False)
        assert tp.generate(prompt, 12).tolist() == want


def test_a_batch_equals_each_sequence_alone(tp, model):
    prompts = np.array([[5, 17, 3], [9, 9, 9], [100, 0, 50]])
    together = tp.generate(prompts, 6)
    assert together.shape == (3, 6)
    for row, prompt in zip(together, prompts):
        assert row.tolist() == kv_cache.generate(model, prompt.tolist(), 6, stop_at_eos=False)


def test_bad_calls_fail_in_the_driver_and_leave_the_group_working(tp):
    with pytest.raises(InvalidInputError):
        tp.prefill([1, 2, 3], capacity=2)
    with pytest.raises(InvalidInputError):
        tp.prefill([1, 2, 1000])
    tp.prefill([1, 2], capacity=3)
    tp.decode_step(4)
    with pytest.raises(InvalidInputError):
        tp.prefill([1, 2], capacity=99)  # refused: the running sequence keeps its capacity of 3
    with pytest.raises(InvalidInputError, match="capacity"):
        tp.decode_step(5)
    with pytest.raises(InvalidInputError, match="max_logit_rows"):
        tp.prefill(np.ones((3, 30), dtype=np.int64))  # 90 rows of logits > 64
    tp.prefill(np.ones((3, 30), dtype=np.int64), last_only=True)  # 3 rows are fine
    with pytest.raises(InvalidInputError):
        TensorParallelModel(tiny_model(config=TP_TINY), world_size=3)
    assert tp.generate([1, 2], 3).shape == (3,)


def test_close_leaves_no_process_and_no_shared_memory(model):
    tp = TensorParallelModel(model)
    pids, names = tp.group.pids, tp.group.segment_names
    assert len(existing(names)) == 3 and all(n.startswith(SHM_PREFIX) for n in names)  # activations + 2 x weights
    tp.close()
    assert not any(alive(p) for p in pids)
    assert existing(names) == []
    with pytest.raises(WorkerError, match="closed"):
        tp.prefill([1, 2])


def test_a_killed_worker_is_named_and_leaves_nothing_behind(model):
    tp = TensorParallelModel(model)
    pids, names = tp.group.pids, tp.group.segment_names
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerError, match=rf"tensor-parallel worker 1 \(pid {pids[1]}\) died \(killed by signal SIGKILL\)"):
        tp.generate([1, 2, 3], 5)
    assert not any(alive(p) for p in pids)
    assert existing(names) == []


def test_a_worker_killed_mid_generation_stops_the_call_not_hangs_it(model):
    """Worker 0 dies while worker 1 waits for it at an all-reduce: the driver sees the death and stops worker 1."""
    tp = TensorParallelModel(model)
    pids, names = tp.group.pids, tp.group.segment_names
    timer = threading.Timer(0.5, os.kill, (pids[0], signal.SIGKILL))
    timer.start()
    t0 = time.perf_counter()
    with pytest.raises(WorkerError, match="worker 0"):
        for _ in range(10_000):
            tp.generate([1, 2, 3], 25)
    timer.join()
    assert time.perf_counter() - t0 < 30
    assert not any(alive(p) for p in pids)
    assert existing(names) == []


def test_an_exception_in_a_worker_comes_back_with_its_traceback(model):
    tp = TensorParallelModel(model)
    names = tp.group.segment_names
    with pytest.raises(WorkerError, match="(?s)worker [01] .* raised an exception.*AttributeError"):
        tp.group.call("no_such_method")
    assert tp.group.closed and existing(names) == []


def test_the_embedded_model_splits_exactly():
    model = gpt2_core.load_model()
    ids = model.tokenizer.encode("It is a truth universally acknowledged")
    with TensorParallelModel(model) as tp:
        close_enough(tp.prefill(ids), forward(model, ids))
        assert tp.generate(ids, 10).tolist() == kv_cache.generate(model, ids, 10, stop_at_eos=False)


# --- tensor parallelism under chapter 5's engine -------------------------------------------------------------------

def test_a_row_parallel_weight_all_reduces_inside_chapter_1s_linear():
    rng = np.random.default_rng(1)
    x, w, b = (rng.standard_normal(s, dtype=np.float32) for s in ((5, 12), (12, 7), (7,)))
    partials = [x[:, part(12, r, 2)] @ w[part(12, r, 2)] for r in range(2)]
    got = linear(x[:, :6], RowParallelWeight(w[:6], all_reduce=lambda p: partials[0] + partials[1]), b)
    np.testing.assert_allclose(got, x @ w + b, rtol=1e-5, atol=1e-5)


def engine_samples(model, store, requests, forward=ragged_forward):
    """Chapter 5's engine over ``store``, the requests arriving one per step (so prefills join running decodes);
    request 2 asks for 2 samples and request 5 for 3 (forks, copied on write). Every sample's tokens, and the engine."""
    engine = CachingLLMEngine(model, store, max_num_seqs=4, max_num_batched_tokens=12, forward=forward)
    for i, r in enumerate(requests):
        engine.add_request(r, n={2: 2, 5: 3}.get(i, 1))
        engine.step()
    engine.run_until_done()
    return [[o.output_token_ids for o in engine.samples(r.request_id)] for r in requests], engine


def test_chapter_5s_engine_with_a_tensor_parallel_step_gives_the_single_process_tokens(model):
    """Continuous batching, chunked prefill, prefix hits, forks and preemptions over a paged store, each step's
    forward split over two worker processes: the same greedy tokens as the one-process engine."""
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 100, 8).tolist()  # a prefix that odd requests share: prefix-cache hits
    requests = [Request(i, (shared if i % 2 else []) + rng.integers(0, 100, int(rng.integers(2, 12))).tolist(),
                        int(rng.integers(3, 9)), stop_at_eos=False) for i in range(8)]
    want, alone = engine_samples(model, PrefixCachingKVStore(model.config, num_blocks=10, block_size=4), requests)
    store = PrefixCachingKVStore(model.config, num_blocks=10, block_size=4)
    with TensorParallelRunner(model, store, world_size=2, max_rows=12, max_seqs=4) as tp:
        got, engine = engine_samples(model, store, requests, forward=tp)
    assert got == want
    assert store.manager.num_hit_tokens > 0 and store.manager.num_copied_blocks > 0  # shared and copied blocks
    assert any(s.num_prefill_seqs and s.num_decode_seqs for s in engine.step_stats)  # prompts beside decodes
    assert engine.scheduler.num_preemptions == alone.scheduler.num_preemptions > 0  # 10 blocks of 4: too few


def test_the_tensor_parallel_step_refuses_a_store_it_cannot_split(model):
    with pytest.raises(InvalidInputError, match="paged store"):
        TensorParallelRunner(model, ContiguousKVStore(model.config, num_slots=2))
    with pytest.raises(InvalidInputError, match="world_size"):
        TensorParallelRunner(model, PrefixCachingKVStore(model.config, num_blocks=4, block_size=4), world_size=3)


def test_no_segment_of_this_process_is_left_at_the_end(tp):
    """Every group above is gone; only the module's own (still open) group remains."""
    tp.close()
    assert sorted(Path("/dev/shm").glob(f"{SHM_PREFIX}{os.getpid()}_*")) == []


# --- the pipeline --------------------------------------------------------------------------------------------------

from gpt2_core.ch08_parallel.pipeline_parallel import PipelineModel, bubble_fraction, ideal_bubble, stage_params  # noqa: E402


def test_stages_hold_the_layers_once(model):
    first, last = stage_params(model.params, 0, 2), stage_params(model.params, 1, 2)
    assert [id(p) for p in first["h"] + last["h"]] == [id(p) for p in model.params["h"]]
    assert "wpe" in first and "ln_f" in last and "ln_f" not in first


def test_ideal_and_measured_bubble_on_a_drawn_timeline():
    assert [round(ideal_bubble(2, m), 4) for m in (1, 2, 4, 8)] == [0.5, 0.3333, 0.2, 0.1111]
    # two stages, 2 micro-batches, every task 1 s: stage 0 busy 0-2, stage 1 busy 1-3 -> idle 2 of 6 slots
    assert bubble_fraction([[(0, 1), (1, 2)], [(1, 2), (2, 3)]]) == pytest.approx(1 / 3)


def test_pipeline_tokens_and_logits_equal_chapter_2(model):
    prompts = np.array([[5, 17, 3, 9], [9, 9, 9, 1], [100, 0, 50, 2], [1, 2, 3, 4]])
    want = [kv_cache.generate(model, p.tolist(), 7, stop_at_eos=False) for p in prompts]
    with PipelineModel(model, max_batch=4, max_tokens=16, max_micro_batches=4) as pp:
        names = pp.group.segment_names
        for m in (1, 2, 4):
            assert pp.generate(prompts, 7, micro_batches=m).tolist() == want
            close_enough(pp.prefill_logits(4), np.stack([forward(model, p)[-1] for p in prompts]))
            stats = pp.last_stats
            assert len(stats[0]["busy"]) == len(stats[1]["busy"]) == 7 * m
        with pytest.raises(InvalidInputError):
            pp.generate(prompts, 3, micro_batches=3)  # 3 does not divide 4
    assert existing(names) == []


def test_a_killed_stage_is_named_and_leaves_nothing_behind(model):
    pp = PipelineModel(model, max_batch=2, max_tokens=16)
    pids, names = pp.group.pids, pp.group.segment_names
    timer = threading.Timer(0.3, os.kill, (pids[1], signal.SIGKILL))
    timer.start()
    with pytest.raises(WorkerError, match="pipeline worker 1"):
        for _ in range(10_000):
            pp.generate([[1, 2, 3], [4, 5, 6]], 12, micro_batches=2)
    timer.join()
    assert not any(alive(p) for p in pids) and existing(names) == []


def test_the_benchmark_arms_give_the_same_tokens_on_a_tiny_model(model):
    from gpt2_core.bench.parallel import pipeline, single_process, tensor_parallel

    prompts = np.array([[5, 17, 3], [9, 9, 9]])
    single = single_process(model, prompts, 4, threads=1)
    assert single["tokens"].tolist() == [kv_cache.generate(model, p.tolist(), 5, stop_at_eos=False) for p in prompts]
    with TensorParallelModel(model) as tp, PipelineModel(model, max_batch=2, max_tokens=16) as pp:
        tp_run, pp_run = tensor_parallel(tp, prompts, 4), pipeline(pp, prompts, 4, micro_batches=2)
    assert np.array_equal(tp_run["tokens"], single["tokens"]) and np.array_equal(pp_run["tokens"], single["tokens"])
    # per step, 2 workers x 2 layers x 2 all-reduces x [B=2, E=32] float32, and the logits [2, 101] written once
    assert tp_run["comm_bytes"] == 4 * (2 * 2 * 2 * 2 * 32 * 4 + 2 * 101 * 4)


def test_split_row_parallel_and_predicted_bubble():
    from gpt2_core.ch08_parallel.pipeline_parallel import predicted_bubble
    from gpt2_core.ch08_parallel.tensor_parallel import split_row_parallel

    rng = np.random.default_rng(1)
    x, w, b = (rng.standard_normal(s, dtype=np.float32) for s in ((4, 10), (10, 6), (6,)))
    for world in (1, 2, 3, 4):
        np.testing.assert_allclose(split_row_parallel(x, w, b, world), x @ w + b, rtol=1e-5, atol=1e-5)
    for m in (1, 2, 4, 8):
        assert predicted_bubble([2.0, 2.0], m) == pytest.approx(ideal_bubble(2, m))
    assert predicted_bubble([1.0, 3.0], 2) == pytest.approx(1 - 2 * 4 / (2 * (4 + 3)))



def test_gpipe_schedule_keeps_the_order_and_gives_the_predicted_bubble():
    from gpt2_core.ch08_parallel.pipeline_parallel import gpipe_schedule, predicted_bubble
    from gpt2_core.errors import InvalidInputError

    assert gpipe_schedule([1.0, 2.0], 2) == [[(0.0, 1.0), (1.0, 2.0)], [(1.0, 3.0), (3.0, 5.0)]]
    rng = np.random.default_rng(2)
    for _ in range(50):
        times, m = rng.uniform(0.1, 3.0, size=int(rng.integers(1, 5))).tolist(), int(rng.integers(1, 9))
        busy = gpipe_schedule(times, m)
        for s, stage in enumerate(busy):
            assert all(b - a == pytest.approx(times[s]) for a, b in stage)
            assert all(stage[i][1] <= stage[i + 1][0] + 1e-12 for i in range(m - 1))  # one at a time, in order
            if s:
                assert all(busy[s - 1][i][1] <= stage[i][0] + 1e-12 for i in range(m))  # after the stage before
        assert bubble_fraction(busy) == pytest.approx(predicted_bubble(times, m))
    with pytest.raises(InvalidInputError, match="micro_batches"):
        gpipe_schedule([1.0], 0)
    with pytest.raises(InvalidInputError, match="stage_seconds"):
        gpipe_schedule([], 2)

DRIVER = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from helpers import tiny_model
from gpt2_core import GPT2Config
from gpt2_core.ch08_parallel.tensor_parallel import TensorParallelModel
if __name__ == "__main__":
    tp = TensorParallelModel(tiny_model(config=GPT2Config(vocab_size=101, n_positions=32, n_embd=32, n_head=4,
                                                          n_layer=2, eos_token_id=100)))
    tp.generate([1, 2, 3], 4)
    print(" ".join(map(str, tp.group.pids)), " ".join(tp.group.segment_names), flush=True)
    if {how!r} == "killed":
        os.kill(os.getpid(), signal.SIGKILL)  # the driver dies without a word to anyone
    # "exits": leaves without close(); the group's finalizer runs at exit
"""


@pytest.mark.parametrize("how", ["exits", "killed"])
def test_a_driver_that_goes_away_leaves_no_worker_and_no_segment(tmp_path, how):
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(tests=str(Path(__file__).parent), how=how))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    out = r.stdout.split()
    pids, names = out[:2], out[2:]  # the two workers' pids, then the group's segment names
    assert len(pids) == 2 and len(names) == 3, (r.stdout, r.stderr)
    deadline = time.time() + 20  # killed: the workers see their pipe close; the resource tracker unlinks
    while time.time() < deadline and (any(alive(int(p)) for p in pids) or existing(names)):
        time.sleep(0.2)
    assert not any(alive(int(p)) for p in pids) and existing(names) == []


def test_an_all_reduce_alone_is_timed_by_both_workers(model):
    with TensorParallelModel(model) as fresh:
        seconds = fresh.group.call("all_reduce_alone", 4, 20)
    assert len(seconds) == 2 and all(0 < s < 1 for s in seconds)
