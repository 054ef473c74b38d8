"""Chapter 5's benchmark: ``python -m gpt2_core bench prefix [--trace PATH] [--json PATH] [--quick]``.

On GPT-2 124M-shaped random weights (float32, ``cpu_kernels.accelerate``), in one process:

* **prefix caching** (``results``): a chat workload whose prompts share long prefixes (``shared_prefix_workload``:
  one system prompt of a few hundred tokens for everyone, conversations that resend their history every turn), or
  a JSONL trace, served by chapter 4's engine over the paged store (``paged``), by chapter 5's engine without its
  scheduling features (``paged_attention``: only decode attention changes) and with prefix caching
  (``prefix_cached``), interleaved round by round. Throughput is measured offline (all submitted at t=0, eos
  ignored; as vLLM's throughput benchmark does), the run with the median throughput reported:
  ``tokens_per_s``, ``prefill_tokens_computed``, the cache's hit rate. Time to first token is measured on
  arrivals (as vLLM's serving benchmark does; offline, TTFT is mostly the wait for one of ``max_num_seqs``
  places, the same count of steps for every engine): ``paged`` and ``prefix_cached`` replayed on the wall clock,
  the default workload's requests spread evenly at ``ARRIVAL_LOAD`` of chapter 4's offline capacity measured in
  the same run (a trace: its own arrival times), the median of the rounds in ``ttft_p50_s`` (the offline one in
  ``ttft_p50_offline_s``);
* **chunked prefill** (``chunked_prefill``): decoding requests while long prompts arrive (on the step clock), with
  the whole prompt in one step (``max_num_batched_tokens`` large) and in chunks (small): the decodes' inter-token
  latency (``itl_p99_s``) and the long prompts' time to first token;
* **paged attention** (``attention_by_context``): one decode attention of one layer, K/V gathered (chapter 4)
  against read in place by runs (chapter 5), at contexts 64-1024, with the blocks allocated together (one run) or
  scattered (a run per block): seconds and K/V bytes copied;
* **parallel sampling** (``parallel_sampling``): KV blocks held by ``n`` samples forked from one prompt against
  ``n`` separate requests (memory depends only on token counts: a narrow model, in seconds).
"""

from __future__ import annotations

import time

import numpy as np

from ..ch04_paged.block_manager import blocks_needed
from ..ch05_sharing.caching_engine import CachingLLMEngine
from ..loading.config import GPT2Config
from ..a1_cpu_kernels import accelerate
from ..ch03_batching.engine import LLMEngine
from ..ch01_forward.model import decode_attention
from ..ch05_sharing.paged_attention import PagedAttentionKVStore, contiguous_runs
from ..ch04_paged.paged_kv_store import PagedKVStore
from ..ch05_sharing.prefix_cache import PrefixCachingKVStore
from ..ch03_batching.sequence import Request
from ..loading.weights import GPT2Model, random_model
from . import progress
from .common import QUICK, interleaved, median_time
from .paged import fresh, narrow_model
from .replay import replay
from .workload import load_trace, lognormal_lengths, random_prompt, summarize

BLOCK_SIZE = 16
ARRIVAL_LOAD = 0.8  # TTFT's arrivals: this fraction of chapter 4's offline capacity (requests/s), evenly spread


def shared_prefix_workload(num_conversations: int = 12, turns: int = 4, system_len: int = 384,
                           user_len=(24, 0.5, 8, 64), output_len=(32, 0.4, 16, 64), seed: int = 0,
                           vocab_size: int = 50257, turn_gap_s: float = 2.0) -> list[Request]:
    """Chat traffic whose prompts share long prefixes. Every conversation starts with the same system prompt of
    ``system_len`` tokens; turn ``t`` of a conversation resends the system prompt, the earlier turns (each user
    message and the reply to it) and a new user message. Lengths of user messages and replies are clipped
    log-normals (median, sigma, low, high); the replies in the history are fixed tokens of the trace (the replies a
    server generates differ, so only the earlier *prompts* can be found cached). Requests come turn by turn,
    evenly, one every ``turn_gap_s / num_conversations`` seconds, conversation by conversation, so that each
    conversation's turns come ``turn_gap_s`` apart (``arrival_s``); greedy, eos ignored. Random token ids, seeded."""
    rng = np.random.default_rng(seed)
    system = random_prompt(vocab_size, system_len, seed * 100_003 + 99_991)
    history = [list(system) for _ in range(num_conversations)]
    requests = []
    for t in range(turns):
        users = lognormal_lengths(rng, num_conversations, *user_len)
        outputs = lognormal_lengths(rng, num_conversations, *output_len)
        for c in range(num_conversations):
            prompt = history[c] + rng.integers(0, vocab_size, size=users[c]).tolist()
            requests.append(Request(f"c{c}t{t}", prompt, max_new_tokens=outputs[c], stop_at_eos=False,
                                    arrival_s=round((t + c / num_conversations) * turn_gap_s, 4)))
            history[c] = prompt + rng.integers(0, vocab_size, size=outputs[c]).tolist()  # the reply, resent
    return requests


def serve(model: GPT2Model, method: str, requests: list[Request], num_blocks: int, max_num_seqs: int,
          max_num_batched_tokens: int = 2048, time_scale: float | None = None) -> dict:
    """Serve ``requests`` with ``method``'s engine and store; one benchmark record. Offline (``time_scale``
    None: all submitted at t=0), or replayed at their arrivals on the wall clock, ``arrival_s * time_scale``
    seconds after the start (``tokens_per_s`` then counts the idle time between arrivals too)."""
    if method == "paged":  # chapter 4: chapter 3's engine over the paged store (gather, no sharing)
        engine = LLMEngine(model, store=PagedKVStore(model.config, num_blocks, BLOCK_SIZE),
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    else:
        engine = CachingLLMEngine(model, PrefixCachingKVStore(model.config, num_blocks, BLOCK_SIZE),
                                  max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  enable_prefix_caching=method == "prefix_cached", enable_chunked_prefill=False)
    t0 = time.perf_counter()
    if time_scale is None:
        outputs = engine.generate_many(fresh(requests))
    else:
        outputs = replay(engine, fresh(requests), clock="wall", time_scale=time_scale)
    seconds = time.perf_counter() - t0
    s = summarize(outputs, duration_s=seconds)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    computed = sum(x.num_batched_tokens - x.num_decode_seqs for x in engine.step_stats)  # prefill rows run
    record = {"method": method, "batch": max_num_seqs, "tokens_per_s": s["output_tokens"] / seconds,
              "ttft_p50_s": s["p50_ttft_s"], "ttft_mean_s": s["mean_ttft_s"], "ttft_p99_s": s["p99_ttft_s"],
              "itl_p50_s": s["p50_itl_s"], "itl_p99_s": s["p99_itl_s"], "prefill_tokens_computed": computed,
              "prompt_tokens": prompt_tokens, "output_tokens": s["output_tokens"], "seconds": seconds,
              "num_steps": engine.num_steps, "num_preemptions": engine.scheduler.num_preemptions,
              "num_errors": s["num_errors"], "num_blocks": num_blocks, "block_size": BLOCK_SIZE,
              "arrivals": "offline (all at t=0)" if time_scale is None else f"arrival_s x {time_scale:.4g}"}
    if isinstance(engine, CachingLLMEngine):
        stats = engine.prefix_cache_stats()
        record.update(prefix_cache_hit_rate=stats["hit_rate"], prefill_tokens_saved=stats["hit_tokens"],
                      cached_blocks=stats["cached_blocks"], evictions=stats["evictions"])
    return record


def long_prompt_workload(num_decoders: int, decode_len: int, long_len: int, long_at_steps) -> list[Request]:
    """Decoding requests (short prompts) from step 0, and long prompts arriving at ``long_at_steps`` (the step
    clock of ``replay``). Random ids: nothing is shared."""
    reqs = [Request(f"d{i}", random_prompt(50257, 32, 1_000 + i), max_new_tokens=decode_len, stop_at_eos=False,
                    arrival_s=0.0) for i in range(num_decoders)]
    reqs += [Request(f"long{j}", random_prompt(50257, long_len, 2_000 + j), max_new_tokens=4, stop_at_eos=False,
                     arrival_s=float(step)) for j, step in enumerate(long_at_steps)]
    return reqs


def itl_during_long_prompts(model: GPT2Model, requests: list[Request], chunk_tokens: int | None) -> dict:
    """Replay ``requests`` on the step clock with chunked prefill (chunks of ``chunk_tokens``) or without
    (``None``: the budget holds the longest prompt and the decodes); the decodes' inter-token latencies."""
    longest = max(len(r.prompt_token_ids) for r in requests)
    budget = chunk_tokens or longest + len(requests)
    num_blocks = sum(blocks_needed(len(r.prompt_token_ids) + r.max_new_tokens, BLOCK_SIZE) for r in requests)
    engine = CachingLLMEngine(model, PrefixCachingKVStore(model.config, num_blocks, BLOCK_SIZE),
                              max_num_seqs=len(requests), max_num_batched_tokens=max(budget, len(requests)),
                              enable_prefix_caching=False, enable_chunked_prefill=chunk_tokens is not None)
    t0 = time.perf_counter()
    outputs = replay(engine, fresh(requests), clock="steps")
    decodes = [o for o in outputs if str(o.request_id).startswith("d")]
    gaps = np.array([g for o in decodes for g in o.metrics.inter_token_latencies])
    longs = [o for o in outputs if str(o.request_id).startswith("long")]
    return {"method": "chunked_prefill" if chunk_tokens else "whole_prefill", "max_num_batched_tokens": budget,
            "num_decodes": len(decodes), "long_prompt_lens": [len(o.prompt_token_ids) for o in longs],
            "itl_p50_s": float(np.percentile(gaps, 50)), "itl_p99_s": float(np.percentile(gaps, 99)),
            "itl_max_s": float(gaps.max()), "long_prompt_ttft_s": [o.metrics.time_to_first_token for o in longs],
            "num_steps": engine.num_steps, "seconds": time.perf_counter() - t0,
            "step_end_s": [round(s.end_time - t0, 4) for s in engine.step_stats],
            "step_seconds": [round(s.end_time - s.start_time, 5) for s in engine.step_stats],
            "step_prefill_tokens": [s.num_batched_tokens - s.num_decode_seqs for s in engine.step_stats]}


def attention_by_context(contexts=(64, 128, 256, 512, 1024), rounds: int = 5, repeats: int = 20) -> list[dict]:
    """One decoding token's attention in one layer of GPT-2 124M's shape, at each context: chapter 4's gather then
    ``decode_attention`` against chapter 5's ``paged_decode_attention`` over the blocks in place, with the
    sequence's blocks allocated together or scattered (4 sequences grown a block at a time, in turns)."""
    gpt2 = GPT2Config()
    cfg = GPT2Config(n_layer=1, n_head=gpt2.n_head, n_embd=gpt2.n_embd, n_positions=max(contexts))
    H, D = cfg.n_head, cfg.head_dim
    rng = np.random.default_rng(0)
    q = rng.standard_normal((H, 1, D), dtype=np.float32) * np.float32(1 / np.sqrt(D))
    k, v = rng.standard_normal((2, H, 1, D), dtype=np.float32)
    rows = []
    for S in contexts:
        for layout in ("together", "scattered"):
            seqs = 1 if layout == "together" else 4
            stores = {"gather": PagedKVStore(cfg, seqs * blocks_needed(S, BLOCK_SIZE), BLOCK_SIZE),
                      "in_place": PagedAttentionKVStore(cfg, seqs * blocks_needed(S, BLOCK_SIZE), BLOCK_SIZE)}
            stores["in_place"].run_cost_tokens = 0  # in place however many runs: that is what is timed
            for store in stores.values():
                for s in range(seqs):
                    store.allocate(s, S if seqs == 1 else min(S, BLOCK_SIZE))
                for n in range(2 * BLOCK_SIZE, S + BLOCK_SIZE, BLOCK_SIZE):  # grow in turns: blocks interleave
                    for s in range(seqs):
                        store.ensure(s, min(n, S))
                store.kv[...] = np.random.default_rng(S).standard_normal(store.kv.shape, dtype=np.float32)
            runs = {name: (lambda st=st: st.attend_decode(0, 0, S - 1, q, k, v)) for name, st in stores.items()}
            error = float(np.abs(runs["gather"]() - runs["in_place"]()).max())
            times = interleaved(runs, rounds, lambda f, r: median_time(f, repeats=repeats, warmup=2))
            gather_s, in_place_s = float(np.median(times["gather"])), float(np.median(times["in_place"]))
            num_runs = len(contiguous_runs(stores["in_place"].slots[0][:S]))
            rows.append({"context": S, "layout": layout, "num_runs": num_runs,
                         "gather_s": gather_s, "in_place_s": in_place_s, "in_place_over_gather": in_place_s / gather_s,
                         "gather_bytes_copied": S * 2 * H * D * 4, "in_place_bytes_copied": 0,
                         "max_abs_difference": error})
    return rows


def parallel_sampling_memory(prompt_len: int = 390, max_new_tokens: int = 64, ns=(1, 2, 4, 8)) -> list[dict]:
    """KV blocks of ``n`` samples of one prompt forked (chapter 5) against ``n`` separate requests with the same
    prompt (chapter 4's engine: nothing shared), held during each step: the peak, and the blocks shared after the
    fork and copied on write."""
    model = narrow_model()
    prompt = random_prompt(model.config.vocab_size, prompt_len, 7)
    per_seq = blocks_needed(prompt_len + max_new_tokens, BLOCK_SIZE)
    rows = []
    for n in ns:
        store = PrefixCachingKVStore(model.config, n * per_seq, BLOCK_SIZE)
        engine = CachingLLMEngine(model, store, max_num_seqs=max(ns), max_num_batched_tokens=prompt_len + max(ns),
                                  enable_prefix_caching=False)
        engine.add_request(Request("r", prompt, max_new_tokens, stop_at_eos=False), n=n)
        engine.step()  # the prefill, then the fork: every block of the prompt shared
        shared = sum(c > 1 for c in store.manager.allocator.ref_count)
        engine.run_until_done()
        separate = PagedKVStore(model.config, n * per_seq, BLOCK_SIZE)
        other = LLMEngine(model, store=separate, max_num_seqs=max(ns),
                          max_num_batched_tokens=n * (prompt_len + max_new_tokens))
        other.generate_many([Request(i, prompt, max_new_tokens, stop_at_eos=False) for i in range(n)])
        used = [s.kv_reserved_tokens // BLOCK_SIZE for s in engine.step_stats]  # blocks held during each step
        separate_used = [s.kv_reserved_tokens // BLOCK_SIZE for s in other.step_stats]
        rows.append({"n": n, "prompt_len": prompt_len, "max_new_tokens": max_new_tokens, "block_size": BLOCK_SIZE,
                     "forked_peak_blocks": max(used), "separate_peak_blocks": max(separate_used),
                     "forked_shared_blocks_after_fork": shared,
                     "forked_copied_blocks": store.manager.num_copied_blocks,
                     "forked_blocks_per_step": used, "separate_blocks_per_step": separate_used})
    return rows


def bench_prefix(quick: bool = QUICK, trace: str | None = None) -> dict:
    model = accelerate(random_model("gpt2", seed=0))  # the appendix's kernels under chapters 3-5's code
    cfg = model.config
    if trace is not None:
        requests = load_trace(trace, cfg.vocab_size, tokenizer=model.tokenizer)
        source = f"trace {trace}"
    elif quick:
        requests = shared_prefix_workload(num_conversations=3, turns=2, system_len=96, user_len=(16, 0.5, 8, 32),
                                          output_len=(8, 0.3, 4, 16))
        source = "shared_prefix_workload(num_conversations=3, turns=2, system_len=96)"
    else:
        requests = shared_prefix_workload()
        source = "shared_prefix_workload(num_conversations=12, turns=4, system_len=384)"
    max_num_seqs = 8
    longest = min(max(len(r.prompt_token_ids) + r.max_new_tokens for r in requests), cfg.n_positions)
    budget = 1 << (longest - 1).bit_length()  # the longest request's positions, to a power of two: a whole prompt
    num_blocks = max_num_seqs * blocks_needed(longest, BLOCK_SIZE)  # fits one step (chapter 3's rule); nothing
    methods = ("paged", "paged_attention", "prefix_cached")
    runs: dict = {m: [] for m in methods}
    rounds, arrival_rounds, chunk_rounds = (1, 1, 1) if quick else (3, 2, 2)  # units: rough shares of a run
    progress.plan(20 + 5 * 3 * rounds + 6 * 3 * arrival_rounds + 6 * 2 * chunk_rounds + 15, "warming up")

    def one_run(method, r):
        runs[method].append(serve(model, method, requests, num_blocks, max_num_seqs, budget))  # is preempted
        progress.advance(5, f"offline throughput, {method} done")
        return runs[method][-1]["seconds"]

    for m in methods:  # warm-up, untimed: the kernels' first steps build what they keep (the appendix)
        serve(model, m, requests[:2], num_blocks, max_num_seqs, budget)
    progress.advance(20, "offline throughput")
    interleaved({m: m for m in methods}, rounds, one_run)  # order reversed every other round
    progress.advance(0, "time to first token with requests arriving")
    results = []
    for m in methods:
        best = sorted(runs[m], key=lambda x: x["tokens_per_s"])[len(runs[m]) // 2]  # the median run
        results.append(dict(best, experiment="shared_prefix", rounds=rounds,
                            tokens_per_s_runs=[x["tokens_per_s"] for x in runs[m]]))
    paged, paged_attention, cached = results
    # time to first token on arrivals: the default workload at ARRIVAL_LOAD of chapter 4's capacity, a trace as is
    capacity = len(requests) / paged["seconds"]  # requests/s, offline
    span = max(r.arrival_s for r in requests)
    time_scale = 1.0 if trace is not None or span == 0 else (len(requests) - 1) / span / (ARRIVAL_LOAD * capacity)
    on_arrivals: dict = {m: [] for m in methods}
    interleaved({m: m for m in methods}, arrival_rounds, lambda m, r: (on_arrivals[m].append(
        serve(model, m, requests, num_blocks, max_num_seqs, budget, time_scale)), progress.advance(6)))
    progress.advance(0, "decodes while long prompts are prefilled, whole or in chunks")
    for record in results:
        got = on_arrivals[record["method"]]
        record.update(ttft_p50_offline_s=record["ttft_p50_s"], ttft_p99_offline_s=record["ttft_p99_s"],
                      ttft_p50_s=float(np.median([x["ttft_p50_s"] for x in got])),
                      ttft_p99_s=float(np.median([x["ttft_p99_s"] for x in got])),
                      ttft_p50_s_runs=[x["ttft_p50_s"] for x in got], ttft_arrivals=got[0]["arrivals"],
                      arrival_requests_per_s=(len(requests) - 1) / (span * time_scale) if span else None)
    # chunked prefill: decodes while long prompts arrive
    if quick:
        long_requests, chunk = long_prompt_workload(3, 16, 256, (3, 9)), 64
    else:
        long_requests, chunk = long_prompt_workload(8, 96, 896, (8, 36, 64)), 256
    chunked = {"whole_prefill": [], "chunked_prefill": []}
    interleaved({"whole_prefill": None, "chunked_prefill": chunk}, chunk_rounds,
                lambda c, r: (chunked["chunked_prefill" if c else "whole_prefill"].append(
                    itl_during_long_prompts(model, long_requests, c)), progress.advance(6)))
    progress.advance(0, "decode attention in place against the gather; forked samples' blocks")
    chunked_records = {}
    for name, rs in chunked.items():
        chunked_records[name] = dict(sorted(rs, key=lambda x: x["itl_p99_s"])[len(rs) // 2],
                                     itl_p99_s_runs=[x["itl_p99_s"] for x in rs])
    attention = attention_by_context((64, 256) if quick else (64, 128, 256, 512, 1024), rounds=3 if quick else 7)
    sampling = parallel_sampling_memory(prompt_len=100 if quick else 390, max_new_tokens=16 if quick else 64,
                                        ns=(1, 2, 4) if quick else (1, 2, 4, 8))
    whole, chunks = chunked_records["whole_prefill"], chunked_records["chunked_prefill"]
    ratios = {
        "prefix_cached_over_paged_tokens_per_s": cached["tokens_per_s"] / paged["tokens_per_s"],
        "paged_over_prefix_cached_ttft_p50": paged["ttft_p50_s"] / cached["ttft_p50_s"],
        "paged_attention_over_paged_tokens_per_s": paged_attention["tokens_per_s"] / paged["tokens_per_s"],
        "prefill_tokens_computed_paged_over_prefix_cached":
            paged["prefill_tokens_computed"] / cached["prefill_tokens_computed"],
        "prefix_cache_hit_rate": cached["prefix_cache_hit_rate"],
        "whole_over_chunked_itl_p99": whole["itl_p99_s"] / chunks["itl_p99_s"],
    }
    targets = {"prefix_cached_over_paged_tokens_per_s >= 2": ratios["prefix_cached_over_paged_tokens_per_s"] >= 2,
               "paged_over_prefix_cached_ttft_p50 >= 3": ratios["paged_over_prefix_cached_ttft_p50"] >= 3,
               "whole_over_chunked_itl_p99 >= 2": ratios["whole_over_chunked_itl_p99"] >= 2}
    return {"benchmark": "prefix", "model": "random GPT-2 124M shape, float32", "kernels": "cpu_kernels.accelerate",
            "quick": quick, "workload": {"name": source, "num_requests": len(requests),
                                         "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                                         "output_tokens": sum(r.max_new_tokens for r in requests)},
            "max_num_seqs": max_num_seqs, "max_num_batched_tokens": budget,
            "ttft_arrivals": "the trace's own arrival times" if trace is not None else
            f"evenly spread at {ARRIVAL_LOAD} x chapter 4's offline capacity ({capacity:.3g} requests/s)",
            "results": results, "ratios": ratios,
            "targets_met": targets,
            "chunked_prefill": chunked_records, "attention_by_context": attention, "parallel_sampling": sampling}
