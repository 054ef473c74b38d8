"""Chapter 3: batched == one by one. Static batching and continuous batching give every request the tokens (and,
to float32 rounding, the logits) it gets alone with chapter 2; failures stay with the request that caused them."""

import json
import time

import numpy as np
import pytest
from helpers import TINY, reference_dirs, tiny_model

import gpt2_core
from gpt2_core import kv_cache
from gpt2_core.bench.replay import replay
from gpt2_core.ch03_batching.engine import LLMEngine
from gpt2_core.errors import CacheCapacityError, InvalidInputError
from gpt2_core.ch03_batching.kv_store import ContiguousKVStore
from gpt2_core.ch03_batching.model_runner import Chunk, ragged_forward, ragged_layout
from gpt2_core.ch01_forward.sampling import SamplingParams
from gpt2_core.ch03_batching.sequence import FinishReason, Request
from gpt2_core.ch03_batching.static_batching import left_pad, left_padding_attention_mask, position_ids, static_generate
from gpt2_core.bench import workload as wl

MODEL = tiny_model()


def random_requests(model, n, seed=0, max_prompt=7, max_new=7, **kw):
    rng = np.random.default_rng(seed)
    return [Request(i, rng.integers(0, model.config.vocab_size, size=int(rng.integers(1, max_prompt + 1))).tolist(),
                    max_new_tokens=int(rng.integers(1, max_new + 1)), stop_at_eos=False, **kw) for i in range(n)]


def alone(model, r, **params):
    return kv_cache.generate(model, r.prompt_token_ids, r.max_new_tokens, stop_at_eos=r.stop_at_eos, **params)


def models():
    return [("tiny", tiny_model())] + [(d.name, gpt2_core.load_model(d)) for d in reference_dirs()[:1]]


# ----------------------------------------------------------------------------------------------------------------
# The ragged model step


def test_ragged_layout_puts_the_chunks_one_after_another():
    """A prefill of 3 at position 0, a decode at position 12, a chunk of 2 at position 4: rows 0-2, 3, 4-5."""
    rows = ragged_layout([Chunk("a", np.array([5, 6, 7]), 0), Chunk("b", np.array([9]), 12),
                          Chunk("c", np.array([1, 2]), 4)])
    assert rows.token_ids.tolist() == [5, 6, 7, 9, 1, 2] and rows.token_ids.dtype == np.int64
    assert rows.positions.tolist() == [0, 1, 2, 12, 4, 5] and rows.positions.dtype == np.int64
    assert rows.spans == [(0, 3), (3, 4), (4, 6)] and all(type(i) is int for s in rows.spans for i in s)
    assert rows.last_rows.tolist() == [2, 3, 5] and rows.last_rows.dtype == np.int64


@pytest.mark.parametrize("name,model", models(), ids=lambda x: x if isinstance(x, str) else "")
def test_ragged_step_logits_match_chapter_2_within_1e_4(name, model):
    rng = np.random.default_rng(0)
    V = model.config.vocab_size
    store = ContiguousKVStore(model.config, num_slots=4, max_len=16)
    prompts = [rng.integers(0, V, size=n) for n in (5, 1, 9)]
    for i, p in enumerate(prompts):
        store.allocate(i, len(p))
    logits = ragged_forward(model, store, [Chunk(i, p, 0) for i, p in enumerate(prompts)])  # three prefills
    assert logits.dtype == np.float32 and logits.shape == (3, V)
    caches = []
    for p, row in zip(prompts, logits):
        ref, cache = kv_cache.prefill(model, p, capacity=16, last_only=True)
        np.testing.assert_allclose(row, ref[0], atol=1e-4)
        caches.append(cache)
    tokens = [int(np.argmax(r)) for r in logits]
    extra = rng.integers(0, V, size=4)  # a fourth sequence joins with its prompt while the three decode
    store.allocate(3, 4)
    chunks = [Chunk(i, np.array([t]), len(p)) for i, (p, t) in enumerate(zip(prompts, tokens))] + [Chunk(3, extra, 0)]
    step = ragged_forward(model, store, chunks)
    for i, (t, cache) in enumerate(zip(tokens, caches)):
        np.testing.assert_allclose(step[i], kv_cache.decode_step(model, t, cache), atol=1e-4)
    np.testing.assert_allclose(step[3], kv_cache.prefill(model, extra, last_only=True)[0][0], atol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# Continuous batching


@pytest.mark.parametrize("name,model", models(), ids=lambda x: x if isinstance(x, str) else "")
def test_continuous_batching_greedy_equals_chapter_2_for_mixed_lengths_and_arrivals(name, model):
    for seed, max_num_seqs in [(0, 3), (1, 8)]:
        requests = random_requests(model, 10, seed=seed)
        rng = np.random.default_rng(seed)
        for r in requests:
            r.arrival_s = int(rng.integers(0, 10))  # in steps
        engine = LLMEngine(model, max_num_seqs=max_num_seqs, max_num_batched_tokens=24, max_len=16)
        outs = replay(engine, requests, clock="steps")
        for o in outs:
            r = requests[o.request_id]
            assert o.output_token_ids == alone(model, r), (seed, r.request_id)
            assert o.finish_reason is FinishReason.LENGTH
        assert engine.store.reserved_tokens() == 0
        assert max(s.num_seqs for s in engine.step_stats) <= max_num_seqs
        assert any(s.num_prefill_seqs and s.num_decode_seqs for s in engine.step_stats)  # shared steps happened


def test_seeded_sampling_is_independent_of_the_batch_composition():
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=42)
    probe = Request("probe", [5, 6, 7], max_new_tokens=10, sampling_params=params, stop_at_eos=False)
    reference = alone(MODEL, probe, temperature=0.9, top_k=20, top_p=0.9, seed=42)
    for seed, arrival in [(0, 0), (1, 3), (2, 6)]:
        others = random_requests(MODEL, 6, seed=seed, sampling_params={"temperature": 1.0, "seed": seed})
        probe_now = Request("probe", [5, 6, 7], max_new_tokens=10, sampling_params=params, stop_at_eos=False,
                            arrival_s=arrival)
        outs = replay(LLMEngine(MODEL, max_num_seqs=4, max_len=16), others + [probe_now], clock="steps")
        assert next(o for o in outs if o.request_id == "probe").output_token_ids == reference


def test_stop_token_eos_and_max_new_tokens_end_a_sequence():
    engine = LLMEngine(MODEL, max_num_seqs=4, max_len=16)
    free = alone(MODEL, Request(0, [1, 2, 3], max_new_tokens=12, stop_at_eos=False))
    stop_at = free[4]
    outs = engine.generate_many([Request("stop", [1, 2, 3], 12, stop_token_id=stop_at, stop_at_eos=False),
                                 Request("len", [1, 2, 3], 3, stop_at_eos=False),
                                 Request("zero", [1, 2, 3], 0)])
    assert outs[0].output_token_ids == free[:free.index(stop_at) + 1] and outs[0].finish_reason is FinishReason.STOP
    assert outs[1].output_token_ids == free[:3] and outs[1].finish_reason is FinishReason.LENGTH
    assert outs[2].output_token_ids == [] and outs[2].finish_reason is FinishReason.LENGTH
    eos_model = tiny_model(seed=3)
    ids = alone(eos_model, Request(0, [1], max_new_tokens=15, stop_at_eos=False))
    out = LLMEngine(eos_model, max_len=16).generate_many([Request("eos", [1], 15)])[0]
    expected = ids[:ids.index(TINY.eos_token_id) + 1] if TINY.eos_token_id in ids else ids
    assert out.output_token_ids == expected


def test_stream_and_callback_deliver_each_token_once_in_order():
    requests = random_requests(MODEL, 5, seed=4)
    engine = LLMEngine(MODEL, max_num_seqs=2, max_len=16)
    seen = {}
    for r in requests:
        engine.add_request(r, on_token=lambda seq, tok: seen.setdefault(seq.request_id, []).append(tok))
    streamed = list(engine.stream(3))  # steps the whole engine until request 3 is done
    assert streamed == alone(MODEL, requests[3])
    engine.run_until_done()
    for r in requests:
        assert seen[r.request_id] == alone(MODEL, r)
        assert engine.get_sequence(r.request_id).is_finished
    assert list(engine.stream(3)) == []  # already delivered


def test_a_raising_callback_fails_its_own_request_alone():
    """``on_token`` is the caller's code. When it raises (here in a step that also prefills another request), its
    request ends with an error, its slot is freed, and every other request still gets its chapter 2 tokens."""
    fails = Request("fails", [5, 6, 7], max_new_tokens=6, stop_at_eos=False)
    late = Request("late", [8, 9, 10, 11], max_new_tokens=5, stop_at_eos=False)
    first = Request("first", [1, 2], max_new_tokens=4, stop_at_eos=False)
    engine = LLMEngine(MODEL, max_num_seqs=3, max_len=16)
    received = {}

    def on_token(seq, token):
        received.setdefault(seq.request_id, []).append(token)
        if seq.request_id == "fails" and len(seq.output_token_ids) == 2:
            raise RuntimeError("consumer went away")
    engine.add_request(first, on_token=on_token)
    engine.add_request(fails, on_token=on_token)
    engine.step()  # both prefilled
    engine.add_request(late, on_token=on_token)
    engine.step()  # "late" is prefilled in the step in which "fails"'s callback raises
    assert engine.get_sequence("late").num_computed_tokens == 4  # its state was updated all the same
    engine.run_until_done()
    out = {o.request_id: o for o in engine.outputs()}
    assert out["fails"].finish_reason is FinishReason.ERROR
    assert "on_token raised RuntimeError: consumer went away" in out["fails"].error and "'fails'" in out["fails"].error
    assert received["fails"] == out["fails"].output_token_ids == alone(MODEL, fails)[:2]  # no call after the error
    for r in (first, late):
        assert out[r.request_id].finish_reason is FinishReason.LENGTH
        assert out[r.request_id].output_token_ids == received[r.request_id] == alone(MODEL, r)
    assert engine.store.reserved_tokens() == 0 and len(engine.store.free_slots) == 3


def test_a_request_needing_exactly_the_context_or_the_slot_runs():
    """The last sampled token is never fed back, so prompt + max_new_tokens - 1 positions suffice (chapter 2's
    ``positions_needed``): a request that needs exactly n_ctx positions, or exactly a slot, is served, not refused;
    one position more is refused."""
    n_ctx = MODEL.config.n_positions
    exact = Request("exact", list(range(1, n_ctx - 3)), max_new_tokens=5, stop_at_eos=False)  # n_ctx - 4 + 5 - 1
    over = Request("over", list(range(1, n_ctx - 3)), max_new_tokens=6, stop_at_eos=False)
    out = {o.request_id: o for o in LLMEngine(MODEL, max_num_seqs=2).generate_many([exact, over])}
    assert out["exact"].finish_reason is FinishReason.LENGTH
    assert out["exact"].output_token_ids == kv_cache.generate(MODEL, exact.prompt_token_ids, 5, stop_at_eos=False)
    assert out["over"].finish_reason is FinishReason.ERROR
    assert f"needs {n_ctx + 1} positions, which exceeds the context n_ctx={n_ctx}" in out["over"].error
    slot = Request("slot", [1, 2, 3], max_new_tokens=6, stop_at_eos=False)  # 3 + 6 - 1 = 8 positions
    out = LLMEngine(MODEL, max_num_seqs=1, max_len=8).generate_many([slot])[0]
    assert out.finish_reason is FinishReason.LENGTH and out.output_token_ids == alone(MODEL, slot)


def test_step_returns_request_id_token_pairs_and_records_metrics():
    engine = LLMEngine(MODEL, max_num_seqs=4, max_len=16)
    requests = random_requests(MODEL, 3, seed=5)
    for r in requests:
        engine.add_request(r)
    first = engine.step()
    assert [rid for rid, _ in first] == [0, 1, 2] and all(isinstance(t, int) for _, t in first)
    engine.run_until_done()
    s0 = engine.step_stats[0]
    assert (s0.num_prefill_seqs, s0.num_decode_seqs) == (3, 0)
    assert s0.num_batched_tokens == sum(len(r.prompt_token_ids) for r in requests)
    assert s0.kv_slots_in_use == 3 and s0.kv_reserved_tokens == 3 * 16
    for o in engine.outputs():
        m = o.metrics
        assert len(m.token_times) == len(o.output_token_ids)
        assert m.time_to_first_token >= 0 and m.e2e_latency >= m.time_to_first_token
        assert len(m.inter_token_latencies) == len(o.output_token_ids) - 1
    summary = wl.summarize(engine.outputs())
    assert summary["output_tokens"] == sum(r.max_new_tokens for r in requests) and summary["num_errors"] == 0


def test_invalid_requests_and_failing_samplers_fail_alone():
    calls = {"n": 0}

    def explodes_on_third_token(token_ids, logits):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("user code failed")
        return logits

    good = random_requests(MODEL, 4, seed=6)
    bad = [
        Request("long", list(range(1, 15)), max_new_tokens=5),  # 19 > n_ctx = 16
        Request("oov", [1, 2, TINY.vocab_size], max_new_tokens=3),
        Request("empty", [], max_new_tokens=3),
        Request("temp", [1, 2], max_new_tokens=3, sampling_params={"temperature": -1}),
        Request("key", [1, 2], max_new_tokens=3, sampling_params={"temprature": 0.5}),
        Request("kind", [1, 2], max_new_tokens=3, sampling_params=0.5),
        Request("neg", [1, 2], max_new_tokens=-1),
        Request("stop", [1, 2], max_new_tokens=3, stop_token_id=TINY.vocab_size + 1),
        Request("raises", [3, 4], max_new_tokens=8, logits_processor=explodes_on_third_token),
    ]
    engine = LLMEngine(MODEL, max_num_seqs=3, max_len=16)
    outs = {o.request_id: o for o in engine.generate_many(good[:2] + bad + good[2:])}
    for r in good:
        assert outs[r.request_id].output_token_ids == alone(MODEL, r)
    messages = {"long": "exceeds the context n_ctx=16", "oov": "token id 101 is out of range",
                "empty": "empty", "temp": "temperature must be", "key": "temprature", "kind": "SamplingParams",
                "neg": "max_new_tokens must be", "stop": "stop_token_id", "raises": "RuntimeError: user code failed"}
    for rid, text in messages.items():
        o = outs[rid]
        assert o.finish_reason is FinishReason.ERROR and text in o.error and repr(rid) in o.error, (rid, o.error)
    assert len(outs["raises"].output_token_ids) == 2  # its tokens before the failure are kept
    assert engine.store.reserved_tokens() == 0 and len(engine.store.free_slots) == 3
    with pytest.raises(InvalidInputError, match="already"):
        engine.add_request(Request("long", [1], 1))


def test_wall_clock_replay_runs_everything():
    requests = random_requests(MODEL, 4, seed=7)
    for i, r in enumerate(requests):
        r.arrival_s = 0.001 * i
    outs = replay(LLMEngine(MODEL, max_len=16), requests)  # no timing assertions: only that it completes
    assert [o.output_token_ids for o in outs] == [alone(MODEL, r) for r in requests]
    with pytest.raises(InvalidInputError):
        replay(LLMEngine(MODEL, max_len=16), requests, clock="virtual")


# ----------------------------------------------------------------------------------------------------------------
# Static batching


def test_left_padding_mask_and_positions():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    np.testing.assert_array_equal(ids, [[5, 6, 7], [0, 0, 8]])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [0, 0, 1]])
    np.testing.assert_array_equal(position_ids(mask), [[0, 1, 2], [0, 0, 0]])
    m = left_padding_attention_mask(mask, 3)
    assert m.shape == (2, 1, 3, 3)
    np.testing.assert_array_equal(m[0, 0], np.tril(np.ones((3, 3), bool)))
    np.testing.assert_array_equal(m[1, 0], [[1, 0, 0], [0, 1, 0], [0, 0, 1]])  # pads see only themselves
    decode_mask = np.concatenate([mask, np.ones((2, 1), bool)], axis=1)
    np.testing.assert_array_equal(left_padding_attention_mask(decode_mask, 1)[:, 0, 0], [[1, 1, 1, 1], [0, 0, 1, 1]])


@pytest.mark.parametrize("name,model", models(), ids=lambda x: x if isinstance(x, str) else "")
def test_static_batching_greedy_rows_equal_chapter_2(name, model):
    requests = random_requests(model, 6, seed=8)
    out = static_generate(model, [r.prompt_token_ids for r in requests], [r.max_new_tokens for r in requests],
                          stop_at_eos=False)
    for r, tokens in zip(requests, out.output_token_ids):
        assert tokens == alone(model, r)
    assert len(out.active_rows) == max(r.max_new_tokens for r in requests)  # runs as long as the longest row
    assert out.active_rows[0] == 6 and out.slot_utilisation < 1


def test_static_batches_reuse_one_kv_buffer_without_reading_what_an_earlier_batch_left():
    """A buffer taken once serves batches of any size up to its own; the columns a batch reads are the ones it wrote,
    so a buffer full of another batch's numbers (here NaN) gives the same tokens as a fresh one."""
    from gpt2_core.ch03_batching.static_batching import static_kv_buffer

    requests = random_requests(MODEL, 5, seed=11)
    prompts, budgets = [r.prompt_token_ids for r in requests], [r.max_new_tokens for r in requests]
    columns = max(map(len, prompts)) + max(budgets)
    buffer = static_kv_buffer(MODEL.config, 8, columns)
    assert buffer.shape == (2, MODEL.config.n_layer, 8, MODEL.config.n_head, columns, MODEL.config.head_dim)
    fresh = static_generate(MODEL, prompts, budgets, stop_at_eos=False)
    buffer.fill(np.nan)
    for rows in (5, 3):  # a smaller batch after a larger one, in the same buffer
        out = static_generate(MODEL, prompts[:rows], budgets[:rows], stop_at_eos=False, kv_buffer=buffer)
        assert out.output_token_ids == fresh.output_token_ids[:rows] != []
    with pytest.raises(CacheCapacityError, match=r"5 rows x \d+ columns .* does not fit kv_buffer of 8 rows x 3 col"):
        static_generate(MODEL, prompts, budgets, stop_at_eos=False, kv_buffer=buffer[:, :, :, :, :3])
    for wrong in (buffer.astype(np.float16), buffer[:, :1], buffer[..., :-1]):  # dtype, layers, head size
        with pytest.raises(InvalidInputError, match=r"kv_buffer must be float32 \[2, n_layer="):
            static_generate(MODEL, prompts, budgets, stop_at_eos=False, kv_buffer=wrong)


def test_static_attention_in_chunks_of_one_row_gives_the_same_tokens(monkeypatch):
    """With a budget of one byte every chunk is a single row of the batch: prefill and decode still give each row
    the tokens it gets alone, pads and uneven lengths included."""
    from gpt2_core.ch03_batching import static_batching

    monkeypatch.setattr(static_batching, "SCORES_BYTES", 1)
    requests = random_requests(MODEL, 5, seed=12)
    assert len({len(r.prompt_token_ids) for r in requests}) > 1  # uneven padding
    out = static_generate(MODEL, [r.prompt_token_ids for r in requests], [r.max_new_tokens for r in requests],
                          stop_at_eos=False)
    for r, tokens in zip(requests, out.output_token_ids):
        assert tokens == alone(MODEL, r)


def test_replay_static_takes_its_kv_memory_once_before_its_clock(monkeypatch):
    from gpt2_core.ch03_batching import static_batching
    from gpt2_core.bench.replay import replay_static

    taken = []
    real = static_batching.claimed_zeros

    def spy(shape, *args):
        taken.append((shape, time.perf_counter()))
        return real(shape, *args)
    monkeypatch.setattr(static_batching, "claimed_zeros", spy)
    requests = random_requests(MODEL, 6, seed=10)
    outs, batches = replay_static(MODEL, iter(requests), batch_size=4, clock="offline")
    assert [b["batch_size"] for b in batches] == [4, 2] and len(taken) == 1  # one buffer for both batches
    (shape, when), = taken
    columns = max(len(r.prompt_token_ids) for r in requests) + max(r.max_new_tokens for r in requests)
    assert shape[2] == 4 and shape[4] == columns and when < batches[0]["start_time"]
    for o, r in zip(outs, requests):
        assert o.output_token_ids == alone(MODEL, r)
    assert replay_static(MODEL, [], batch_size=4) == ([], [])


def test_static_batching_seeded_sampling_matches_chapter_2():
    requests = random_requests(MODEL, 4, seed=9)
    params = [SamplingParams(temperature=0.8, top_k=30, seed=i) for i in range(4)]
    out = static_generate(MODEL, [r.prompt_token_ids for r in requests], [r.max_new_tokens for r in requests],
                          params, stop_at_eos=False)
    for i, (r, tokens) in enumerate(zip(requests, out.output_token_ids)):
        assert tokens == alone(MODEL, r, temperature=0.8, top_k=30, seed=i)


# ----------------------------------------------------------------------------------------------------------------
# Workloads and traces


def test_standard_workload_is_seeded_and_in_range():
    a, b = wl.standard_workload(seed=0), wl.standard_workload(seed=0)
    assert [(r.prompt_token_ids, r.max_new_tokens, r.arrival_s) for r in a] == \
           [(r.prompt_token_ids, r.max_new_tokens, r.arrival_s) for r in b]
    assert wl.standard_workload(seed=1)[3].prompt_token_ids != a[3].prompt_token_ids
    assert all(16 <= len(r.prompt_token_ids) <= 256 and 16 <= r.max_new_tokens <= 256 for r in a)
    arrivals = [r.arrival_s for r in a]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)


def test_trace_round_trip_and_errors(tmp_path):
    requests = wl.poisson_workload(5, 2.0, TINY.vocab_size, seed=3, prompt_len=(4, 0.5, 1, 8),
                                   output_len=(4, 0.5, 1, 8))
    requests[1].sampling_params = SamplingParams(temperature=0.7, seed=5)
    path = tmp_path / "t.jsonl"
    wl.save_trace(requests, path, with_token_ids=True)
    back = wl.load_trace(path, TINY.vocab_size)
    assert [(r.prompt_token_ids, r.max_new_tokens, r.arrival_s) for r in back] == \
           [(r.prompt_token_ids, r.max_new_tokens, r.arrival_s) for r in requests]
    assert back[1].sampling_params == {"temperature": 0.7, "seed": 5}
    wl.save_trace(requests, path)
    lens = [len(r.prompt_token_ids) for r in wl.load_trace(path, TINY.vocab_size)]
    assert lens == [len(r.prompt_token_ids) for r in requests]
    path.write_text(json.dumps({"prompt": "hello", "max_new_tokens": 2}) + "\n")
    with pytest.raises(InvalidInputError, match="tokenizer"):
        wl.load_trace(path, TINY.vocab_size)
    path.write_text('{"max_new_tokens": 2}\n')
    with pytest.raises(InvalidInputError, match=":1: needs"):
        wl.load_trace(path, TINY.vocab_size)
    path.write_text('{"prompt_len": 3, "temperature": -2}\n')
    out = LLMEngine(MODEL, max_len=16).generate_many(wl.load_trace(path, TINY.vocab_size))[0]
    assert out.finish_reason is FinishReason.ERROR  # a bad line fails alone, in the engine


def test_committed_trace_is_the_standard_workload():
    trace = wl.load_trace(wl.Path(__file__).resolve().parent.parent / "data" / "traces" / "standard_workload.jsonl",
                          50257)
    std = wl.standard_workload()
    assert [(r.prompt_token_ids, r.max_new_tokens, r.arrival_s) for r in trace] == \
           [(r.prompt_token_ids, r.max_new_tokens, r.arrival_s) for r in std]  # the same prompts, too


def test_benchmark_strategies_agree_and_utilisation_is_a_fraction():
    from gpt2_core.bench import batching as bb
    from gpt2_core.bench.replay import replay_static

    requests = random_requests(MODEL, 6, seed=10)
    seq = bb.replay_sequential(MODEL, requests, clock="offline")
    static, batches = replay_static(MODEL, requests, batch_size=4, clock="offline")
    cont, engine = bb.run_continuous(MODEL, requests, max_num_seqs=4, max_len=16, clock="steps")
    for a, b, c, r in zip(seq, static, cont, requests):
        assert a.output_token_ids == b.output_token_ids == c.output_token_ids == alone(MODEL, r)
    assert [b["batch_size"] for b in batches] == [4, 2]
    for u in (bb.utilisation_from_steps(bb.sequential_intervals(seq), 4),
              bb.utilisation_from_steps(bb.static_intervals(batches), 4),
              bb.utilisation_from_steps(bb.engine_intervals(engine), 4)):
        assert 0 < u <= 1
    assert bb.utilisation_from_steps([(0.0, 1.0, 2), (1.0, 3.0, 4)], 4) == (2 + 8) / 12


def test_decode_step_and_its_gemm_bound_are_measured_side_by_side():
    from gpt2_core.bench import batching as bb

    pairs = bb.decode_beside_gemm_bound(MODEL, batch=3, context=8, pairs=2, steps=1)
    assert len(pairs) == 2
    for seconds, bound in pairs:
        assert seconds > 0 and bound["seconds_per_step"] > 0
        assert bound["tokens_per_s"] == pytest.approx(3 / bound["seconds_per_step"])
        assert 0 < bound["lm_head_share"] < 1


def record_calls(monkeypatch, module, names) -> list:
    """Wrap each ``module.<name>`` so that calling it appends its name to the returned list, then runs it."""
    calls = []
    for name in names:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _name=name, _real=real, **k: (calls.append(_name), _real(*a, **k))[1])
    return calls


def test_batching_benchmark_record_shape_and_continuous_bracketing(monkeypatch):
    """The quick benchmark end to end (GPT-2 124M shape, 8 short requests): every strategy, the continuous
    figure as the mean of its two bracketing runs, the ratios computed from the records, the small-batch
    comparison. HF transformers is left out (it is an optional reference)."""
    from gpt2_core.bench import batching as bb

    monkeypatch.setattr(bb, "replay_hf", lambda *a, **k: None)
    order = record_calls(monkeypatch, bb, ("warm_up", "run_continuous", "replay_sequential"))
    data = bb.bench_batching(quick=True, sweep=[1, 2], context=8)
    assert order[0] == "warm_up"  # before any strategy is timed (it calls the strategies itself, on its own)
    assert order[-3:] == ["run_continuous", "replay_sequential", "run_continuous"]  # the timed A-B-...-A order
    by = {r["method"]: r for r in data["results"] if r["method"] != "gemm_bound"}
    assert set(by) == {"sequential", "static", "continuous"}
    runs = by["continuous"]["runs"]
    assert len(runs) == 2 and all(r["tokens_per_s"] > 0 for r in runs)
    assert by["continuous"]["tokens_per_s"] == pytest.approx(np.mean([r["tokens_per_s"] for r in runs]))
    assert data["ratios"]["continuous_over_sequential"] == pytest.approx(
        by["continuous"]["tokens_per_s"] / by["sequential"]["tokens_per_s"])
    assert [r["batch"] for r in data["small_batch_gemv"]] == [2, 4]
    assert [r["batch"] for r in data["tiled"]] == [2, 8]
    assert all(r["tiled_seconds_per_step"] > 0 and r["untiled_seconds_per_step"] > 0 for r in data["tiled"])
    assert data["ratios"]["tiled_step_speedup_median"] == pytest.approx(
        np.median([r["speedup"] for r in data["tiled"]]))
    padding = data["gemm_row_padding"]  # 7 rows run as 8; 8 as they are
    assert [(r["rows"], r["gemm_rows"]) for r in padding] == [(7, 8), (8, 8)]
    assert all(r["unpadded_seconds"] > 0 and r["padded_seconds"] > 0 and r["speedup"] > 0 for r in padding)
    assert [d["batch"] for d in data["decode_sweep"]] == [1, 2]
    assert all(r["output_tokens"] == by["sequential"]["output_tokens"] for r in by.values())


def test_bench_padding_reports_both_arms_and_the_two_medians():
    """``python -m gpt2_core bench padding``: a record per arm and row count, and the median speed-up over the row
    counts it pads beside the one over those it leaves alone (their noise)."""
    from gpt2_core.bench.batching import bench_padding

    out = bench_padding(quick=True)
    assert [(r["method"], r["batch"]) for r in out["results"]] == [(m, n) for n in range(12, 18)
                                                                    for m in ("unpadded", "padded")]
    records = out["gemm_row_padding"]
    padded = [r["speedup"] for r in records if r["gemm_rows"] != r["rows"]]
    alone = [r["speedup"] for r in records if r["gemm_rows"] == r["rows"]]
    assert len(padded) == 3 and len(alone) == 3  # 13-15 padded to 16; 12, 16, 17 left alone
    assert out["ratios"] == {"padded_rows_median_speedup": pytest.approx(float(np.median(padded))),
                             "rows_left_alone_median_speedup": pytest.approx(float(np.median(alone)))}
    assert all(r["tokens_per_s"] > 0 for r in out["results"])


def test_malformed_requests_fail_alone_and_leave_the_engine_sound():
    engine = LLMEngine(MODEL, max_num_seqs=2, max_len=16)
    ok = Request("ok", [1, 2, 3], max_new_tokens=4, stop_at_eos=False)
    engine.add_request(Request("ragged", [[1, 2], [3]], 3))  # not a 1-D list of ids
    engine.add_request(Request("scalar", [1, 2], 3, logits_processor=lambda ids, logits: 3.0))
    engine.add_request(Request("short", [1, 2], 3, logits_processor=lambda ids, logits: logits[:5]))
    engine.add_request(ok)
    assert list(engine.stream("ragged")) == []  # finished at once, so the stream ends instead of waiting forever
    engine.run_until_done()
    out = {o.request_id: o for o in engine.outputs()}
    assert out["ragged"].finish_reason is FinishReason.ERROR and "1-D sequence of ints" in out["ragged"].error
    for rid in ("scalar", "short"):
        assert out[rid].finish_reason is FinishReason.ERROR and "logits_processor must return" in out[rid].error
    assert out["ok"].output_token_ids == alone(MODEL, ok)
    assert engine.store.reserved_tokens() == 0
    for kwargs, name in [(dict(max_num_seqs=2.5), "max_num_seqs"), (dict(max_num_seqs=0), "max_num_seqs"),
                         (dict(max_len=8.5), "max_len")]:
        with pytest.raises(InvalidInputError, match=f"{name} must be a positive integer"):
            LLMEngine(MODEL, **kwargs)


def test_replay_refuses_arrival_times_that_are_not_finite_non_negative_numbers():
    for bad in (float("nan"), float("inf"), -1.0, None):
        requests = [Request("a", [1, 2], 3), Request("b", [3, 4], 3, arrival_s=bad)]
        with pytest.raises(InvalidInputError, match="request 'b': arrival_s must be a finite number >= 0"):
            replay(LLMEngine(MODEL, max_len=16), requests, clock="steps")


def test_static_batching_keeps_each_requests_stop_settings_and_fails_bad_requests_alone():
    from gpt2_core.bench.replay import replay_static

    prompts = [[1, 2, 3], [4, 5], [6]]
    free_run = kv_cache.generate(MODEL, prompts[0], 8, stop_at_eos=False)
    stop = free_run[2]  # this token ends request "stop" as soon as it is sampled
    requests = [Request("stop", prompts[0], 8, stop_at_eos=False, stop_token_id=stop),
                Request("free", prompts[0], 8, stop_at_eos=False),
                Request("eos", prompts[1], 8, stop_at_eos=True),
                Request("oov", [MODEL.config.vocab_size + 1], 8),
                Request("temp", prompts[2], 8, sampling_params={"temperature": -1})]
    outs, batches = replay_static(MODEL, requests, batch_size=8, clock="offline")
    out = {o.request_id: o for o in outs}
    assert [o.request_id for o in outs] == [r.request_id for r in requests]
    assert out["stop"].output_token_ids == free_run[:free_run.index(stop) + 1]
    assert out["stop"].finish_reason is FinishReason.STOP
    assert out["free"].output_token_ids == free_run and out["free"].finish_reason is FinishReason.LENGTH
    assert out["eos"].output_token_ids == kv_cache.generate(MODEL, prompts[1], 8, stop_at_eos=True)
    assert out["oov"].finish_reason is FinishReason.ERROR and "out of range" in out["oov"].error
    assert out["temp"].finish_reason is FinishReason.ERROR and "temperature" in out["temp"].error
    assert sum(b["batch_size"] for b in batches) == 3  # the bad ones never took a row


def test_trace_keeps_seed_zero_and_stop_settings_and_names_bad_lines(tmp_path):
    requests = wl.poisson_workload(3, 2.0, TINY.vocab_size, seed=3, prompt_len=(4, 0.5, 1, 8),
                                   output_len=(4, 0.5, 1, 8))
    requests[0].sampling_params = SamplingParams(temperature=1.0, seed=0)
    requests[1].stop_at_eos, requests[1].stop_token_id = True, 7
    path = tmp_path / "t.jsonl"
    wl.save_trace(requests, path)
    back = wl.load_trace(path, TINY.vocab_size)
    assert back[0].sampling_params == {"temperature": 1.0, "seed": 0}
    assert (back[1].stop_at_eos, back[1].stop_token_id) == (True, 7) and back[2].stop_at_eos is False
    for line, message in [('{"prompt_len": -3}', ":1: 'prompt_len' must be an integer in \\[1, 1,000,000\\], got -3"),
                          ('{"prompt_len": 2.9}', "'prompt_len' must be an integer in \\[1, 1,000,000\\], got 2.9"),
                          ('{"prompt_len": 10000000000000}', "'prompt_len' must be an integer in \\[1, 1,000,000\\]"),
                          ('{"prompt_len": 2, "max_new_tokens": "many"}', "'max_new_tokens' must be an integer"),
                          ('{"prompt_len": 2, "arrival_s": NaN}', "'arrival_s' must be a finite number >= 0"),
                          ('{"prompt_len": 2, "arrival_s": null}', "'arrival_s' must be a finite number >= 0"),
                          ('{"prompt_token_ids": 5}', "'prompt_token_ids' must be a list"),
                          ('{"prompt_len": 2, "temprature": 0.9}', "unknown field\\(s\\) 'temprature'"),
                          ('{"prompt_len": 2, "stop_at_eos": "no"}', "'stop_at_eos' must be true or false"),
                          ("[" * 100_000, ":1: not valid JSON \\(RecursionError"),
                          ('{"prompt_len": 2, "max_new_tokens": ' + "9" * 5000 + "}", ":1: not valid JSON \\(ValueError"),
                          ('{"request_id": 1, "prompt_len": 2}\n{"prompt_len": 2}', ":2: request_id 1 is used")]:
        path.write_text(line + "\n")
        with pytest.raises(InvalidInputError, match=message):
            wl.load_trace(path, TINY.vocab_size)


def test_a_step_cannot_start_inside_another():
    """An ``on_token`` callback or a ``logits_processor`` that steps the engine itself would run a step in the
    middle of one (tokens handed out of order; under ``python -O`` an empty chunk and wrong tokens for others). It
    gets an error instead: its own request fails, the others get their chapter 2 tokens in order."""
    from_callback = Request("callback", [5, 6, 7], max_new_tokens=4, stop_at_eos=False)
    from_processor = Request("processor", [1, 2], max_new_tokens=4, stop_at_eos=False)
    innocent = Request("innocent", [8, 9], max_new_tokens=4, stop_at_eos=False)
    engine = LLMEngine(MODEL, max_num_seqs=3, max_len=16)
    calls = []

    def processor(ids, logits):
        calls.append(len(ids))
        if len(calls) == 2:
            engine.step()
        return logits
    from_processor.logits_processor = processor
    seen = []
    engine.add_request(from_callback, on_token=lambda seq, token: seq.is_finished or engine.step())
    engine.add_request(from_processor)
    engine.add_request(innocent, on_token=lambda seq, token: seen.append(token))
    engine.run_until_done()
    out = {o.request_id: o for o in engine.outputs()}
    for rid, where in (("callback", "on_token raised"), ("processor", "sampling raised")):
        assert out[rid].finish_reason is FinishReason.ERROR
        assert f"{where} InvalidInputError: step() was called from inside a step" in out[rid].error
    assert seen == out["innocent"].output_token_ids == alone(MODEL, innocent)
    assert engine.store.reserved_tokens() == 0
    assert engine.step() == []  # the engine is usable afterwards


def test_an_engine_refuses_a_store_in_use_and_a_step_that_can_never_schedule():
    from gpt2_core.ch04_paged.paged_kv_store import PagedKVStore

    store = PagedKVStore(MODEL.config, num_blocks=4, block_size=4)
    store.allocate("someone else", 8)
    with pytest.raises(InvalidInputError, match="already holds room for 8 tokens of other sequences"):
        LLMEngine(MODEL, store=store)
    store = PagedKVStore(MODEL.config, num_blocks=4, block_size=4)
    engine = LLMEngine(MODEL, store=store)
    store.allocate("someone else", 12)  # taken behind the engine's back: 1 block of 4 left
    engine.add_request(Request("x", [1, 2, 3, 4, 5], max_new_tokens=3))
    with pytest.raises(CacheCapacityError, match="1 request\\(s\\) wait, none is running"):
        engine.run_until_done()  # instead of stepping forever
    store.free("someone else")
    engine.run_until_done()
    assert engine.get_sequence("x").output_token_ids == alone(MODEL, Request("x", [1, 2, 3, 4, 5], 3))


def test_engine_arguments_are_checked_before_the_store_takes_memory_and_callables_on_arrival(monkeypatch):
    import gpt2_core.ch03_batching.engine as engine_module

    built = []
    monkeypatch.setattr(engine_module, "ContiguousKVStore", lambda *a, **k: built.append(a))
    with pytest.raises(InvalidInputError, match="max_num_batched_tokens=4 must be >= max_num_seqs=8"):
        LLMEngine(MODEL, max_num_seqs=8, max_num_batched_tokens=4)
    assert built == []
    monkeypatch.undo()
    engine = LLMEngine(MODEL, max_num_seqs=2, max_len=16)
    with pytest.raises(InvalidInputError, match="on_token must be a function"):
        engine.add_request(Request("a", [1, 2], 3), on_token=5)
    engine.add_request(Request("b", [1, 2], 3, logits_processor=5))
    assert "logits_processor must be a function" in engine.get_sequence("b").error
    assert engine.store.reserved_tokens() == 0


def test_stores_refuse_a_negative_position_before_writing():
    from gpt2_core.ch04_paged.paged_kv_store import PagedKVStore

    cfg = MODEL.config
    k = np.ones((cfg.n_head, 1, cfg.head_dim), np.float32)
    for store in (ContiguousKVStore(cfg, num_slots=1, max_len=8), PagedKVStore(cfg, num_blocks=2, block_size=4)):
        store.allocate("a", 8)
        arrays = [store.kv] if isinstance(store, PagedKVStore) else [store.k, store.v]
        before = [a.copy() for a in arrays]
        with pytest.raises(InvalidInputError, match="update at position -2; positions start at 0"):
            store.update("a", 0, -2, k, k)
        assert all(np.array_equal(x, y) for x, y in zip(before, arrays))  # nothing written


def test_replay_static_fails_each_malformed_request_alone():
    from gpt2_core.bench.replay import replay_static

    ok = Request("ok", [5, 6], 3, stop_at_eos=False)
    bad = [Request("eos", [1], 3, stop_at_eos=1), Request("int prompt", 5, 3),
           Request("processor", [1, 2], 3, logits_processor=lambda ids, logits: logits)]
    outs, batches = replay_static(MODEL, [ok, *bad], clock="offline")
    out = {o.request_id: o for o in outs}
    assert out["ok"].output_token_ids == alone(MODEL, ok) and out["ok"].finish_reason is FinishReason.LENGTH
    assert "stop_at_eos must be True or False" in out["eos"].error
    assert "1-D sequence of ints" in out["int prompt"].error and out["int prompt"].prompt_token_ids == []
    assert "runs no logits_processor" in out["processor"].error
    assert all(out[r.request_id].finish_reason is FinishReason.ERROR for r in bad)
    for a in (float("nan"), None):
        with pytest.raises(InvalidInputError, match="request 'late': arrival_s must be a finite number >= 0"):
            replay_static(MODEL, [ok, Request("late", [1], 2, arrival_s=a)], clock="offline")


def test_save_trace_refuses_what_load_trace_would_refuse_instead_of_rounding_it(tmp_path):
    path = tmp_path / "t.jsonl"
    for request, message in [(Request(0, [3.7, 2], 2), "non-empty list of token ids"),
                             (Request(0, [], 2), "non-empty list of token ids"),
                             (Request(0, [1], 2.7), "max_new_tokens must be an integer >= 0, got 2.7"),
                             (Request(0, [1], -5), "max_new_tokens must be an integer >= 0, got -5"),
                             (Request(0, [1], 2, arrival_s=float("nan")), "arrival_s must be a finite number"),
                             (Request(0, [1], 2, stop_at_eos="no"), "stop_at_eos must be True or False"),
                             (Request(0, [1], 2, stop_token_id=1.9), "stop_token_id must be None or a token id")]:
        with pytest.raises(InvalidInputError, match=message):
            wl.save_trace([request], path, with_token_ids=True)
        assert not path.exists()
    with pytest.raises(InvalidInputError, match="request_id 1 is used twice"):
        wl.save_trace([Request(1, [1], 2), Request(1, [2], 2)], path)
    for kwargs, message in [(dict(vocab_size=0), "vocab_size must be a positive integer"),
                            (dict(vocab_size=10, seed=-1), "seed must be an integer >= 0")]:
        with pytest.raises(InvalidInputError, match=message):
            wl.load_trace(path, **kwargs)
    for kwargs, message in [(dict(seed=1.5), "seed must be an integer >= 0"),
                            (dict(prompt_len=(0, 0.5, 1, 8)), "prompt_len: the median must be > 0"),
                            (dict(prompt_len=(4, 0.5, 0, 8)), "prompt_len: low and high must be integers with 1 <="),
                            (dict(output_len=(4, -1, 1, 8)), "output_len: the median must be > 0 and sigma >= 0"),
                            (dict(output_len=(4, 1)), "output_len must be \\(median, sigma, low, high\\)")]:
        with pytest.raises(InvalidInputError, match=message):
            wl.poisson_workload(3, 1.0, 10, **kwargs)


def test_step_clock_replay_jumps_over_idle_steps_and_refuses_a_time_past_any_clock():
    requests = [Request("a", [1, 2], 2, arrival_s=0), Request("b", [3, 4], 2, arrival_s=3e6)]
    engine, loops = LLMEngine(MODEL, max_len=16), []
    has_unfinished = engine.has_unfinished
    engine.has_unfinished = lambda: loops.append(1) or has_unfinished()  # called a few times per replay loop
    outs = replay(engine, requests, clock="steps")
    assert len(loops) < 100  # the 3 million idle steps are skipped, not counted one by one
    assert [o.output_token_ids for o in outs] == [alone(MODEL, r) for r in requests]
    with pytest.raises(InvalidInputError, match="arrival_s x time_scale"):
        replay(LLMEngine(MODEL, max_len=16), [Request("c", [1], 2, arrival_s=1e300)], time_scale=1e10)


def test_generate_refuses_a_stop_at_eos_that_is_not_a_bool():
    from gpt2_core.ch01_forward import generation

    for generate in (generation.generate, kv_cache.generate):
        with pytest.raises(InvalidInputError, match="stop_at_eos must be True or False, got 'no'"):
            generate(MODEL, [1, 2], 3, stop_at_eos="no")


def test_a_ctrl_c_in_one_callback_still_hands_the_others_their_token():
    engine = LLMEngine(MODEL, max_num_seqs=3, max_len=16)
    requests = [Request(i, [1 + i, 2], max_new_tokens=3, stop_at_eos=False) for i in range(3)]
    received = {r.request_id: [] for r in requests}

    def on_token(seq, token):
        received[seq.request_id].append(token)
        if seq.request_id == 0 and len(received[0]) == 2:
            raise KeyboardInterrupt
    for r in requests:
        engine.add_request(r, on_token=on_token)
    with pytest.raises(KeyboardInterrupt):
        engine.run_until_done()
    assert [len(received[i]) for i in range(3)] == [2, 2, 2]  # the two after request 0 got the step's token too
    engine.run_until_done()  # the caller may go on
    assert all(received[r.request_id] == alone(MODEL, r) for r in requests)
