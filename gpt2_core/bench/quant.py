"""Chapter 6's benchmark: ``python -m gpt2_core bench quant [--json PATH] [--quick]``.

Three questions, each answered by measurement:

* **speed** (random weights of GPT-2 124M's shape: a matmul's time does not depend on the numbers): one decode step
  of chapter 3's ragged model step at batch 1 and 32, context 128, for fp32 and every format, with every matmul
  in the format (the tied head too), by two kernels: ``numpy`` (dequantize, then BLAS: the definition) and
  ``numba`` (``quant_kernels``: the small weights read directly). numba's worker threads slow OpenBLAS in the
  process they live in, so the numba arms run in a **separate worker process**, and the two processes take turns
  by round (``turns``: the order reversed every other round, a pause between turns): the fp32 and numpy arms
  never share their process or their turn with a numba thread. numba's compile time is measured in the worker
  before any round and kept out of the timings.
* **quality** (the embedded model, a text it never trained on): perplexity on the held-out chapters for every
  format, with ``wte`` (embedding + tied head) in fp32 and in the format; greedy continuations of 200 tokens
  against fp32's for every weight format and every KV format; and on the random 124M-shape weights, the logits
  of each format against fp32's.
* **KV memory**: chapter 3's engine serves 128 requests drawn like the standard workload's over chapter 4's paged
  store in fp32, fp16 and int8 at one budget of bytes (scales counted): how many sequences ran at once (a figure of
  the schedule, which also depends on the requests' lengths), how many 512-token sequences the store holds
  (vLLM's "maximum concurrency": bytes alone), and the throughput.

``--quick`` (and GPT2_QUICK=1): a 2-layer model of GPT-2's width and vocabulary for speed and KV, the first
windows of the held-out text, 8 requests, 2 rounds.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from ..ch02_kv_cache import kv_cache
from ..ch06_quantization import quant_kernels
from ..loading.config import preset
from ..ch03_batching.engine import LLMEngine
from ..ch02_kv_cache.kv_cache import kv_cache_bytes
from ..ch03_batching.model_runner import Chunk, ragged_forward
from ..ch06_quantization.quant_kv_store import KV_FORMATS, kv_bytes_per_token, paged_store
from ..ch06_quantization.quantization import bytes_per_token, greedy_agreement, heldout_token_ids, logit_error, perplexity, quantize_model
from ..ch03_batching.sequence import Request
from ..loading.weights import GPT2Model, load_model, random_model
from .batching import decode_step_runner
from . import progress, turns
from .common import GRADING, QUICK, blas_thread_count, llama_cpp_available
from .paged import fresh
from .workload import poisson_workload, standard_workload, summarize

SPEED_ARMS = (("fp32", "numpy"), ("fp16", "numpy"), ("int8", "numpy"), ("int4", "numpy"),
              ("int8", "numba"), ("int4", "numba"))
BATCHES = (1, 32)
CONTEXT = 128
GROUP_SIZE = 64
GREEDY_PROMPT = "It is a truth universally acknowledged, that"
GREEDY_TOKENS = 200
KV_BUDGET_SLOTS = 4  # the KV budget: this many fp32 sequences of 512 tokens (GPT-2 124M: 151 MB)
KV_REQUESTS = 128  # the standard workload's distributions, enough requests that memory, not their number, limits


def speed_shape(quick: bool):
    """GPT-2 124M; in quick runs (and while grading) 2 of its 12 layers: the same matrices, a sixth of the time."""
    return replace(preset("gpt2"), n_layer=2) if quick or GRADING else preset("gpt2")


def speed_models(config, arms, seed: int = 0) -> dict:
    """``{(format, kernel): model}``: the same random weights in every format, every matmul quantized (head too)."""
    base = random_model(config, seed=seed)
    return {(fmt, kernel): base if fmt == "fp32" else
            quantize_model(base, fmt, GROUP_SIZE, kernel=kernel, embeddings=True) for fmt, kernel in arms}


def speed_runners(models: dict, batches=BATCHES, context: int = CONTEXT) -> dict:
    """``{(format, kernel, batch): one decode step}``, each over its own store."""
    return {(fmt, kernel, b): decode_step_runner(m, b, context) for (fmt, kernel), m in models.items()
            for b in batches}


def numba_runners(config, batches, context):
    """The numba arms, built and compiled (timed) in their worker process (``turns.TurnWorker``)."""
    compile_s = quant_kernels.warm_up()
    runners = speed_runners(speed_models(config, [a for a in SPEED_ARMS if a[1] == "numba"]), batches, context)
    return runners, lambda: {"compile_s": compile_s, **quant_kernels.threading_info()}


def speed(quick: bool, threads: int | None, config=None, units: float = 0.0) -> tuple[list[dict], dict]:
    """Decode-step speed of every arm at every batch: (records, how it was measured). ``config``: another shape
    than ``speed_shape(quick)`` (tests use a tiny one). ``units``: this part's share of the progress."""
    config = speed_shape(quick) if config is None else config
    rounds, repeats = (2, 2) if quick else (9, 3)
    models = speed_models(config, [a for a in SPEED_ARMS if a[1] == "numpy"])
    runners = speed_runners(models)
    for run in runners.values():
        run()
    method = {"rounds": rounds, "steps_per_reading": repeats, "context": CONTEXT, "settle_s": turns.SETTLE_S,
              "processes": "fp32 and numpy arms in the main process; numba arms in a spawned worker process; the "
                           "processes take turns by round (order reversed in odd rounds), each waiting on a pipe "
                           "while the other measures"}
    workers = []
    if quant_kernels.numba_available():
        workers.append(turns.TurnWorker(numba_runners, (config, BATCHES, CONTEXT), threads, repeats))
        method.update(workers[0].info)
    else:
        method["numba"] = f"not installed: numba arms skipped ({quant_kernels.INSTALL})"
    try:
        readings = turns.take_turns(runners, workers, rounds, repeats,
                                    after_round=lambda r: progress.advance(units / rounds))
    finally:
        for worker in workers:
            worker.close()
    records = []
    for (fmt, kernel, batch), seconds in readings.items():
        model = models[(fmt, "numpy")]  # the numba arms' weights are these, in the worker
        sizes = {"weight_bytes": model.nbytes(), "bytes_per_token": bytes_per_token(model)}
        step_s = float(np.median(seconds))
        records.append({"method": fmt, "kernel": kernel, "batch": batch, "tokens_per_s": batch / step_s,
                        "ms_per_step": 1e3 * step_s, "ms_per_step_rounds": [1e3 * s for s in seconds], **sizes,
                        "group_size": GROUP_SIZE if fmt == "int4" else None, "embeddings_quantized": fmt != "fp32"})
    method["model"] = f"random weights, GPT-2 124M shape{' with 2 layers' if config.n_layer == 2 else ''}" \
        if config.n_embd == 768 else f"random weights, {config}"
    return records, method


# ----------------------------------------------------------------------------------------------------------------
# Quality


def quality(quick: bool, random_models: dict | None = None) -> dict:
    """Perplexity on the held-out text, greedy agreement (weights and KV), logits against fp32 on random weights."""
    model = load_model()
    ids = heldout_token_ids(model.tokenizer)
    windows = 8 if quick else None
    rows = []
    base = perplexity(model, ids, windows)
    rows.append({"format": "fp32", "embeddings_quantized": False, "group_size": None, **base,
                 "perplexity_increase": 0.0, "weight_bytes": model.nbytes()})
    variants = [(fmt, emb) for fmt in ("fp16", "int8", "int4") for emb in (False, True)]
    for fmt, emb in variants:
        q = quantize_model(model, fmt, GROUP_SIZE, embeddings=emb)
        p = perplexity(q, ids, windows)
        rows.append({"format": fmt, "embeddings_quantized": emb, "group_size": GROUP_SIZE if fmt == "int4" else None,
                     **p, "perplexity_increase": p["perplexity"] / base["perplexity"] - 1, "weight_bytes": q.nbytes()})
    prompt = model.tokenizer.encode(GREEDY_PROMPT)
    reference = kv_cache.generate(model, prompt, GREEDY_TOKENS, stop_at_eos=False)
    greedy = []
    for fmt in ("fp16", "int8", "int4"):
        for emb in (False, True):
            tokens = kv_cache.generate(quantize_model(model, fmt, GROUP_SIZE, embeddings=emb), prompt, GREEDY_TOKENS,
                                       stop_at_eos=False)
            greedy.append({"weights": fmt, "embeddings_quantized": emb, "kv": "fp32",
                           **greedy_agreement(reference, tokens)})
    for fmt in KV_FORMATS:
        store = paged_store(model.config, fmt, kv_bytes_per_token(model.config, fmt) * model.config.n_positions)
        engine = LLMEngine(model, store=store, max_num_seqs=1)
        out = engine.generate_many([Request(0, prompt, GREEDY_TOKENS, stop_at_eos=False)])[0]
        greedy.append({"weights": "fp32", "embeddings_quantized": False, "kv": fmt,
                       **greedy_agreement(reference, out.output_token_ids)})
    logits = []
    if random_models is not None:
        ref = random_models["fp32"]
        tokens = np.random.default_rng(2).integers(0, ref.config.vocab_size, size=64)
        for fmt, q in random_models.items():
            if fmt != "fp32":
                logits.append({"format": fmt, "embeddings_quantized": True, **logit_error(ref, q, tokens)})
    return {"perplexity": rows, "perplexity_text": f"held-out chapters, {rows[0]['tokens']:,} tokens "
            f"({rows[0]['windows']} windows of {model.config.n_positions})", "greedy": greedy,
            "greedy_prompt": GREEDY_PROMPT, "logits_vs_fp32_random_weights": logits}


# ----------------------------------------------------------------------------------------------------------------
# KV memory


def kv_memory(quick: bool) -> list[dict]:
    """Chapter 3's engine over chapter 4's paged store in each KV format, at one budget of bytes."""
    config = speed_shape(quick)
    model = random_model(config, seed=0)
    if quick:
        requests = poisson_workload(8, 8.0, config.vocab_size, seed=0, prompt_len=(32, 0.5, 16, 64),
                                    output_len=(20, 0.4, 12, 32))
        budget = kv_cache_bytes(config, 128)
    else:
        requests = standard_workload(num_requests=KV_REQUESTS)
        budget = KV_BUDGET_SLOTS * kv_cache_bytes(config, 512)
    records = []
    for fmt in KV_FORMATS:
        store = paged_store(config, fmt, budget)
        engine = LLMEngine(model, store=store, max_num_seqs=256)
        t0 = time.perf_counter()
        outputs = engine.generate_many(fresh(requests))
        seconds = time.perf_counter() - t0
        summary = summarize(outputs, duration_s=seconds)
        records.append({"method": f"kv_{fmt}", "kernel": "numpy", "batch": 256,
                        "tokens_per_s": summary["output_tokens"] / seconds,
                        "max_concurrent": max(s.kv_slots_in_use for s in engine.step_stats),
                        "mean_concurrent": float(np.mean([s.kv_slots_in_use for s in engine.step_stats])),
                        "budget_bytes": int(budget), "store_bytes": int(store.nbytes),
                        "kv_bytes_per_token": kv_bytes_per_token(config, fmt),
                        "capacity_tokens": store.capacity_tokens(), "num_blocks": store.num_blocks,
                        "sequences_of_512_tokens": store.capacity_tokens() // 512,  # vLLM's "maximum concurrency"
                        "num_preemptions": engine.scheduler.num_preemptions, "num_requests": len(requests),
                        "output_tokens": summary["output_tokens"], "num_errors": summary["num_errors"]})
    return records


def bench_quant(quick: bool = QUICK, threads: int | None = None) -> dict:
    progress.plan(100, "decode-step speed of each format and kernel, in rounds")  # units: rough shares of a run
    if threads is None:
        threads = blas_thread_count()
    speed_records, method = speed(quick, threads, units=70)
    progress.advance(0, "quality: perplexity, greedy agreement, logits")
    config = speed_shape(quick)
    base = random_model(config, seed=0)
    random_models = {"fp32": base, **{f: quantize_model(base, f, GROUP_SIZE, embeddings=True)
                                      for f in ("fp16", "int8", "int4")}}
    q = quality(quick, random_models)
    progress.advance(20, "KV memory: sequences at once in each KV format")
    del random_models, base
    kv = kv_memory(quick)
    results = speed_records + kv

    def tps(fmt, kernel, batch):
        return next((r["tokens_per_s"] for r in speed_records if (r["method"], r["kernel"], r["batch"]) ==
                     (fmt, kernel, batch)), None)

    def ratio(a, b):
        return None if a is None or b is None else a / b

    kv_by = {r["method"]: r for r in kv}
    ppl = {(r["format"], r["embeddings_quantized"]): r["perplexity_increase"] for r in q["perplexity"]}
    ratios = {f"{fmt}_{kernel}_over_fp32_batch{b}": ratio(tps(fmt, kernel, b), tps("fp32", "numpy", b))
              for fmt, kernel in SPEED_ARMS[1:] for b in BATCHES}
    for fmt in ("fp16", "int8"):
        kv_q, kv_f = kv_by[f"kv_{fmt}"], kv_by["kv_fp32"]
        ratios[f"{fmt}_over_fp32_max_concurrent"] = kv_q["max_concurrent"] / kv_f["max_concurrent"]
        ratios[f"{fmt}_over_fp32_sequences_of_512_tokens"] = (kv_q["sequences_of_512_tokens"] /
                                                              max(1, kv_f["sequences_of_512_tokens"]))
    ratios["int8_perplexity_increase"] = ppl[("int8", False)]
    ratios["int8_with_wte_perplexity_increase"] = ppl[("int8", True)]
    int8_speed = ratios["int8_numba_over_fp32_batch1"]
    targets = {"int8_numba_over_fp32_batch1 >= 1.6": None if int8_speed is None else int8_speed >= 1.6,
               "int8_over_fp32_max_concurrent >= 3.5": ratios["int8_over_fp32_max_concurrent"] >= 3.5,
               "int8_over_fp32_sequences_of_512_tokens >= 3.5":
                   ratios["int8_over_fp32_sequences_of_512_tokens"] >= 3.5,
               "int8_perplexity_increase <= 0.02": ratios["int8_perplexity_increase"] <= 0.02}
    llamacpp = ("llama-cpp-python is installed, but this benchmark has no llama.cpp arms: bench capstone runs "
                "llama.cpp on GGUF files of its weights (f32, q8_0), bench modern on SmolLM2's file"
                if llama_cpp_available()
                else "llama-cpp-python is not installed: no llamacpp_* records")
    return {"benchmark": "quant", "model": method["model"], "quick": quick, "llamacpp": llamacpp,
            "kernels": "chapter code (x @ W): fp32 by BLAS; a format's numpy kernel dequantizes then BLAS; numba "
                       "kernels read the quantized bytes (quant_kernels)",
            "speed_method": method, "results": results, "ratios": ratios, "targets_met": targets, "quality": q}
