"""Chapter 4's benchmark: ``python -m gpt2_core bench paged [--trace PATH] [--json PATH] [--quick]``.

Chapter 3's engine and scheduler run the same workload over the two KV stores, in the same process, and we
measure what the store changes:

* **equal budget**: the same bytes of KV memory, as chapter 3's ``max_len`` slots or as 16-token blocks: how
  many sequences run at once, the throughput, and the utilisation of the reserved memory (tokens holding live K/V
  / tokens reserved, summed over the steps);
* **equal batch**: the same ``max_num_seqs`` and a budget where nothing is preempted, so both stores run the very
  same schedule and the ratio of throughputs is the price of the gather through the block table;
* **budget sweep**: concurrency, throughput and preemptions as the budget shrinks;
* **block size**: internal fragmentation of the last block, measured in the engine, against ``block_size``.

Throughput and timings come from random weights of GPT-2 124M's shape (the time of a matmul does not depend on
the numbers in it). Memory accounting depends only on token counts, so the block-size sweep uses a narrow model
with GPT-2's vocabulary and context: the same schedule, in seconds instead of minutes. Requests are served
offline (all submitted at t=0, as vLLM's throughput benchmark does), so that memory, not the arrival rate, is
what limits concurrency; eos is ignored, so every run generates exactly the same tokens.
"""

from __future__ import annotations

import time

import numpy as np

from ..loading.config import GPT2Config
from ..ch03_batching.engine import LLMEngine
from ..ch02_kv_cache.kv_cache import kv_cache_bytes
from ..ch03_batching.kv_store import ContiguousKVStore, KVStore
from .common import QUICK
from ..ch04_paged.paged_kv_store import PagedKVStore
from ..ch03_batching.sequence import Request
from ..a1_cpu_kernels import accelerate
from ..loading.weights import GPT2Model, random_model
from .workload import load_trace, standard_workload, summarize

SLOT_LEN = 512  # chapter 3's max_len for the standard workload: its longest request (256 prompt + 256 output)


def fresh(requests: list[Request]) -> list[Request]:
    """Copies of ``requests`` that an engine may consume (each engine needs its own)."""
    return [Request(r.request_id, list(r.prompt_token_ids), r.max_new_tokens, r.sampling_params, r.stop_token_id,
                    r.stop_at_eos, r.arrival_s) for r in requests]


def contiguous_store(config: GPT2Config, budget_bytes: int, max_len: int = SLOT_LEN) -> ContiguousKVStore:
    """Chapter 3's store with as many ``max_len`` slots as fit in ``budget_bytes``."""
    return ContiguousKVStore(config, num_slots=max(1, budget_bytes // kv_cache_bytes(config, max_len)),
                             max_len=max_len)


def kv_utilisation(engine: LLMEngine) -> float:
    """Tokens holding live K/V / tokens reserved, summed over every step (each step weighs the same)."""
    steps = [s for s in engine.step_stats if s.kv_reserved_tokens]
    return sum(s.kv_used_tokens for s in steps) / max(1, sum(s.kv_reserved_tokens for s in steps))


def run(model: GPT2Model, store: KVStore, requests: list[Request], max_num_seqs: int,
        max_num_batched_tokens: int = 2048, series: bool = False) -> dict:
    """Serve ``requests`` offline with chapter 3's engine over ``store``; one benchmark record."""
    engine = LLMEngine(model, store=store, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    t0 = time.perf_counter()
    outputs = engine.generate_many(fresh(requests))
    seconds = time.perf_counter() - t0
    summary = summarize(outputs, duration_s=seconds)
    stats = engine.step_stats
    dt = np.array([s.end_time - s.start_time for s in stats])
    used = np.array([s.kv_used_tokens for s in stats], dtype=float)
    reserved = np.array([s.kv_reserved_tokens for s in stats], dtype=float)
    record = {
        "method": "contiguous" if isinstance(store, ContiguousKVStore) else "paged",
        "batch": max_num_seqs,
        "tokens_per_s": summary["output_tokens"] / seconds,
        "max_concurrent": max(s.kv_slots_in_use for s in stats),
        "mean_concurrent": float(np.mean([s.kv_slots_in_use for s in stats])),
        "kv_utilisation": kv_utilisation(engine),
        "kv_utilisation_time_weighted": float((used * dt).sum() / max(1e-12, (reserved * dt).sum())),
        "budget_bytes": int(store.nbytes),
        "capacity_tokens": store.capacity_tokens(),
        "num_preemptions": engine.scheduler.num_preemptions,
        "num_steps": engine.num_steps,
        "output_tokens": summary["output_tokens"],
        "num_errors": summary["num_errors"],
        "seconds": seconds,
        "mean_ttft_s": summary["mean_ttft_s"],
        "mean_itl_s": summary["mean_itl_s"],
    }
    if isinstance(store, ContiguousKVStore):
        record["max_len"], record["num_slots"] = store.max_len, store.num_slots
    else:
        record["block_size"], record["num_blocks"] = store.block_size, store.num_blocks
    if series:  # per step: time since the start, tokens live, tokens reserved, sequences running
        record["series"] = {"t_s": [round(s.end_time - t0, 4) for s in stats], "used_tokens": used.astype(int).tolist(),
                            "reserved_tokens": reserved.astype(int).tolist(),
                            "running": [s.kv_slots_in_use for s in stats]}
    return record


def narrow_model(n_positions: int = 1024, vocab_size: int = 512) -> GPT2Model:
    """GPT-2's context, a tiny width and vocabulary: for memory accounting, which depends only on token counts.
    With eos ignored the schedule depends only on the requests' lengths, so it is the 124M model's schedule."""
    return random_model(GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=32, n_head=2, n_layer=1),
                        seed=0)


def for_model(requests: list[Request], model: GPT2Model) -> list[Request]:
    """``requests`` with their prompt ids folded into ``model``'s vocabulary (same lengths, same schedule)."""
    out = fresh(requests)
    for r in out:
        r.prompt_token_ids = [t % model.config.vocab_size for t in r.prompt_token_ids]
    return out


def block_size_sweep(requests: list[Request], config: GPT2Config, budget_tokens: int,
                     block_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256), max_num_seqs: int = 256) -> list[dict]:
    """Measured utilisation and preemptions of the paged store against ``block_size`` at one budget (in tokens)."""
    model = narrow_model(config.n_positions)
    requests = for_model(requests, model)
    rows = []
    for bs in block_sizes:
        store = PagedKVStore(model.config, num_blocks=max(1, budget_tokens // bs), block_size=bs)
        r = run(model, store, requests, max_num_seqs)
        rows.append({"block_size": bs, "kv_utilisation": r["kv_utilisation"],
                     "internal_fragmentation": 1 - r["kv_utilisation"], "max_concurrent": r["max_concurrent"],
                     "mean_concurrent": r["mean_concurrent"], "num_preemptions": r["num_preemptions"]})
    return rows


def bench_paged(quick: bool = QUICK, trace: str | None = None) -> dict:
    model = accelerate(random_model("gpt2", seed=0))  # the appendix's kernels under chapters 3-4's code
    cfg = model.config
    if trace is not None:
        requests = load_trace(trace, cfg.vocab_size, tokenizer=model.tokenizer)
        source = f"trace {trace}"
    else:
        requests = standard_workload(num_requests=8 if quick else 48)
        source = f"standard_workload({len(requests)})"
    slot_len = max(min(SLOT_LEN, cfg.n_positions), max(len(r.prompt_token_ids) + r.max_new_tokens for r in requests))
    slot_bytes = kv_cache_bytes(cfg, slot_len)
    slots = [2, 4] if quick else [2, 4, 8, 16]  # budgets, in chapter 3 slots of slot_len tokens
    equal_slots = 4 if quick else 8
    results = []

    def tag(record, experiment, **extra):
        record.update(experiment=experiment, **extra)
        results.append(record)
        return record

    # equal budget (and the budget sweep): contiguous slots vs blocks in the same bytes
    series = {}
    for n in slots:
        budget = n * slot_bytes
        c = run(model, contiguous_store(cfg, budget, slot_len), requests, max_num_seqs=n, series=n == equal_slots)
        p = run(model, PagedKVStore.from_budget(cfg, budget, 16), requests, max_num_seqs=256, series=n == equal_slots)
        for r in (c, p):
            if "series" in r:
                series[r["method"]] = r.pop("series")
            tag(r, "equal_budget" if n == equal_slots else "budget_sweep", budget_slots=n)
    # equal batch: same max_num_seqs, a budget where the paged store never preempts: the same schedule
    eq_requests = requests[: max(4, len(requests) // 2)]
    repeats = 2 if quick else 3
    pair = {"contiguous": [], "paged": []}
    for _ in range(repeats):  # interleaved, so that a change in the machine's load hits both
        budget = equal_slots * slot_bytes
        pair["contiguous"].append(run(model, contiguous_store(cfg, budget, slot_len), eq_requests, equal_slots))
        pair["paged"].append(run(model, PagedKVStore.from_budget(cfg, budget, 16), eq_requests, equal_slots))
    for method, runs in pair.items():
        best = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]  # the median run
        tag(dict(best), "equal_batch", repeats=repeats, tokens_per_s_runs=[r["tokens_per_s"] for r in runs])
    # block size: fragmentation measured in the engine, at the equal-budget point
    sweep = block_size_sweep(requests, cfg, budget_tokens=equal_slots * slot_len)

    def get(experiment, method, **kw):
        return next(r for r in results if r["experiment"] == experiment and r["method"] == method and
                    all(r.get(k) == v for k, v in kw.items()))

    eb_c, eb_p = get("equal_budget", "contiguous"), get("equal_budget", "paged")
    ratios = {
        "paged_over_contiguous_max_concurrent_equal_budget": eb_p["max_concurrent"] / eb_c["max_concurrent"],
        "paged_over_contiguous_mean_concurrent_equal_budget": eb_p["mean_concurrent"] / eb_c["mean_concurrent"],
        "paged_over_contiguous_tokens_per_s_equal_budget": eb_p["tokens_per_s"] / eb_c["tokens_per_s"],
        "paged_over_contiguous_tokens_per_s_equal_batch": float(np.median(
            [p["tokens_per_s"] / c["tokens_per_s"] for c, p in zip(pair["contiguous"], pair["paged"])])),
        "paged_kv_utilisation_equal_budget": eb_p["kv_utilisation"],
        "contiguous_kv_utilisation_equal_budget": eb_c["kv_utilisation"],
    }
    targets = {"paged_over_contiguous_tokens_per_s_equal_batch >= 0.9":
               ratios["paged_over_contiguous_tokens_per_s_equal_batch"] >= 0.9,
               "paged_kv_utilisation_equal_budget >= 0.95": ratios["paged_kv_utilisation_equal_budget"] >= 0.95,
               "paged_over_contiguous_max_concurrent_equal_budget >= 2.5":
               ratios["paged_over_contiguous_max_concurrent_equal_budget"] >= 2.5}
    return {"benchmark": "paged", "model": "random GPT-2 124M shape, float32", "quick": quick,
            "kernels": "cpu_kernels.accelerate", "workload": source,
            "slot_len": slot_len, "equal_budget_slots": equal_slots, "results": results, "ratios": ratios,
            "targets_met": targets, "block_size_sweep": sweep, "series_equal_budget": series}
