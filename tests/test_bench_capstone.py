"""The capstone's benchmark: its FLOP count against a count of the calls the code really makes, the rooflines and
their kind, every engine's tokens equal to chapter 2's, the optional rows skipped with a note, and
``python -m gpt2_core bench capstone --trace FILE --json FILE`` end to end (GPT2_QUICK=1); the per-step bound (each
step an engine ran priced at the GEMM rate for its own rows), the recorded steps, the speculative rows' replayed
acceptance and the chapter code's run beside the accelerated one. Timings are a command, not a test: nothing here
asserts a speed, only one ratio measured side by side (a 1-row product against a 256-row one)."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from helpers import ROOT, tiny_model

import gpt2_core
from gpt2_core.ch01_forward import generation; from gpt2_core import kv_cache; from gpt2_core.ch06_quantization import quant_kernels; from gpt2_core.ch03_batching import static_batching
from gpt2_core.bench import capstone as C
from gpt2_core.ch11_capstone import roofline as R
from gpt2_core.bench.kv_cache import weight_bytes_per_token
from gpt2_core.bench.workload import poisson_workload
from gpt2_core.loading.config import GPT2Config
from gpt2_core.ch03_batching.engine import LLMEngine
from gpt2_core.ch06_quantization.quantization import bytes_per_token
from gpt2_core.ch03_batching.sequence import Request
from gpt2_core.ch06_quantization.quant_kernels import numba_available

CONFIG = GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_head=4, n_layer=2)


def workload(n=5, seed=0, vocab=96):
    return poisson_workload(n, 50.0, vocab, seed=seed, prompt_len=(10, 0.5, 3, 20), output_len=(6, 0.5, 1, 12))


# ----------------------------------------------------------------------------------------------------------------
# FLOPs: the formula against the matmuls the code performs


class CallCounter:
    """Wraps the matmul-bearing functions in every gpt2_core module that imported them and adds up their FLOPs
    from the shapes they are called with: ``linear`` 2 x rows x in x out, ``lm_head`` 2 x rows x E x V, chapter 1's
    ``attention`` and its one-query form ``decode_attention`` 4 x H x T x S x D (Q K^T and P V), and static batching's
    ``softmax`` over its [b, H, T, S] scores 4 x D per score (its attention's two products are written inline)."""

    def __init__(self, monkeypatch, config):
        import gpt2_core.ch01_forward.model as M

        self.flops, D = 0, config.head_dim
        originals = {"linear": M.linear, "lm_head": M.lm_head, "attention": M.attention,
                     "decode_attention": M.decode_attention}

        def linear(x, weight, bias):
            self.flops += 2 * x.shape[0] * weight.shape[0] * weight.shape[1]
            return originals["linear"](x, weight, bias)

        def lm_head(params, x, eps):
            self.flops += 2 * x.shape[0] * config.n_embd * config.vocab_size
            return originals["lm_head"](params, x, eps)

        def attention(q, k, v):
            self.flops += 4 * q.shape[0] * q.shape[1] * k.shape[1] * q.shape[2]
            return originals["attention"](q, k, v)

        def decode_attention(q, k, v):
            self.flops += 4 * q.shape[0] * q.shape[1] * k.shape[1] * q.shape[2]
            return originals["decode_attention"](q, k, v)

        def static_softmax(x, axis=-1):
            self.flops += 4 * D * x.size
            return M.softmax(x, axis)

        wrappers = {"linear": linear, "lm_head": lm_head, "attention": attention, "decode_attention": decode_attention}
        for module in [m for name, m in sys.modules.items() if name.startswith("gpt2_core") and m is not None]:
            for name, fn in wrappers.items():
                if getattr(module, name, None) is originals[name]:
                    monkeypatch.setattr(module, name, fn)
        monkeypatch.setattr(static_batching, "softmax", static_softmax)


def test_forward_flops_of_a_pass_is_the_gpt2_124m_figure():
    gpt2 = gpt2_core.PRESETS["gpt2"]
    assert C.forward_flops(gpt2, 1, 0, 0) == 24 * 768 ** 2 * 12 == 169_869_312  # ~170 MFLOP a position, blocks
    assert C.forward_flops(gpt2, 0, 0, 1) == 2 * 768 * 50257  # ~77 MFLOP the head
    assert C.forward_flops(gpt2, 3, 10, 1) == 3 * 169_869_312 + 12 * 4 * 768 * 3 * 10 + 2 * 768 * 50257


@pytest.mark.parametrize("method", ["naive", "kv_cache", "continuous", "static"])
def test_the_counted_flops_equal_a_count_of_the_calls_the_engine_makes(monkeypatch, method):
    model = tiny_model(config=CONFIG)
    requests = workload(6)
    lengths = C.lengths_of(requests)
    counter = CallCounter(monkeypatch, CONFIG)
    if method == "naive":
        for r in requests:
            generation.generate(model, r.prompt_token_ids, r.max_new_tokens, stop_at_eos=False)
    elif method == "kv_cache":
        for r in requests:
            kv_cache.generate(model, r.prompt_token_ids, r.max_new_tokens, stop_at_eos=False)
    elif method == "continuous":
        LLMEngine(model, max_num_seqs=len(requests)).generate_many(C.at_zero(requests))
    else:
        static_batching.static_generate(model, [r.prompt_token_ids for r in requests[:4]],
                                        [r.max_new_tokens for r in requests[:4]], stop_at_eos=False)
        lengths = lengths[:4]
    expected = sum(C.forward_flops(CONFIG, q, k, h) for q, k, h in C.workload_passes(method, lengths, batch=4))
    assert counter.flops == expected > 0
    if method == "naive":  # naive recomputes: more work than the cached engines for the same tokens
        cached = sum(C.forward_flops(CONFIG, q, k, h) for q, k, h in C.workload_passes("kv_cache", lengths))
        assert expected > cached


def test_naive_positions_grow_with_the_square_of_the_length():
    one = sum(q for q, _, _ in C.request_passes("naive", 100, 100))
    two = sum(q for q, _, _ in C.request_passes("naive", 200, 200))
    assert one == 100 * 100 + 100 * 99 // 2 and 3.9 < two / one < 4.1
    assert sum(q for q, _, _ in C.request_passes("kv_cache", 100, 100)) == 100 + 99  # each position once
    assert C.request_passes("naive", 5, 0) == C.request_passes("kv_cache", 5, 0) == []


def test_static_counts_its_padding():
    passes = C.static_passes([(4, 3), (10, 1)])  # padded to 10, run 3 steps for both rows
    assert passes == [(10, 10, 1), (10, 10, 1), (1, 11, 1), (1, 11, 1), (1, 12, 1), (1, 12, 1)]


# ----------------------------------------------------------------------------------------------------------------
# Bytes and the roofline


def test_count_work_charges_the_weights_once_per_step_and_the_kv_each_decode_reads():
    passes = [(5, 5, 1), (1, 6, 1), (1, 7, 1)]
    work = C.count_work(CONFIG, passes, model_steps=3, weight_bytes=1000)
    per_position = 2 * CONFIG.n_layer * CONFIG.n_embd * 4
    assert work["bytes_read"] == 3 * 1000 + (6 + 7) * per_position
    assert work["positions"] == 7 and work["model_steps"] == 3
    assert work["flops"] == sum(C.forward_flops(CONFIG, *p) for p in passes)


def test_roofline_takes_the_slower_of_flops_and_bytes():
    # 1 GFLOP at 100 GFLOP/s = 10 ms; 0.5 GB at 10 GB/s = 50 ms: bytes bind, 10 tokens in 50 ms
    r = C.roofline(1e9, 0.5e9, 10, 100e9, 10e9)
    assert r["bound_kind"] == "bytes" and r["bound_tokens_per_s"] == pytest.approx(200)
    r = C.roofline(10e9, 0.5e9, 10, 100e9, 10e9)  # 100 ms of FLOPs
    assert r["bound_kind"] == "flops" and r["bound_tokens_per_s"] == pytest.approx(100)


def test_batch_one_decode_is_bound_by_bytes_and_a_big_batch_by_flops_on_gpt2_shape():
    """The physics the chapter teaches, from the counts alone: at 120 GFLOP/s and 15 GB/s, one sequence decoding
    reads 498 MB of weights per token (bytes bind); 32 sequences share each read (FLOPs bind)."""
    gpt2 = gpt2_core.PRESETS["gpt2"]
    weights = weight_bytes_per_token(gpt2_core.random_model(gpt2, seed=0))
    one = C.count_work(gpt2, C.workload_passes("kv_cache", [(64, 64)]), 64, weights)
    assert C.roofline(one["flops"], one["bytes_read"], 64, 120e9, 15e9)["bound_kind"] == "bytes"
    batch = C.count_work(gpt2, C.workload_passes("continuous", [(64, 64)] * 32), 64, weights)
    assert C.roofline(batch["flops"], batch["bytes_read"], 64 * 32, 120e9, 15e9)["bound_kind"] == "flops"


# ----------------------------------------------------------------------------------------------------------------
# The bound at each step's own shape


def test_rate_at_interpolates_in_log_rows_and_holds_the_ends():
    assert R.rate_at(4, [2, 8], [10.0, 40.0]) == pytest.approx(25.0)  # halfway in log2: 2 -> 4 -> 8
    assert R.rate_at(1, [2, 8], [10.0, 40.0]) == 10.0 and R.rate_at(2048, [2, 8], [10.0, 40.0]) == 40.0


STEPS = [[(5, 5, 1), (3, 3, 1)], [(1, 6, 1), (1, 4, 1)], [(1, 7, 1)]]  # a prefill of two, two decodes, one


def flat_rates(blocks_small, blocks_large=None, head=1e9):
    return {"rows": [1, 256], "blocks": [blocks_small, blocks_large or blocks_small], "head_rows": [1, 256],
            "head": [head, head]}


def test_the_per_step_bound_at_one_rate_is_the_flop_roofline_of_the_same_steps():
    got = R.per_step_bound(CONFIG, STEPS, 1000, flat_rates(1e9), float("inf"), output_tokens=5)
    flops = sum(C.forward_flops(CONFIG, *chunk) for step in STEPS for chunk in step)
    assert got["step_bound_seconds"] == pytest.approx(flops / 1e9) and got["steps_bound_by_bytes"] == 0
    assert got["step_bound_tokens_per_s"] == pytest.approx(5 / (flops / 1e9))


def test_a_slower_rate_at_few_rows_lowers_the_per_step_bound_and_bytes_can_bind_a_step():
    fast = R.per_step_bound(CONFIG, STEPS, 1000, flat_rates(1e9), float("inf"), output_tokens=5)
    slow = R.per_step_bound(CONFIG, STEPS, 1000, flat_rates(1e8, 1e9), float("inf"), output_tokens=5)
    assert slow["step_bound_tokens_per_s"] < fast["step_bound_tokens_per_s"]
    # bytes: every step reads the 1000 weight bytes and the K/V cached before it (keys minus the step's queries)
    kv = 2 * CONFIG.n_layer * CONFIG.n_embd * 4
    assert R.step_seconds(CONFIG, STEPS[1], 1000, flat_rates(1e9), 1.0)[1] == 1000 + kv * (5 + 3)
    starved = R.per_step_bound(CONFIG, STEPS, 1000, flat_rates(1e9), 1.0, output_tokens=5)
    assert starved["steps_bound_by_bytes"] == 3


def test_the_recorded_steps_of_an_engine_are_the_passes_counted_for_it():
    model = tiny_model(config=CONFIG)
    requests = workload(6)
    run = C.run_engine(LLMEngine(model, max_num_seqs=3), requests, arrivals=False)
    recorded = sorted(chunk for step in run["steps"] for chunk in step)
    assert recorded == sorted(C.workload_passes("continuous", C.lengths_of(requests)))
    assert len(run["steps"]) == len(run["forward_seconds"]) == run["model_steps"]
    assert max(len(step) for step in run["steps"]) <= 3  # max_num_seqs sequences a step


@pytest.mark.parametrize("outcome", [(4, 0), (4, 4), (0, 0), (4, 2)])
def test_the_replay_drafter_replays_its_acceptance_and_keeps_the_plain_tokens(outcome):
    """Each step proposes what the outcome says, the first ``accepted`` right: acceptance 0 and 1 exactly at the
    ends, no pass at all without proposals; a verify chunk's head runs on all its rows; the tokens never change."""
    model = tiny_model(config=CONFIG)
    requests = workload(5, seed=1)
    plain, outputs = C.batched_row(model, "prefix_cached", requests, arrivals=False)
    measured = {"outcomes": [outcome], "alpha": 0.0, "tokens_per_pass": 1.0, "proposal_rate": 1.0}
    row = C.spec_row(model, requests, plain, outputs, "copy_task", measured)
    spec, (proposed, accepted) = row["speculative"], outcome
    assert spec["identical_to_plain"] and row["output_tokens"] == plain["output_tokens"]
    steps = row["_steps"][0]
    if proposed == 0:
        assert spec["tokens_per_pass"] == 0 and row["model_steps"] == plain["model_steps"]
        assert row["flops"] == plain["flops"]
        return
    assert any(q > 1 and h == q for step in steps for q, _, h in step)  # verify chunks: logits on every row
    if accepted == 0:
        assert spec["alpha"] == 0 and spec["tokens_per_pass"] == 1 and row["flops"] > plain["flops"]
    elif accepted == proposed:
        assert spec["alpha"] == 1 and row["model_steps"] < plain["model_steps"]
    else:
        assert 0 < spec["alpha"] < 1 and 1 < spec["tokens_per_pass"] <= accepted + 1


def test_a_product_of_one_row_does_fewer_flops_a_second_than_one_of_256_on_gpt2_matrices():
    """Why the per-step bound sits under compute_bound: one row reads a whole weight for 2 FLOPs per value, 256 rows
    share the read. Both measured side by side here; only their ratio is asserted."""
    model = gpt2_core.random_model(replace(gpt2_core.PRESETS["gpt2"], n_layer=1), seed=0)
    rates = C.gemm_rates(model, rows=(1, 256), repeats=3)
    assert rates["rows"] == rates["head_rows"] == [1, 256]
    assert rates["blocks"][1] > 2 * rates["blocks"][0] and rates["head"][1] > 2 * rates["head"][0]


def test_queue_latencies_place_service_times_on_the_arrivals():
    # two requests of 1 s each (tokens at 0.2, 0.6, 1.0 s), arriving at 0 and 0.5: the second waits until 1.0
    service = [(1.0, [0.2, 0.6, 1.0]), (1.0, [0.2, 0.6, 1.0])]
    lat = C.queue_latencies(service, [0.0, 0.5])
    assert lat["ttft_p50_s"] == pytest.approx(np.median([0.2, 1.0 + 0.2 - 0.5]))
    assert lat["itl_p50_s"] == pytest.approx(0.4)


def test_shortest_span_over_picks_the_fewest_positions():
    points = [{"prompt_len": 64, "new_tokens": 64, "span": 80.0}, {"prompt_len": 256, "new_tokens": 256, "span": 150},
              {"prompt_len": 128, "new_tokens": 128, "span": 101.0}]
    assert C.shortest_span_over(points)["prompt_len"] == 128
    assert C.shortest_span_over(points, 1000) is None


# ----------------------------------------------------------------------------------------------------------------
# Same tokens: every engine of the table on the workload equals chapter 2


def test_every_engine_gives_chapter_2s_greedy_tokens_on_the_workload():
    model = tiny_model(config=CONFIG)
    requests = workload(7, seed=3)
    reference = {r.request_id: kv_cache.generate(model, r.prompt_token_ids, r.max_new_tokens, stop_at_eos=False)
                 for r in requests}
    assert len({tuple(t) for t in reference.values()}) > 1  # the requests' tokens differ: a real comparison
    rows = {"naive": C.naive_row(model, requests, stride=1), "kv_cache": C.kv_cache_row(model, requests)}
    for method in ("static", "continuous", "paged", "prefix_cached"):
        rows[method] = C.batched_row(model, method, requests)
    for method, (row, outputs) in rows.items():
        assert {o.request_id: o.output_token_ids for o in outputs} == reference, method
        assert row["output_tokens"] == sum(r.max_new_tokens for r in requests), method
    kernels = ["numpy"] + (["numba"] if quant_kernels.numba_available() else [])
    for kernel in kernels:  # chapter 6: the same engine on int8 weights equals chapter 2 on the same weights
        q = C.quant_model(CONFIG, kernel, model)
        row, outputs = C.quant_row(CONFIG, kernel, requests, model)
        assert {o.request_id: o.output_token_ids for o in outputs} == {
            r.request_id: kv_cache.generate(q, r.prompt_token_ids, r.max_new_tokens, stop_at_eos=False)
            for r in requests}, kernel
        assert row["weight_bytes"] == q.nbytes() < model.nbytes() / 2


def test_the_naive_row_runs_a_subset_and_scales_by_positions():
    model = tiny_model(config=CONFIG)
    requests = workload(8)
    row, outputs = C.naive_row(model, requests, stride=4)
    assert [o.request_id for o in outputs] == [requests[0].request_id, requests[4].request_id]
    sub = row["subset"]
    assert sub["requests"] == 2 and sub["of"] == 8
    assert row["seconds"] == pytest.approx(sub["of_positions"] / sub["positions_per_s"])
    assert sub["of_positions"] == row["positions"] == sum(
        q for r in requests for q, _, _ in C.request_passes("naive", len(r.prompt_token_ids), r.max_new_tokens))
    assert row["tokens_per_s"] == pytest.approx(row["output_tokens"] / row["seconds"])


# ----------------------------------------------------------------------------------------------------------------
# The whole run, in process (optional rows switched off) and from the command line


def test_optional_rows_are_skipped_with_a_note(monkeypatch, tmp_path):
    monkeypatch.setattr(quant_kernels, "numba_available", lambda: False)
    monkeypatch.setattr(C, "replay_hf", lambda *a, **k: None)  # as without torch
    monkeypatch.setattr(C, "llama_cpp_available", lambda: False)
    monkeypatch.setattr(C, "missing_extra", lambda: "needs the serve extra (missing: httpx)")
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt_len": p, "max_new_tokens": n, "arrival_s": a})
                               for p, n, a in [(6, 4, 0.0), (12, 3, 0.01), (3, 5, 0.02)]) + "\n")
    out = C.bench_capstone(quick=True, trace=str(trace), config=CONFIG, sweep_points=[(4, 4), (8, 8)])
    skipped = {s["method"]: s["reason"] for s in out["skipped"]}
    assert "numba is not installed" in skipped["int8_numba"]
    assert "torch/transformers not installed" in skipped["hf_transformers"]
    assert "llama-cpp-python is not installed" in skipped["llamacpp"]
    assert "needs the serve extra" in skipped["served"]
    methods = [r["method"] for r in out["results"]]
    assert methods == ["naive", "kv_cache", "static", "continuous", "paged", "prefix_cached", "int8_kv", "int8",
                       "spec_ngram_free", "spec_ngram_copy", "compute_bound"]
    check_records(out, expected_tokens=12)
    assert [r["method"] for r in out["chapter_code"]["results"]] == FP32_METHODS + ["tp2"]
    assert [(p["prompt_len"], p["new_tokens"]) for p in out["sweep"]] == [(4, 4), (8, 8)]


def check_records(out: dict, expected_tokens: int, head_dim: int = CONFIG.head_dim) -> None:
    """Every row has the issue's fields; each bound is its roofline at the run's limits; compute_bound is the
    workload's cached FLOPs at the GEMM rate."""
    limits = out["limits"]
    for k in ("gemm_flops_per_s", "bytes_per_s"):  # the best reading of each: a busy moment only slows one
        assert limits[k] == max(r[k] for r in out["limits_readings"])
    assert out["duration_s"] > 0
    fields = {"method", "tokens_per_s", "bound_tokens_per_s", "bound_kind", "ttft_p50_s", "itl_p50_s", "itl_p99_s",
              "kv_bytes_peak", "weight_bytes"}
    for r in out["results"]:
        assert fields <= set(r), r["method"]
        assert r["bound_kind"] in ("flops", "bytes") and r["tokens_per_s"] > 0
        if r["method"] == "compute_bound":
            continue
        if r["method"] == "served":  # the server stops at eos, which random weights may choose
            assert 0 < r["output_tokens"] <= expected_tokens and r["completed"] == r["num_requests"]
        else:
            assert r["output_tokens"] == expected_tokens, r["method"]
        t_flops, t_bytes = r["flops"] / limits["gemm_flops_per_s"], r["bytes_read"] / limits["bytes_per_s"]
        assert r["bound_kind"] == ("flops" if t_flops >= t_bytes else "bytes"), r["method"]
        assert r["bound_tokens_per_s"] == pytest.approx(expected_tokens / max(t_flops, t_bytes)), r["method"]
        assert not [k for k in r if k.startswith("_")], r["method"]  # the recorded steps are priced, then dropped
        if r["method"].startswith("spec_"):  # offline only, and it says so
            assert r["ttft_p50_s"] is None and "offline throughput only" in r["latency_basis"]
        else:
            assert r["ttft_p50_s"] > 0 and r["itl_p99_s"] >= r["itl_p50_s"] > 0, r["method"]
    by = {r["method"]: r for r in out["results"]}
    cached = by["kv_cache"]["flops"]  # each position once, as chapter 2 computes them
    assert by["compute_bound"]["flops"] == cached
    assert by["compute_bound"]["tokens_per_s"] == pytest.approx(expected_tokens * limits["gemm_flops_per_s"] / cached)
    assert by["naive"]["flops"] > by["kv_cache"]["flops"] == by["continuous"]["flops"] <= by["static"]["flops"]
    assert by["naive"]["kv_bytes_peak"] == 0 < by["kv_cache"]["kv_bytes_peak"] <= by["static"]["kv_bytes_peak"]
    assert by["continuous"]["weight_bytes"] == by["paged"]["weight_bytes"] > 2 * by["int8"]["weight_bytes"]
    # int8 K/V: the same engine as prefix_cached in D + 4 bytes a head where fp32 keeps 4 D
    D = head_dim
    fp32_kv = by["prefix_cached"]["kv_bytes_allocated"]
    assert by["int8_kv"]["kv_bytes_allocated"] == pytest.approx(fp32_kv * (D + 4) / (4 * D))
    assert by["int8_kv"]["weight_bytes"] == by["prefix_cached"]["weight_bytes"]
    assert by["int8_kv"]["bytes_read"] < by["prefix_cached"]["bytes_read"]
    check_step_bounds(out)


FP32_METHODS = ["naive", "kv_cache", "static", "continuous", "paged", "prefix_cached", "int8_kv"]
STEPPED = ("continuous", "paged", "prefix_cached", "int8_kv", "spec_ngram_free", "spec_ngram_copy", "tp2")


def check_step_bounds(out: dict) -> None:
    """Every engine row, with the appendix's kernels and in the chapter code's run, has its per-step bound (its
    steps priced at its own kernels' rates, summed), the time by the steps' rows adding up to its steps and to that
    bound; each row says which kernels ran it; the speculative rows give the plain engine's tokens and count the
    drafts they rejected as work."""
    chapter = out["chapter_code"]["results"]
    assert {r["kernels"] for r in chapter} == {C.CHAPTER_CODE}
    assert {r["kernels"] for r in out["results"] if r["method"] in FP32_METHODS} == {C.ACCELERATED}
    for r in [r for r in out["results"] + chapter if r["method"] in STEPPED]:
        assert r["step_bound_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["step_bound_seconds"])
        assert r["fraction_of_step_bound"] == pytest.approx(r["tokens_per_s"] / r["step_bound_tokens_per_s"])
        t = r["step_time"]
        assert sum(b["steps"] for b in t["by_rows"]) == r["model_steps"], r["method"]
        assert sum(b["bound_s"] for b in t["by_rows"]) == pytest.approx(r["step_bound_seconds"])
        assert 0 < t["forward_s"] < r["seconds"] and t["outside_forward_s"] > 0
    by = {r["method"]: r for r in out["results"]}
    final = by[out["final_method"]]
    assert out["ratios"]["final_fraction_of_step_bound"] == final["fraction_of_step_bound"]
    assert out["targets_met"]["final >= 0.8 x per-step bound"] == (final["fraction_of_step_bound"] >= 0.8)
    for name in ("spec_ngram_free", "spec_ngram_copy"):
        spec = by[name]["speculative"]
        assert spec["identical_to_plain"] and spec["k"] == C.SPEC_K, name
        assert by[name]["flops"] >= by["prefix_cached"]["flops"]
        assert spec["speedup_over_prefix_cached"] == pytest.approx(
            by[name]["tokens_per_s"] / by["prefix_cached"]["tokens_per_s"])
    assert set(out["speculative"]) == {"free_text", "copy_task"}
    assert all(0 <= m["alpha"] <= 1 and m["steps_recorded"] > 0 for m in out["speculative"].values())
    anatomy = out["step_anatomy"]["accelerated"]
    assert anatomy["step_s"] > 0 and anatomy["matmul_s"] > 0 and anatomy["step_matmuls_s"] > 0
    assert anatomy["matmul_ceiling"] == pytest.approx(anatomy["matmul_s"] / anatomy["step_matmuls_s"])
    store = "SlotAttentionKVStore" if numba_available() else "ContiguousKVStore"  # the appendix's with numba
    assert anatomy["store"] == by["continuous"]["kv_store"] == store
    assert out["step_anatomy"]["chapter_code"]["store"] == "ContiguousKVStore"  # the plain model: chapter 3's


def test_the_command_replays_a_trace(tmp_path):
    """``python -m gpt2_core bench capstone --trace FILE --json FILE`` as the README types it (GPT2_QUICK=1: 2
    layers of GPT-2 124M's shape): the trace is what runs, every row of the table is there or skipped with a
    note, and the run states its duration."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(line) for line in [
        {"prompt_len": 12, "max_new_tokens": 6, "arrival_s": 0.0},
        {"prompt": "It is a truth universally acknowledged", "max_new_tokens": 5, "arrival_s": 0.1},
        {"request_id": "third", "prompt_len": 20, "max_new_tokens": 4, "arrival_s": 0.2}]) + "\n")
    out = tmp_path / "capstone.json"
    r = subprocess.run([sys.executable, "-m", "gpt2_core", "bench", "capstone", "--trace", str(trace), "--json",
                        str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT,
                       env={**os.environ, "GPT2_QUICK": "1"})
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["workload"]["name"] == str(trace) and data["workload"]["num_requests"] == 3
    assert data["quick"] is True and "2 layers" in data["model"] and data["duration_s"] > 0
    got = {rec["method"] for rec in data["results"]} | {s["method"] for s in data["skipped"]}
    assert got >= {"naive", "kv_cache", "static", "continuous", "paged", "prefix_cached", "int8_kv", "int8",
                   "int8_numba", "hf_transformers", "compute_bound", "spec_ngram_free", "spec_ngram_copy", "served"}
    if C.llama_cpp_available():  # its two rows, measured (a failure would be a skipped entry with its reason)
        assert {"llamacpp_f32", "llamacpp_q8_0"} <= {rec["method"] for rec in data["results"]}
    else:
        assert "is not installed" in next(s["reason"] for s in data["skipped"] if s["method"] == "llamacpp")
    assert all(s["reason"] for s in data["skipped"])
    check_records(data, expected_tokens=15, head_dim=64)  # GPT-2's widths
    assert data["final_method"] in ("continuous", "paged", "prefix_cached")
    assert "compute_bound" in r.stdout and "sweep" in r.stdout


def test_the_composed_int8_row_adds_the_measured_dequantize_time_to_each_step():
    """A full run composes NumPy's int8 path from the paged row (a full-size step takes about a second): its time
    is the paged run's plus, per step, the time to dequantize every weight; its bytes are the int8 model's."""
    model = tiny_model(config=CONFIG)
    requests = workload(4)
    paged, _ = C.batched_row(model, "paged", requests)
    row = C.composed_quant_row(CONFIG, paged, requests, model)
    added = row["dequantize_seconds_per_step"]
    assert added > 0 and row["seconds"] == pytest.approx(paged["seconds"] + paged["model_steps"] * added)
    assert row["tokens_per_s"] == pytest.approx(paged["output_tokens"] / row["seconds"])
    assert row["flops"] == paged["flops"] and row["bytes_read"] < paged["bytes_read"]
    assert row["ttft_p50_s"] is None and row["itl_p50_s"] == pytest.approx(paged["itl_p50_s"] + added)
