"""Chapter 8's benchmark: one process against two (tensor parallel, pipeline), decode at batch 1 and 32, and the
pipeline's bubble against (p-1)/(m+p-1).

Every method runs the same batched chapter-1 code (``tensor_parallel.shard_forward``): in this process on the whole
model with 1 or 2 BLAS threads, or split over two worker processes of 1 BLAS thread each. Methods take turns in
every round (``interleaved``), so the machine's drift falls on all of them; each reading is the decode time of
``steps`` greedy steps after a prefill, and all methods must give the same tokens (checked and recorded).

The same split as the model step of chapter 5's engine (``tp_runner``): ``batch`` requests served at once by
``CachingLLMEngine`` (continuous batching, paged KV), its forward in this process or on two workers
(``engine_*`` methods; end-to-end tokens/s, prefill included; same tokens checked).

The third way to use two cores, **replicas behind a router** (``bench.router``): chapter 5's shared-prefix chat
workload over HTTP on two ``serve`` replicas of 1 thread each behind ``route`` (``round_robin``,
``prefix_affinity``) and on one server of 2 threads (``single_2threads_server``): prefix-cache hit rate, TTFT and
throughput per arm, in two scenarios (chapter 5's defaults with room in every cache; a history-heavy chat with KV
memory for 2,048 tokens per replica), and whether cache-aware routing reaches 1.5x round robin's hit rate in the
second.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import numpy as np

from ..ch03_batching.sequence import Request
from ..ch04_paged.block_manager import blocks_needed
from ..ch05_sharing.caching_engine import CachingLLMEngine
from ..ch05_sharing.prefix_cache import PrefixCachingKVStore
from ..loading.config import preset
from ..ch08_parallel.pipeline_parallel import PipelineModel, bubble_fraction, ideal_bubble
from ..ch08_parallel.tensor_parallel import BatchKVCache, TensorParallelModel, no_communication, shard_forward
from ..ch08_parallel.tp_runner import TensorParallelRunner
from ..loading.weights import random_model
from . import progress
from .common import QUICK, blas_threads, interleaved
from .router import missing_extra, router_records

BATCHES = (1, 32)
MICRO_BATCHES = (1, 2, 4, 8)


def single_process(model, prompts: np.ndarray, steps: int, threads: int) -> dict:
    """The whole model in this process: prefill, then ``steps`` greedy decode steps (timed)."""
    cfg, p = model.config, model.params
    B, T = prompts.shape
    cache = BatchKVCache(cfg.n_layer, B, cfg.n_head, T + steps + 1, cfg.head_dim)
    with blas_threads(threads):
        x = (p["wte"][prompts] + p["wpe"][:T]).reshape(B * T, -1)
        logits = shard_forward(p, x, cfg.n_head, cfg.layer_norm_epsilon, B, cache, no_communication, True)
        tokens = [logits.argmax(axis=-1)]
        t0 = time.perf_counter()
        for step in range(steps):
            x = p["wte"][tokens[-1]] + p["wpe"][T + step]  # [B, E]
            logits = shard_forward(p, x, cfg.n_head, cfg.layer_norm_epsilon, B, cache, no_communication, True)
            tokens.append(logits.argmax(axis=-1))
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": np.stack(tokens, 1), "comm_s": 0.0, "comm_bytes": 0}


def tensor_parallel(tp: TensorParallelModel, prompts: np.ndarray, steps: int) -> dict:
    logits = tp.prefill(prompts, capacity=prompts.shape[1] + steps + 1, last_only=True)
    tokens, comm_s, comm_bytes = [logits.argmax(axis=-1)], 0.0, 0
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens.append(tp.decode_step(tokens[-1]).argmax(axis=-1))
        comm_s += statistics.mean(w["comm_seconds"] for w in tp.last_stats)  # a worker's all-reduces + gather
        comm_bytes += sum(w["comm_bytes"] for w in tp.last_stats)  # written into shared memory by all workers
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": np.stack(tokens, 1), "comm_s": comm_s, "comm_bytes": comm_bytes}


def pipeline(pp: PipelineModel, prompts: np.ndarray, steps: int, micro_batches: int) -> dict:
    """Decode time: from the end of the prefill to the last token, read from the last stage's own clock."""
    B, E = prompts.shape[0], pp.model.config.n_embd
    tokens = pp.generate(prompts, steps + 1, micro_batches)
    last = pp.last_stats[-1]["busy"]
    seconds = last[-1][1] - last[micro_batches - 1][1]
    comm_s = sum(s["comm_seconds"] for s in pp.last_stats) * steps / (steps + 1)  # copies in and out of the slots
    return {"seconds": seconds, "tokens": tokens, "comm_s": comm_s, "comm_bytes": steps * B * (E * 4 + 8)}


def decode_records(model, tp, pp, batch: int, prompt_len: int, steps: int, rounds: int) -> list[dict]:
    prompts = np.random.default_rng(batch).integers(model.config.vocab_size, size=(batch, prompt_len))
    m = 1 if batch == 1 else 2  # two micro-batches keep both stages busy from step to step
    runs = {"single_1thread": lambda: single_process(model, prompts, steps, 1),
            "single_2threads": lambda: single_process(model, prompts, steps, 2),
            "tp2": lambda: tensor_parallel(tp, prompts, steps),
            "pp2": lambda: pipeline(pp, prompts, steps, m)}
    readings = interleaved(runs, rounds, measure=lambda run, r: run())
    reference = readings["single_1thread"][0]["tokens"]
    records = []
    for name, rs in readings.items():
        seconds = statistics.median(r["seconds"] for r in rs)
        records.append({"method": name, "batch": batch, "tokens_per_s": batch * steps / seconds,
                        "s_per_step": seconds / steps,
                        "comm_s_per_step": statistics.median(r["comm_s"] for r in rs) / steps,
                        "comm_bytes_per_step": rs[0]["comm_bytes"] // steps,
                        "processes": 1 if name.startswith("single") else 2,
                        "blas_threads_per_process": 2 if name == "single_2threads" else 1,
                        "micro_batches": m if name == "pp2" else None,
                        "same_tokens_as_single_1thread": all(np.array_equal(r["tokens"], reference) for r in rs),
                        "seconds_per_round": [r["seconds"] for r in rs]})
    return records


def engine_records(model, batch: int, prompt_len: int, steps: int, rounds: int) -> list[dict]:
    """Chapter 5's engine serving ``batch`` requests that arrive together (one prefill step, then decodes), its
    model step in this process (1 or 2 BLAS threads) or tensor-parallel on two workers: seconds from the first
    step to the last token, read in interleaved rounds."""
    rng = np.random.default_rng(batch)
    requests = [Request(i, rng.integers(model.config.vocab_size, size=prompt_len).tolist(), steps + 1,
                        stop_at_eos=False) for i in range(batch)]
    blocks = batch * blocks_needed(prompt_len + steps + 1, 16)

    def serve(store, forward=None, threads=None):
        engine = CachingLLMEngine(model, store, max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len,
                                  enable_prefix_caching=False, **({"forward": forward} if forward else {}))
        with blas_threads(threads):  # the same prompts every round: no prefix cache, so every round computes them
            t0 = time.perf_counter()
            outs = engine.generate_many(requests)
            seconds = time.perf_counter() - t0
        return {"seconds": seconds, "tokens": [o.output_token_ids for o in outs], "comm_s": 0.0, "comm_bytes": 0}

    stores = [PrefixCachingKVStore(model.config, blocks, 16) for _ in range(3)]
    with TensorParallelRunner(model, stores[2], max_rows=batch * prompt_len, max_seqs=batch) as tp:
        readings = interleaved({"engine_single_1thread": lambda: serve(stores[0], threads=1),
                                "engine_single_2threads": lambda: serve(stores[1], threads=2),
                                "engine_tp2": lambda: serve(stores[2], forward=tp)}, rounds,
                               measure=lambda run, r: run())
    reference = readings["engine_single_1thread"][0]["tokens"]
    return [{"method": name, "batch": batch, "tokens_per_s": batch * (steps + 1) / statistics.median(
             r["seconds"] for r in rs), "processes": 1 if "single" in name else 3,
             "blas_threads_per_process": 2 if "2threads" in name else 1,
             "same_tokens_as_engine_single_1thread": all(r["tokens"] == reference for r in rs),
             "seconds_per_round": [r["seconds"] for r in rs]} for name, rs in readings.items()]


def bubble_records(model, pp: PipelineModel, batch: int, prompt_len: int, rounds: int) -> list[dict]:
    """One prefill pass (no decode) of ``batch`` prompts in m micro-batches: the measured idle fraction."""
    prompts = np.random.default_rng(7).integers(model.config.vocab_size, size=(batch, prompt_len))
    out = []
    for m in MICRO_BATCHES:
        readings = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            pp.generate(prompts, 1, m)
            readings.append((time.perf_counter() - t0, bubble_fraction([s["busy"] for s in pp.last_stats])))
        wall, bubble = (statistics.median(r[i] for r in readings) for i in (0, 1))
        out.append({"micro_batches": m, "batch": batch, "prompt_tokens": prompt_len, "bubble_measured": bubble,
                    "bubble_ideal": ideal_bubble(2, m), "wall_s": wall,
                    "tokens_per_s": batch * prompt_len / wall})
    return out


def all_reduce_records(tp: TensorParallelModel, repeats: int) -> list[dict]:
    """One all-reduce between the two workers, alone: [1, E] (a batch-1 decode step's) and [32, E]."""
    out = []
    for rows in BATCHES:
        seconds = max(tp.group.call("all_reduce_alone", rows, repeats))  # the slower worker's view
        out.append({"rows": rows, "bytes_per_worker": rows * tp.model.config.n_embd * 4, "seconds": seconds,
                    "repeats": repeats})
    return out


def bench_parallel(quick: bool = QUICK) -> dict:
    config = preset("gpt2")
    if quick:
        config = replace(config, n_layer=4)  # GPT-2 124M's widths and vocabulary, 4 layers instead of 12
    prompt_len, steps, rounds, bubble_batch = (8, 4, 2, 8) if quick else (16, 8, 3, 16)
    router_units = 0 if missing_extra() else 65  # units: rough shares of a full run
    progress.plan(35 + router_units, "starting the workers")
    model = random_model(config, seed=0)
    tp = TensorParallelModel(model, max_rows=max(BATCHES) * prompt_len, max_logit_rows=max(BATCHES))
    try:
        pp = PipelineModel(model, max_batch=max(BATCHES), max_tokens=prompt_len + steps + 1, max_micro_batches=8)
        try:
            progress.advance(3, "decode: one process, tensor parallel, pipeline, taking turns")
            results = [r for b in BATCHES for r in decode_records(model, tp, pp, b, prompt_len, steps, rounds)]
            progress.advance(25, "the pipeline's bubble")
            bubble = bubble_records(model, pp, bubble_batch, prompt_len, rounds)
            progress.advance(5, "one all-reduce alone")
            all_reduce = all_reduce_records(tp, 200 if quick else 1000)
        finally:
            pp.close()
    finally:
        tp.close()
    results += engine_records(model, max(BATCHES), prompt_len, steps, rounds)
    by = {(r["method"], r["batch"]): r["tokens_per_s"] for r in results}
    pairs = [(m, "single_1thread") for m in ("single_2threads", "tp2", "pp2")] + [
        (m, "engine_single_1thread") for m in ("engine_single_2threads", "engine_tp2")]
    ratios = {f"{m}_vs_{one}_batch{b}": by[(m, b)] / by[(one, b)] for b in BATCHES for m, one in pairs
              if (m, b) in by}
    skipped = missing_extra()
    progress.advance(2, None if skipped else "replicas behind the router")
    router = ({"router": {"skipped": skipped}, "targets_met": {}} if skipped else
              router_records(quick, model, router_units))
    results += router.pop("results", [])
    ratios.update(router.pop("ratios", {}))
    router["targets_met"] = {"tp2_vs_single_1thread_batch32 >= 1.5": ratios["tp2_vs_single_1thread_batch32"] >= 1.5,
                             **router["targets_met"]}
    shape = f"GPT-2 124M widths, {config.n_layer} layers" if quick else "GPT-2 124M shape"
    return {"benchmark": "parallel", "model": f"random {shape}, float32", "quick": quick,
            "kernels": "none (chapter code in every process)",
            "workload": {"prompt_tokens": prompt_len, "decode_steps": steps, "rounds": rounds,
                         "bubble_batch": bubble_batch},
            "results": results, "ratios": ratios, "bubble": bubble, "all_reduce": all_reduce, **router}
