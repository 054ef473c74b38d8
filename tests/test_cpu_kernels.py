"""The appendix's opt-in kernels (``gpt2_core.a1_cpu_kernels``): every chapter runs unchanged on an accelerated model
and gives the same tokens, and every kernel computes ``x @ W`` (to float32 rounding) for every row count."""

import numpy as np
import pytest
from helpers import reference_dirs, tiny_model

import gpt2_core
from gpt2_core import kv_cache
from gpt2_core.a1_cpu_kernels import FastWeight, accelerate, array_of, plain
from gpt2_core.a1_cpu_kernels import fast_model, small_batch, tiles as tiles_module
from gpt2_core.ch03_batching.engine import LLMEngine
from gpt2_core.ch03_batching.kv_store import ContiguousKVStore
from gpt2_core.ch01_forward.model import linear
from gpt2_core.ch03_batching.model_runner import Chunk, ragged_forward
from gpt2_core.ch03_batching.sequence import Request

MODEL = tiny_model()


def models():
    return [("tiny", tiny_model())] + [(d.name, gpt2_core.load_model(d)) for d in reference_dirs()[:1]]


# ----------------------------------------------------------------------------------------------------------------
# The seam: accelerate(model)


@pytest.mark.parametrize("name,model", models(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_chapter_runs_unchanged_on_an_accelerated_model(name, model):
    """Chapter 1's forward within float32 rounding, chapter 2's and chapter 3's greedy tokens identical."""
    fast = accelerate(model)
    ids = np.arange(1, 8) % model.config.vocab_size
    np.testing.assert_allclose(gpt2_core.forward(fast, ids), gpt2_core.forward(model, ids), rtol=1e-4, atol=1e-4)
    assert kv_cache.generate(fast, ids, 8, stop_at_eos=False) == kv_cache.generate(model, ids, 8, stop_at_eos=False)
    requests = [Request(i, ids[: 1 + 2 * i].tolist(), max_new_tokens=6, stop_at_eos=False) for i in range(4)]
    engine = LLMEngine(fast, max_num_seqs=4, max_len=14)
    outs = engine.generate_many([Request(r.request_id, r.prompt_token_ids, r.max_new_tokens, stop_at_eos=False)
                            for r in requests])
    for out, r in zip(outs, requests):
        assert out.output_token_ids == kv_cache.generate(model, r.prompt_token_ids, 6, stop_at_eos=False)


def test_accelerate_keeps_the_numbers_and_plain_gives_the_arrays_back():
    fast = accelerate(MODEL)
    for key, a in plain(fast).state_dict().items():
        assert type(a) is np.ndarray and np.array_equal(a, MODEL.state_dict()[key]), key
    block = fast.params["h"][0]
    assert np.isfortran(array_of(block["attn"]["c_proj"]["weight"]))  # the output projections column-major
    assert np.isfortran(array_of(block["mlp"]["c_proj"]["weight"]))
    assert array_of(block["attn"]["c_attn"]["weight"]).flags.c_contiguous
    head = fast.params["wte"].T  # the tied head, its own contiguous [E, V] copy
    assert isinstance(head, FastWeight) and head.array.flags.c_contiguous
    assert np.array_equal(head.array, MODEL.params["wte"].T)
    assert not np.isfortran(array_of(accelerate(MODEL, column_major=False).params["h"][0]["mlp"]["c_proj"]["weight"]))
    assert fast.nbytes() == MODEL.nbytes()  # the copies are the same weights
    again = accelerate(fast, tiled=False, gemv_max_rows=1)  # new settings, the same arrays
    w, w2 = fast.params["h"][0]["mlp"]["c_fc"]["weight"], again.params["h"][0]["mlp"]["c_fc"]["weight"]
    assert w2.array is w.array and (w2.tiled, w2.gemv_max_rows) == (False, 1) and w2._kept is w._kept


def test_chapter_9s_llama_runs_unchanged_on_an_accelerated_model():
    """Each block's seven matrices and the tied head in FastWeights; forward, greedy decoding and speculative
    verify passes (several rows: the tiles) as on the plain model; ``plain`` gives the arrays back."""
    from dataclasses import replace

    from gguf_helpers import TINY_LLAMA

    from gpt2_core.ch09_modern_model import model as llama
    from gpt2_core.ch10_speculative import speculative
    from gpt2_core.ch10_speculative.drafters import OracleDrafter
    from gpt2_core.loading.llama import random_llama

    model = random_llama(TINY_LLAMA)
    ids = np.arange(1, 9)
    want = kv_cache.generate(model, ids, 12, stop_at_eos=False)
    for tiled in (False, True):
        fast = accelerate(model, tiled=tiled)
        assert all(isinstance(fast.params["blk"][i][k], FastWeight) for i in range(TINY_LLAMA.n_layer)
                   for k in fast_model.LLAMA_MATRICES)
        assert isinstance(fast.params["token_embd"].T, FastWeight)
        np.testing.assert_allclose(llama.forward(fast, ids), llama.forward(model, ids), rtol=1e-4, atol=1e-4)
        assert kv_cache.generate(fast, ids, 12, stop_at_eos=False) == want
        drafter = OracleDrafter([ids.tolist() + want], 0.7, TINY_LLAMA.vocab_size, seed=0)
        assert speculative.generate(fast, ids, 12, stop_at_eos=False, drafter=drafter, k=4) == want
    for key, a in plain(fast).state_dict().items():
        assert type(a) is np.ndarray and np.array_equal(a, model.state_dict()[key]), key
    untied = random_llama(replace(TINY_LLAMA, tie_word_embeddings=False))  # a head of its own: accelerated too
    fast = accelerate(untied, tiled=True)
    assert isinstance(fast.params["output"].T, FastWeight)
    assert kv_cache.generate(fast, ids, 6, stop_at_eos=False) == kv_cache.generate(untied, ids, 6, stop_at_eos=False)


def test_accelerate_leaves_chapter_6s_quantized_weights_to_their_kernels():
    from gpt2_core.ch06_quantization.quantization import QuantizedWeight, quantize_model

    q = quantize_model(MODEL, "int8", embeddings=True)
    fast = accelerate(q)
    assert isinstance(fast.params["h"][0]["mlp"]["c_fc"]["weight"], QuantizedWeight)
    assert fast.params["wte"] is q.params["wte"]
    ids = np.arange(1, 8)
    assert kv_cache.generate(fast, ids, 6, stop_at_eos=False) == kv_cache.generate(q, ids, 6, stop_at_eos=False)


# ----------------------------------------------------------------------------------------------------------------
# Kernels


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("tiled", [True, False])
def test_a_fast_weight_gives_chapter_1_linear_for_every_row_count(order, tiled):
    """Row-major weights and column-major ones (the output projections) give chapter 1's numbers for every N:
    one GEMV, GEMVs per row, tiles, GEMMs padded (7, 13-15) and not."""
    rng = np.random.default_rng(0)
    w = np.asarray(rng.standard_normal((48, 80), dtype=np.float32), order=order)
    b = rng.standard_normal(80, dtype=np.float32)
    fw = FastWeight(w, tiled=tiled)
    for n in list(range(1, 2 * small_batch.ROW_TILE + 2)) + [tiles_module.TILED_MAX_ROWS + 3]:
        x = rng.standard_normal((n, 48), dtype=np.float32)
        y = linear(x, fw, b)  # chapter 1's x @ W + b, with W a FastWeight
        assert type(y) is np.ndarray and y.shape == (n, 80) and y.dtype == np.float32
        np.testing.assert_allclose(y, linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("order", ["C", "F"])
def test_tiled_matmul_is_the_product_for_every_row_count_and_a_partial_last_tile(order, monkeypatch):
    """``tile_weight`` + ``tiled_matmul`` give ``x @ w`` (to float32 rounding) on one thread and on two, with the
    rows in one product and in groups (the small-product limit made small here: 3 rows per product), and a
    ``FastWeight`` takes that path for 2 to ``TILED_MAX_ROWS`` rows only."""
    TILE = tiles_module.TILE
    monkeypatch.setattr(tiles_module, "SMALL_GEMM_MNK", 3 * 48 * TILE)
    monkeypatch.setattr(tiles_module, "TWO_THREADS_FROM_ROWS", 5)
    rng = np.random.default_rng(5)
    w = np.asarray(rng.standard_normal((48, 3 * TILE + 7), dtype=np.float32), order=order)
    tiles = tiles_module.tile_weight(w)
    assert tiles.shape == (4, 48, TILE) and tiles.flags.c_contiguous
    assert np.array_equal(tiles[3][:, 7:], np.zeros((48, TILE - 7), np.float32))  # the padding
    assert np.array_equal(np.concatenate(list(tiles), axis=1)[:, :w.shape[1]], w)  # the tiles side by side are w
    for n in (1, 2, 3, 4, 5, 9, 17):
        x = rng.standard_normal((n, 48), dtype=np.float32)
        y = tiles_module.tiled_matmul(x, tiles, w.shape[1])
        assert y.shape == (n, w.shape[1]) and y.dtype == np.float32
        np.testing.assert_allclose(y, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)
    seen = []
    real = fast_model.tiled_matmul
    monkeypatch.setattr(fast_model, "tiled_matmul", lambda x, t, n: seen.append(len(x)) or real(x, t, n))
    fw = FastWeight(w)
    big = tiles_module.TILED_MAX_ROWS
    for n in (1, 2, big, big + 1):
        x = rng.standard_normal((n, 48), dtype=np.float32)
        np.testing.assert_allclose(x @ fw, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)
    assert seen == [2, big]


def test_tiles_are_made_once_and_shared_with_configured_copies():
    w = MODEL.params["h"][0]["mlp"]["c_fc"]["weight"]
    fw = FastWeight(w)
    tiles = fw.tiles()
    assert fw.tiles() is tiles and np.array_equal(tiles, tiles_module.tile_weight(w))
    assert fw.configured(tiled=True, gemv_max_rows=1).tiles() is tiles


def test_without_memory_for_the_tiles_the_step_runs_without_them(monkeypatch):
    """Tiles are an optimisation: when the memory for them is not available, a weight keeps the answer None and
    the step gives the same logits through the untiled kernels."""
    store = ContiguousKVStore(MODEL.config, num_slots=3, max_len=8)
    for i in range(3):
        store.allocate(i, 4)
    chunks = [Chunk(i, np.array([i + 1, i + 2]), 0) for i in range(3)]
    monkeypatch.setattr(fast_model, "available_memory_bytes", lambda: 1000)  # less than any weight's tiles
    starved = accelerate(MODEL, tiled=True)
    without = ragged_forward(starved, store, chunks)
    assert starved.params["h"][0]["mlp"]["c_fc"]["weight"]._kept == {"tiles": None}
    monkeypatch.setattr(fast_model, "available_memory_bytes", lambda: None)  # the system does not say: tiles
    fed = accelerate(MODEL, tiled=True)
    with_tiles = ragged_forward(fed, store, chunks)
    assert fed.params["h"][0]["mlp"]["c_fc"]["weight"]._kept["tiles"] is not None
    np.testing.assert_allclose(with_tiles, without, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(without, ragged_forward(MODEL, store, chunks), rtol=1e-5, atol=1e-5)


def test_gemm_rows_pads_a_remainder_of_5_to_7_rows_to_the_next_tile():
    """Decode-sized batches only: a 1,253-row prefill is left alone (the sizes measured end at 33 rows)."""
    assert small_batch.ROW_TILE == 8 and small_batch.PAD_MAX_ROWS == 32
    assert {n: small_batch.gemm_rows(n) for n in range(1, 48) if small_batch.gemm_rows(n) != n} == {
        5: 8, 6: 8, 7: 8, 13: 16, 14: 16, 15: 16, 21: 24, 22: 24, 23: 24, 29: 32, 30: 32, 31: 32}
    assert small_batch.gemm_rows(1253) == 1253


def test_padded_rows_change_no_result_and_the_head_pads_too(monkeypatch):
    """A 13-row GEMM runs on 16 rows; the 13 rows that come back are the 13-row product to float32 rounding (BLAS
    may take leftover rows through another kernel, which sums in another order), for both memory orders and for
    the LM head."""
    seen = []
    gemm = small_batch.gemm
    monkeypatch.setattr(small_batch, "gemm", lambda x, w: seen.append(len(x)) or gemm(x, w))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((13, 48), dtype=np.float32)
    for order in "CF":
        w = np.asarray(rng.standard_normal((48, 80), dtype=np.float32), order=order)
        seen.clear()
        y = x @ FastWeight(w, tiled=False)
        assert seen == [16] and y.shape == (13, 80)  # BLAS got 16 rows, the caller gets 13
        np.testing.assert_allclose(y, gemm(x, w), rtol=1e-5, atol=1e-5)
    fast = accelerate(MODEL, tiled=False)
    h = rng.standard_normal((13, MODEL.config.n_embd), dtype=np.float32)
    seen.clear()
    logits = gpt2_core.ch01_forward.model.lm_head(fast.params, h, MODEL.config.layer_norm_epsilon)
    assert seen == [16] and logits.shape == (13, MODEL.config.vocab_size)
    np.testing.assert_allclose(logits, gpt2_core.ch01_forward.model.lm_head(MODEL.params, h, MODEL.config.layer_norm_epsilon),
                               rtol=1e-5, atol=1e-5)


def test_a_column_major_weight_goes_to_the_gemm_as_its_row_major_transpose():
    """Past ``GEMV_MAX_ROWS`` rows, a column-major W runs as ``(W.T @ x.T).T`` (the form this BLAS runs fastest):
    bit for bit that product, and the same numbers as ``x @ W`` up to the order of the sums."""
    rng = np.random.default_rng(0)
    w = np.asfortranarray(rng.standard_normal((96, 40), dtype=np.float32))
    x = rng.standard_normal((small_batch.GEMV_MAX_ROWS + 5, 96), dtype=np.float32)
    assert small_batch.gemm_rows(len(x)) == len(x)  # 11 rows are not padded: y below is the product itself
    y = x @ FastWeight(w, tiled=False)
    assert np.array_equal(y, (w.T @ x.T).T)
    assert np.isfortran(y)  # the transpose of a row-major [out, N] product: that form ran (x @ W gives row-major)
    np.testing.assert_allclose(y, x @ np.ascontiguousarray(w), rtol=1e-5, atol=1e-5)
    assert np.array_equal(x[:1] @ FastWeight(w), x[:1] @ w)  # one row: chapter 2's GEMV


@pytest.mark.parametrize("name,model", models(), ids=lambda x: x if isinstance(x, str) else "")
def test_decode_steps_of_every_batch_size_match_chapter_2(name, model, monkeypatch):
    """Batches of 1 .. GEMV_MAX_ROWS + 3 decoding sequences: the tiled path (one thread, then two, the rows in
    groups where the small-product limit is made small here), and without tiles the GEMV path, the GEMM path and
    the head's column blocks (made small, so that the vocabulary ends in a partial block) all give chapter 2's
    logits."""
    monkeypatch.setattr(tiles_module, "TWO_THREADS_FROM_ROWS", 4)
    monkeypatch.setattr(tiles_module, "SMALL_GEMM_MNK", 5 * model.config.n_embd * tiles_module.TILE)  # 5 rows
    monkeypatch.setattr(fast_model, "HEAD_BLOCK", 7)
    rng = np.random.default_rng(1)
    V = model.config.vocab_size
    before = {k: a.copy() for k, a in model.state_dict().items()}
    G = small_batch.GEMV_MAX_ROWS
    sizes = range(1, G + 4)
    for batch, gemv_max_rows, tiled in [(b, G, t) for t in (True, False) for b in sizes] \
            + [(3, 1, False), (8, 8, False)]:  # and each untiled path forced where it would take the other
        fast = accelerate(model, tiled=tiled, gemv_max_rows=gemv_max_rows)
        store = ContiguousKVStore(model.config, num_slots=batch, max_len=12)
        prompts = [rng.integers(0, V, size=int(rng.integers(1, 8))) for _ in range(batch)]
        caches = []
        for i, p in enumerate(prompts):
            store.allocate(i, len(p) + 1)
            ragged_forward(fast, store, [Chunk(i, p, 0)])
            caches.append(kv_cache.prefill(model, p, capacity=12, last_only=True)[1])
        tokens = rng.integers(0, V, size=batch)
        step = ragged_forward(fast, store, [Chunk(i, np.array([t]), len(p))
                                            for i, (p, t) in enumerate(zip(prompts, tokens))])
        assert step.shape == (batch, V)
        for row, t, cache in zip(step, tokens, caches):
            np.testing.assert_allclose(row, kv_cache.decode_step(model, int(t), cache), atol=1e-4)
    for key, a in model.state_dict().items():  # the kernels never touch a weight
        assert np.array_equal(a, before[key]), key


# ----------------------------------------------------------------------------------------------------------------
# The benchmarks' kernel comparisons


def test_gemm_row_padding_times_the_padded_and_the_unpadded_products(monkeypatch):
    from gpt2_core.bench import batching as bb

    rows = []
    gemm = small_batch.gemm
    monkeypatch.setattr(small_batch, "gemm", lambda x, w: rows.append(len(x)) or gemm(x, w))  # the padded arm's
    monkeypatch.setattr(bb, "gemm", lambda x, w: rows.append(len(x)) or gemm(x, w))  # the unpadded arm's
    fast = accelerate(MODEL)
    records = bb.gemm_row_padding(fast, rows=(7, 9), rounds=2)
    per_step = 4 * MODEL.config.n_layer + 1  # products per step: four per block and the head
    runs = 3  # per arm: a warm-up and a timed call in the first round, a timed call in the second
    assert rows.count(7) == rows.count(8) == runs * per_step  # 7 rows: as they are, and padded to 8
    assert rows.count(9) == 2 * runs * per_step and len(rows) == 4 * runs * per_step  # 9: both arms as they are
    assert [(r["rows"], r["gemm_rows"]) for r in records] == [(7, 8), (9, 9)]


def test_small_batch_comparison_runs_both_paths(monkeypatch):
    """The GEMM arm multiplies the head with one GEMM (``gemv_max_rows=1``), the GEMV arm one GEMV per row; both
    without tiles."""
    from gpt2_core.bench import batching as bb

    calls = []
    real = small_batch.small_batch_matmul
    head_shape = (MODEL.config.n_embd, MODEL.config.vocab_size)

    def spy(x, w, g=small_batch.GEMV_MAX_ROWS, block=None):
        if w.shape == head_shape:
            calls.append((len(x), "gemm" if len(x) > g else "gemv"))
        return real(x, w, g, block)
    monkeypatch.setattr(fast_model, "small_batch_matmul", spy)
    monkeypatch.setattr(fast_model, "tiled_matmul", lambda *a: pytest.fail("tiles used"))
    records = bb.small_batch_gemv_speedup(MODEL, batches=(2, 3), context=8, rounds=2)
    steps_per_arm = 2 * (1 + 3)  # rounds x (warm-up + repeats)
    assert sorted(calls) == sorted([(n, path) for n in (2, 3) for path in ("gemm", "gemv")] * steps_per_arm)
    assert [r["batch"] for r in records] == [2, 3] and all(r["package_path"] == "gemv" for r in records)
    for r in records:
        assert r["gemm_seconds_per_step"] > 0 and r["gemv_seconds_per_step"] > 0 and r["speedup"] > 0


def test_gemm_bound_times_the_kernel_the_step_uses(monkeypatch):
    from gpt2_core.bench import batching as bb

    timed = []  # (rows, column block, weight column-major?, tiled?) of each product the bound times
    real = FastWeight.__rmatmul__
    monkeypatch.setattr(FastWeight, "__rmatmul__", lambda self, x: (
        timed.append((len(x), self.block, np.isfortran(self.array),
                      self.tiled and tiles_module.uses_tiles(len(x)))), real(self, x))[1])
    monkeypatch.setattr(bb, "median_time", lambda fn, repeats=5, warmup=1: (fn(), 1e-3)[1])
    big = tiles_module.TILED_MAX_ROWS + 1
    tiled = {"tiled": True, "gemv_max_rows": small_batch.GEMV_MAX_ROWS}
    for m, head in ((3, True), (3, False), (1, True), (big, True)):
        bb.matmul_seconds(m, 8, 40, head=head, kernels=tiled)
    # 2 to TILED_MAX_ROWS rows from tiles, as the step; else the head in column blocks
    B = small_batch.HEAD_BLOCK
    assert timed == [(3, B, False, True), (3, None, False, True), (1, B, False, False), (big, B, False, False)]
    timed.clear()
    bound = bb.gemm_bound_tokens_per_s(accelerate(MODEL, tiled=True), batch=2, repeats=1)
    assert bound["seconds_per_step"] == pytest.approx((MODEL.config.n_layer * 4 + 1) * 1e-3)
    # each layer matrix in the model's own memory order: c_attn, attn.c_proj, c_fc, mlp.c_proj; then the head
    assert timed == [(2, None, False, True), (2, None, True, True), (2, None, False, True), (2, None, True, True),
                     (2, B, False, True)]
    # the bound times the kernels the model has: no tiles where accelerate() made none, no FastWeight for plain arrays
    timed.clear()
    bb.gemm_bound_tokens_per_s(accelerate(MODEL, tiled=False), batch=2, repeats=1)
    assert [t[3] for t in timed] == [False] * 5
    timed.clear()
    plain = bb.gemm_bound_tokens_per_s(MODEL, batch=2, repeats=1)
    assert timed == [] and plain["seconds_per_step"] == pytest.approx((MODEL.config.n_layer * 4 + 1) * 1e-3)


def test_warm_up_serves_every_numpy_strategy_and_builds_the_tiles(monkeypatch):
    from gpt2_core.bench import batching as bb
    from test_batching import record_calls

    fast = accelerate(tiny_model(), tiled=True)
    calls = record_calls(monkeypatch, bb, ("run_continuous", "replay_sequential", "replay_static", "replay_hf"))
    bb.warm_up(fast)
    assert calls == ["run_continuous", "replay_sequential", "replay_static"]  # torch is not loaded here
    weights = [layer["weight"] for p in fast.params["h"] for m in ("attn", "mlp") for layer in p[m].values()]
    assert all(w._kept.get("tiles") is not None for w in weights + [fast.params["wte"].T])  # all in tiles


def test_a_forked_child_starts_its_own_worker_thread():
    """After ``os.fork`` the parent's worker thread does not exist in the child: the child must not wait on it
    (a step of 9+ rows would hang), it starts its own."""
    import multiprocessing
    import os

    x = np.ones((tiles_module.TWO_THREADS_FROM_ROWS, 8), dtype=np.float32)
    w = np.ones((8, 4 * tiles_module.TILE), dtype=np.float32)
    tiles_module.tiled_matmul(x, tiles_module.tile_weight(w), w.shape[1])  # the parent's worker exists now
    if tiles_module.worker() is None:
        pytest.skip("one core: no worker thread to lose")
    child = multiprocessing.get_context("fork").Process(
        target=lambda: os._exit(0 if tiles_module.tiled_matmul(x, tiles_module.tile_weight(w), w.shape[1])[0, 0] == 8
                                else 1))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0


@pytest.mark.parametrize("architecture, tiled", [("SkylakeX", True), ("Haswell", False), (None, False)])
def test_accelerate_uses_tiles_only_where_blas_has_the_small_kernel(monkeypatch, architecture, tiled):
    """The tiles need OpenBLAS's small-matrix kernel (its AVX-512 family); elsewhere they lose (0.47-0.87x the
    untiled step in the stored batching run made on OpenBLAS's Haswell kernels), so ``accelerate`` leaves them off
    unless asked."""
    from gpt2_core.a1_cpu_kernels import tiles as tiles_module

    monkeypatch.setattr(tiles_module, "blas_architecture", lambda: architecture)
    assert accelerate(MODEL).params["h"][0]["mlp"]["c_fc"]["weight"].tiled is tiled
    assert accelerate(MODEL, tiled=True).params["h"][0]["mlp"]["c_fc"]["weight"].tiled is True
