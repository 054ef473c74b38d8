"""Chapter 5's benchmark: its workload, its records, and ``python -m gpt2_core bench prefix --trace FILE --json
FILE`` end to end (GPT2_QUICK=1). The timings themselves are a command, not a test: here only what they are
made of (token counts, blocks, equality of the two attentions) is checked."""

import json
import os
import subprocess
import sys

import numpy as np
from helpers import ROOT

from gpt2_core.bench.paged import for_model, narrow_model
from gpt2_core.bench.prefix import (attention_by_context, itl_during_long_prompts, long_prompt_workload,
                                    parallel_sampling_memory, serve, shared_prefix_workload)
from gpt2_core.bench.workload import load_trace, save_trace


def test_the_workload_shares_a_system_prompt_and_every_turn_resends_the_conversation():
    reqs = shared_prefix_workload(num_conversations=3, turns=3, system_len=40)
    assert len(reqs) == 9 and [r.request_id for r in reqs[:4]] == ["c0t0", "c1t0", "c2t0", "c0t1"]
    system = reqs[0].prompt_token_ids[:40]
    assert all(r.prompt_token_ids[:40] == system for r in reqs)
    by_id = {r.request_id: r for r in reqs}
    for c in range(3):
        for t in range(2):
            earlier, later = by_id[f"c{c}t{t}"], by_id[f"c{c}t{t + 1}"]
            n = len(earlier.prompt_token_ids)
            assert later.prompt_token_ids[:n] == earlier.prompt_token_ids  # the history, resent
            assert len(later.prompt_token_ids) > n + earlier.max_new_tokens  # + the reply + a new message
            assert later.arrival_s > earlier.arrival_s
    assert shared_prefix_workload(num_conversations=3, turns=3, system_len=40)[5].prompt_token_ids == \
        reqs[5].prompt_token_ids  # seeded
    full = shared_prefix_workload()
    assert len(full) == 48 and max(len(r.prompt_token_ids) + r.max_new_tokens for r in full) <= 1024


def test_prefix_caching_serves_the_same_tokens_and_computes_fewer_prompt_tokens():
    small = narrow_model()
    reqs = for_model(shared_prefix_workload(num_conversations=3, turns=2, system_len=64), small)
    records = {m: serve(small, m, reqs, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=256)
               for m in ("paged", "paged_attention", "prefix_cached")}
    prompt = sum(len(r.prompt_token_ids) for r in reqs)
    for r in records.values():
        for key in ("method", "batch", "tokens_per_s", "ttft_p50_s", "prefill_tokens_computed", "itl_p99_s"):
            assert key in r, key
        assert r["num_errors"] == 0 and r["output_tokens"] == sum(q.max_new_tokens for q in reqs)
    assert records["paged"]["prefill_tokens_computed"] == records["paged_attention"]["prefill_tokens_computed"] == prompt
    cached = records["prefix_cached"]
    assert cached["prefill_tokens_saved"] > 64 and 0 < cached["prefix_cache_hit_rate"] < 1
    assert cached["prefill_tokens_computed"] == prompt - cached["prefill_tokens_saved"]


def test_ttft_on_arrivals_counts_from_each_arrival_and_the_workload_spreads_them_evenly():
    """``serve(..., time_scale=...)`` replays the requests at their arrivals on the wall clock: a request's TTFT
    counts from its own arrival, so on a server that keeps up it is about its own prefill, not the queue ahead of
    it; the default workload's arrivals are one every turn_gap_s / num_conversations seconds."""
    reqs = shared_prefix_workload(num_conversations=4, turns=2, system_len=32, turn_gap_s=2.0)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    small = narrow_model()
    reqs = for_model(reqs, small)
    offline = serve(small, "prefix_cached", reqs, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=256)
    paced = serve(small, "prefix_cached", reqs, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=256,
                  time_scale=0.1)
    assert offline["arrivals"] == "offline (all at t=0)" and paced["arrivals"] == "arrival_s x 0.1"
    assert paced["seconds"] >= 0.35 and paced["output_tokens"] == offline["output_tokens"]  # the last came at 0.35 s
    assert paced["num_errors"] == 0


def test_chunked_prefill_spreads_a_long_prompt_over_steps_of_the_chunk_budget():
    small = narrow_model()
    reqs = for_model(long_prompt_workload(2, 8, 100, (2,)), small)
    whole = itl_during_long_prompts(small, reqs, None)
    chunked = itl_during_long_prompts(small, reqs, 24)
    assert max(whole["step_prefill_tokens"]) == 100 and whole["max_num_batched_tokens"] >= 100
    assert max(chunked["step_prefill_tokens"]) <= 24 and chunked["num_steps"] > whole["num_steps"]
    for r in (whole, chunked):
        assert r["itl_p50_s"] <= r["itl_p99_s"] <= r["itl_max_s"] and len(r["long_prompt_ttft_s"]) == 1
        assert len(r["step_seconds"]) == r["num_steps"]


def test_attention_by_context_reads_in_place_what_the_gather_copies():
    rows = attention_by_context(contexts=(32, 80), rounds=1, repeats=1)
    assert [(r["context"], r["layout"]) for r in rows] == [(32, "together"), (32, "scattered"), (80, "together"),
                                                          (80, "scattered")]
    for r in rows:
        assert r["max_abs_difference"] <= 1e-5
        assert r["gather_bytes_copied"] == r["context"] * 2 * 12 * 64 * 4 and r["in_place_bytes_copied"] == 0
        assert r["num_runs"] == (1 if r["layout"] == "together" else -(-r["context"] // 16))


def test_forked_samples_hold_fewer_blocks_than_separate_requests():
    rows = parallel_sampling_memory(prompt_len=40, max_new_tokens=8, ns=(1, 3))
    one, three = rows
    assert one["forked_peak_blocks"] == one["separate_peak_blocks"] == 3  # 47 positions in blocks of 16
    assert three["separate_peak_blocks"] == 9
    assert three["forked_shared_blocks_after_fork"] == 3  # the prompt's 3 blocks, held by all 3 samples
    assert three["forked_copied_blocks"] == 2  # the partly filled last block, copied by 2 of the 3
    assert three["forked_peak_blocks"] == 5


def test_bench_prefix_command_with_a_trace_writes_the_documented_json(tmp_path):
    trace = tmp_path / "chat.jsonl"
    reqs = shared_prefix_workload(num_conversations=2, turns=2, system_len=48, user_len=(8, 0.3, 4, 12),
                                  output_len=(4, 0.2, 2, 6))
    save_trace(reqs, trace, with_token_ids=True)
    assert [r.prompt_token_ids for r in load_trace(trace, 50257)] == [r.prompt_token_ids for r in reqs]
    out = tmp_path / "prefix.json"
    env = dict(os.environ, GPT2_QUICK="1")
    proc = subprocess.run([sys.executable, "-m", "gpt2_core", "bench", "prefix", "--trace", str(trace), "--json",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["benchmark"] == "prefix" and data["workload"]["name"] == f"trace {trace}"
    assert data["workload"]["num_requests"] == 4
    methods = {r["method"]: r for r in data["results"]}
    assert set(methods) == {"paged", "paged_attention", "prefix_cached"}
    for r in methods.values():
        assert r["tokens_per_s"] > 0 and r["ttft_p50_s"] > 0 and r["output_tokens"] == sum(q.max_new_tokens for q in reqs)
        assert r["ttft_p50_offline_s"] > 0 and r["arrivals"] == "offline (all at t=0)"  # throughput: offline
        assert r["ttft_arrivals"] == "arrival_s x 1" and len(r["ttft_p50_s_runs"]) == 1  # TTFT: the trace's arrivals
    assert data["ttft_arrivals"] == "the trace's own arrival times"
    assert methods["prefix_cached"]["prefill_tokens_computed"] < methods["paged"]["prefill_tokens_computed"]
    assert set(data["chunked_prefill"]) == {"whole_prefill", "chunked_prefill"}
    assert all(data["chunked_prefill"][k]["itl_p99_s"] > 0 for k in data["chunked_prefill"])
    for key in ("prefix_cached_over_paged_tokens_per_s", "paged_over_prefix_cached_ttft_p50",
                "whole_over_chunked_itl_p99"):
        assert np.isfinite(data["ratios"][key])
    assert len(data["targets_met"]) == 3 and data["kernels"] == "cpu_kernels.accelerate"
    assert "prefix_cached" in proc.stdout
