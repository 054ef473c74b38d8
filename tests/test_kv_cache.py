"""Chapter 2: the KV cache gives chapter 1's tokens and logits, and refuses to overflow."""

import numpy as np
import pytest
from helpers import TINY, reference_dirs, tiny_model

import gpt2_core
from gpt2_core import CheckpointError, InvalidInputError, PRESETS
from gpt2_core import kv_cache as kv
from gpt2_core.errors import CacheCapacityError


def models():
    return [("tiny", tiny_model())] + [(d.name, gpt2_core.load_model(d)) for d in reference_dirs()] + [
        ("embedded", gpt2_core.load_model())]


def assert_close_logits(ours, ref, what=""):
    """Within 1e-5 of chapter 1, relative to the step's largest logit (and never looser than 1e-5 absolute).

    A [1, E] matmul and a [T, E] one sum in different orders (BLAS picks other kernels), so the hidden states differ
    by ~3e-6 and logits of size 5..15 by 1e-5..2e-5: float32 rounding (7 significant digits), not a bug. A wrong
    cache position or a stale K/V changes logits by order 1.
    """
    scale = max(1.0, float(np.abs(ref).max()))
    worst = float(np.abs(ours - ref).max())
    assert worst <= 1e-5 * scale, f"{what}: max |cached - naive| = {worst:.2e} > 1e-5 x {scale:.1f}"


@pytest.mark.parametrize("name,model", models(), ids=lambda x: x if isinstance(x, str) else "")
def test_logits_at_every_step_equal_chapter_1(name, model):
    rng = np.random.default_rng(1)
    n_ctx = model.config.n_positions
    ids = rng.integers(0, model.config.vocab_size, size=min(n_ctx, 80)).tolist()
    prompt = 5
    logits, cache = kv.prefill(model, ids[:prompt], capacity=len(ids))
    assert_close_logits(logits, gpt2_core.forward(model, ids[:prompt]), "prefill")
    for t in range(prompt, len(ids)):
        step = kv.decode_step(model, ids[t], cache)
        assert_close_logits(step, gpt2_core.forward(model, ids[: t + 1])[-1], f"step {t}")
    assert cache.length == len(ids)


@pytest.mark.parametrize("name,model", models(), ids=lambda x: x if isinstance(x, str) else "")
def test_greedy_tokens_equal_chapter_1_for_64_steps(name, model):
    n = min(64, model.config.n_positions - 3)
    prompt = [1, 2, 3]
    assert kv.generate(model, prompt, n, stop_at_eos=False) == gpt2_core.generate(model, prompt, n, stop_at_eos=False)


def test_sampling_with_a_seed_gives_chapter_1_tokens():
    model = gpt2_core.load_model()
    prompt = model.tokenizer.encode("It is a truth universally acknowledged")
    for seed in range(3):
        kw = dict(temperature=0.9, top_k=40, top_p=0.95, seed=seed)
        assert kv.generate(model, prompt, 40, **kw) == gpt2_core.generate(model, prompt, 40, **kw)


def test_cache_is_preallocated_and_its_bytes_match_the_formula():
    model = tiny_model()
    logits, cache = kv.prefill(model, [1, 2, 3], capacity=10)
    assert cache.k.shape == (TINY.n_layer, TINY.n_head, 10, TINY.head_dim)
    assert cache.nbytes == kv.kv_cache_bytes(TINY, 10, np.float32)
    assert kv.kv_cache_bytes(PRESETS["gpt2"], 1024, np.float32) == 2 * 12 * 768 * 1024 * 4


def test_the_7b_answer_is_one_gib_per_2048_token_sequence():
    rows = {r["model"]: r for r in kv.kv_cache_table(2048, np.float16)}
    seven_b = rows["7B (32 layers, hidden 4096)"]
    assert seven_b["bytes"] == 2**30
    assert seven_b["bytes_per_token"] == 2 * 32 * 4096 * 2  # 512 KiB per token
    assert rows["gpt2"]["bytes"] == 2 * 12 * 768 * 2048 * 2
    # a real cache of the 7B shape would hold exactly that many bytes: check the formula against nbytes
    small = kv.KVCache(kv.SEVEN_B, capacity=16, dtype=np.float16)
    assert small.nbytes == kv.kv_cache_bytes(kv.SEVEN_B, 16, np.float16)


def test_capacity_and_context_overflow_are_clear_errors_that_leave_the_cache_intact():
    model = tiny_model()
    _, cache = kv.prefill(model, [1, 2, 3], capacity=4)
    kv.decode_step(model, 4, cache)
    k_before = cache.k.copy()
    with pytest.raises(CacheCapacityError, match="KV cache full: 4 cached \\+ 1 new tokens exceeds its capacity of 4"):
        kv.decode_step(model, 5, cache)
    assert cache.length == 4 and np.array_equal(cache.k, k_before)
    with pytest.raises(InvalidInputError, match="capacity 17 exceeds the context n_ctx=16"):
        kv.prefill(model, [1], capacity=17)
    _, cache = kv.prefill(model, list(range(16)))
    with pytest.raises(CacheCapacityError, match="position 16 is past the context n_ctx=16"):
        kv.decode_step(model, 1, cache)
    with pytest.raises(InvalidInputError, match="out of range"):
        kv.decode_step(model, 500, kv.prefill(model, [1], capacity=3)[1])


def test_generate_validates_like_chapter_1():
    model = tiny_model()
    for kwargs in ({"temperature": -1}, {"top_p": 2}, {"top_k": -5}):
        with pytest.raises(InvalidInputError):
            kv.generate(model, [1], 3, **kwargs)
    with pytest.raises(InvalidInputError, match="needs 17 positions, more than the context n_ctx=16"):
        kv.generate(model, list(range(10)), 8)
    full = kv.generate(model, list(range(10)), 7, stop_at_eos=False)  # 16 positions: the cache fills exactly
    assert full == gpt2_core.generate(model, list(range(10)), 7, stop_at_eos=False)
    assert kv.generate(model, [1], 0) == []
    assert not isinstance(CheckpointError("x"), InvalidInputError)


def test_the_layouts_bench_layout_compares_compute_the_same_logits():
    """``bench layout`` compares whole steps with the checkpoint's row-major output projections and column-major
    ones: accelerated copies with the same values that leave the model itself untouched."""
    from gpt2_core.a1_cpu_kernels import accelerate, array_of

    model = tiny_model()
    row = accelerate(model, tiled=False, column_major=False)
    col = accelerate(model, tiled=False, column_major=True)
    for b, r, c in zip(model.params["h"], row.params["h"], col.params["h"]):
        for module in ("attn", "mlp"):
            assert array_of(r[module]["c_proj"]["weight"]).flags.c_contiguous, module
            assert np.isfortran(array_of(c[module]["c_proj"]["weight"])), module
            assert b[module]["c_proj"]["weight"].flags.c_contiguous, module  # the original keeps its layout
            np.testing.assert_array_equal(array_of(c[module]["c_proj"]["weight"]), b[module]["c_proj"]["weight"])
    ids = [1, 2, 3, 4, 5]
    np.testing.assert_allclose(gpt2_core.forward(row, ids), gpt2_core.forward(model, ids), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gpt2_core.forward(col, ids), gpt2_core.forward(model, ids), rtol=1e-5, atol=1e-5)


def test_bench_layout_times_decode_steps_and_prefills_both_ways():
    """Each record names its layout; decode steps per batch size, prefills per prompt length, and one ratio each."""
    from gpt2_core import GPT2Config
    from gpt2_core.bench.layout import bench_layout

    config = GPT2Config(vocab_size=50, n_positions=128, n_embd=32, n_head=2, n_layer=2)
    out = bench_layout(quick=True, context=8, shape=config)
    steps = [(r["method"], r["batch"]) for r in out["results"] if "phase" not in r]
    prefills = [(r["method"], r["prompt_len"]) for r in out["results"] if r.get("phase") == "prefill"]
    layouts = ["row_major", "column_major_projections"]
    assert steps == [(m, b) for b in (1, 4, 32) for m in layouts]
    assert prefills == [(m, n) for n in (16, 64) for m in layouts]
    assert set(out["ratios"]) == {f"column_major_speed_over_row_major_{k}"
                                  for k in ("batch_1", "batch_4", "batch_32", "prefill_16", "prefill_64")}
    assert all(r["tokens_per_s"] > 0 for r in out["results"]) and all(v > 0 for v in out["ratios"].values())


def test_the_gemv_chain_reads_every_weight_matrix_of_a_decode_step_once():
    """The chain is the step's matrix products alone: its weights are all of a step's weight bytes but the biases
    and layer-norm vectors, each matrix once, each in the memory order the step reads it."""
    from gpt2_core.bench.kv_cache import decode_gemvs, gemv_chain_seconds, weight_bytes_per_token
    from gpt2_core.a1_cpu_kernels import accelerate, array_of

    model = accelerate(tiny_model())  # the benchmarks' model
    gemvs = decode_gemvs(model)
    c = model.config
    assert len(gemvs) == 4 * c.n_layer + 1 and len({id(w) for _, w in gemvs}) == len(gemvs)
    vectors = sum(a.nbytes for a in model.state_dict().values() if a.ndim == 1)
    assert sum(w.nbytes for _, w in gemvs) == weight_bytes_per_token(model) - vectors
    first = model.params["h"][0]
    assert gemvs[1][1] is array_of(first["attn"]["c_proj"]["weight"]) and np.isfortran(gemvs[3][1])  # its order
    assert gemvs[-1][1] is model.params["wte"].T.array
    assert all(v.shape == (1, w.shape[0]) for v, w in gemvs)
    assert gemv_chain_seconds(model, repeats=1) > 0


def test_profile_inside_real_steps_times_every_part_and_puts_chapter_1_back(monkeypatch):
    import time

    from gpt2_core import GPT2Config, random_model; from gpt2_core.ch01_forward import model as model_module
    from gpt2_core.bench import kv_cache as bench

    config = GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_head=2, n_layer=2)
    m = random_model(config, seed=0)
    profile = bench.profile_decode_in_step(m, position=20, steps=3)
    assert list(profile) == ["c_attn (E x 3E)", "attn c_proj (E x E)", "mlp c_fc (E x 4E)", "mlp c_proj (4E x E)",
                             "attention over the cache", "layer norms + GELU", "lm head (E x V)", "everything else"]
    assert all(ms > 0 for ms in profile.values()), profile  # every part ran and was timed
    assert kv.linear is model_module.linear and kv.attention is model_module.attention
    assert kv.layer_norm is model_module.layer_norm and kv.lm_head is model_module.lm_head

    # each part's time excludes the timed parts it calls: the blocks' layer norms made 5 ms slower here
    def slow_layer_norm(*args, **kwargs):
        time.sleep(0.005)
        return model_module.layer_norm(*args, **kwargs)
    monkeypatch.setattr(kv, "layer_norm", slow_layer_norm)
    profile = bench.profile_decode_in_step(m, position=20, steps=3)
    assert profile["layer norms + GELU"] >= 5 * 2 * config.n_layer  # ms: 2 per block
    assert profile["lm head (E x V)"] < 2 and profile["everything else"] < 2, profile  # none of it counted twice

    def broken(*args):
        raise RuntimeError("a step that fails")
    monkeypatch.setattr(kv, "decode_step", broken)
    with pytest.raises(RuntimeError, match="a step that fails"):
        bench.profile_decode_in_step(m, position=20, steps=3)
    assert kv.layer_norm is slow_layer_norm and kv.linear is model_module.linear  # put back all the same
    assert model_module.gelu.__name__ == "gelu"
    for bad in ({"position": 0}, {"position": 64}, {"steps": 0}, {"steps": 2.0}):
        with pytest.raises(ValueError, match=f"profile_decode_in_step: {next(iter(bad))} must be"):
            bench.profile_decode_in_step(m, **{"position": 20, "steps": 3, **bad})
    with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
        bench.gemv_chain_by_kind(m, repeats=0)


class _Tagged(np.ndarray):
    """A matrix that logs its tag into ``reads`` each time a NumPy operation (``x @ W``) reads it or its ``.T``."""

    def __array_finalize__(self, obj):
        self.tag, self.reads = getattr(obj, "tag", None), getattr(obj, "reads", None)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        for a in inputs:
            if isinstance(a, _Tagged):
                a.reads.append(a.tag)
        return getattr(ufunc, method)(*(np.asarray(a) for a in inputs), **kwargs)


def test_gemv_bandwidth_reads_distinct_matrices_in_turn_and_times_only_after_a_round(monkeypatch):
    from gpt2_core.bench import kv_cache as bench

    # the matrices: separate buffers, every page written (none left mapped to the shared page of zeros)
    made = bench.bound_matrices((16, 64), 3)
    assert [a.shape for a in made] == [(16, 64)] * 3 and all(a.dtype == np.float32 and np.all(a != 0) for a in made)
    assert not any(np.shares_memory(a, b) for i, a in enumerate(made) for b in made[i + 1:])

    reads, timed = [], []
    clock = iter(range(10**6))
    real_matrices = bench.bound_matrices

    def tagged_matrices(shape, copies):
        out = []
        for i, a in enumerate(real_matrices(shape, copies)):
            t = a.view(_Tagged)
            t.tag, t.reads = i, reads
            out.append(t)
        return out

    def ticking_clock():  # each call one second later; records which product each reading follows
        timed.append(len(reads))
        return float(next(clock))
    monkeypatch.setattr(bench, "bound_matrices", tagged_matrices)
    monkeypatch.setattr(bench.time, "perf_counter", ticking_clock)
    for transposed in (False, True):
        reads.clear()
        timed.clear()
        rate = bench.gemv_bandwidth(rows=16, cols=64, repeats=4, transposed=transposed, copies=3)
        assert reads == [0, 1, 2, 0, 1, 2, 0]  # one untimed round, then each matrix in turn: never the same twice
        # the clock is read before every product, and after the 4 timed ones only (products so far, at each reading)
        assert timed == [0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 7]
        assert rate == 16 * 64 * 4 / 1.0  # every product "took" one tick of the fake clock
    reads.clear()
    bench.gemv_bandwidth(rows=16, cols=64, repeats=2, copies=1)
    assert reads == [0, 0, 0]  # warm: the same matrix every time
    monkeypatch.undo()
    for bad in ({"copies": 0}, {"repeats": 0}, {"rows": 0}, {"cols": 2.5}):
        with pytest.raises(ValueError, match=f"gemv_bandwidth: {next(iter(bad))} must be an integer"):
            bench.gemv_bandwidth(**{"rows": 16, "cols": 64, **bad})
    assert bench.gemv_bandwidth(rows=16, cols=64, repeats=2) > 0  # and for real


def test_gemv_cache_effect_alternates_cold_and_warm_and_reports_their_medians(monkeypatch):
    from gpt2_core.bench import kv_cache as bench

    calls = []

    def fake_bandwidth(rows, cols, repeats, copies):
        calls.append(copies)
        return {bench.COLD_COPIES: 10.0, 1: 12.0}[copies] + len(calls)  # warm reads faster; both drift upwards
    monkeypatch.setattr(bench, "gemv_bandwidth", fake_bandwidth)
    effect = bench.gemv_cache_effect(rounds=3, repeats=2, rows=16, cols=64)
    assert calls == [3, 1, 1, 3, 3, 1]  # cold first in even rounds, warm first in odd ones
    assert effect["per_round"] == {"cold": [11.0, 14.0, 15.0], "warm": [14.0, 15.0, 18.0]}
    assert (effect["cold_bytes_per_s"], effect["warm_bytes_per_s"]) == (14.0, 15.0)
    assert effect["warm_over_cold"] == pytest.approx(15.0 / 14.0)
    with pytest.raises(ValueError, match="gemv_cache_effect: rounds must be an integer"):
        bench.gemv_cache_effect(rounds=0)
