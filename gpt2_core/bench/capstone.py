"""The capstone's benchmark: ``python -m gpt2_core bench capstone [--trace PATH] [--json PATH] [--quick]``.

Every engine of the series on one workload, in one run, each beside its own physical limit:

* ``naive`` (chapter 1: every generated token recomputes the whole sequence), on a subset of the requests (every
  ``NAIVE_STRIDE``-th: its cost grows with the square of the length), scaled to the whole workload by positions
  processed: the workload's naive time = its naive positions / the positions per second measured on the subset;
* ``kv_cache`` (chapter 2, one request at a time); ``static`` (chapter 3's first try: batches of ``MAX_BATCH``,
  left-padded, each run to its longest row); ``continuous`` (chapter 3's ``LLMEngine``); ``paged`` (the same
  engine over chapter 4's paged store); ``prefix_cached`` (chapter 5's ``CachingLLMEngine``: paged attention,
  prefix caching, chunked prefill);
* ``int8_kv`` (chapter 6 inside chapter 5: ``prefix_cached`` with int8 K/V blocks, a scale per token and head, and
  fp32 weights): the same engine in 3.8x fewer KV bytes, its decoding queries reading int8 K/V;
* ``int8`` (chapter 6: int8 weights, the tied head too, chapter 3's engine over chapter 4's store) with NumPy's
  path (dequantize, then BLAS) and ``int8_numba`` with the kernel that reads the bytes (in its own process: numba's
  threads slow OpenBLAS in the process they live in; skipped with a note without numba);
* ``hf_transformers`` (batched ``generate``, batched like ``static``; random weights of its own) when torch is
  installed; ``llamacpp_f32`` and ``llamacpp_q8_0`` (llama.cpp serving this run's weights written as GGUF files,
  one request at a time, as ``kv_cache``; ``bench.llamacpp``) when llama-cpp-python is installed, else
  ``llamacpp`` is listed as skipped with a note.

Throughput is measured offline (every request submitted at t=0, as vLLM's throughput benchmark does); time to
first token and inter-token latency with the workload's arrivals (as its serving benchmark does). The two
one-at-a-time servers (naive, kv_cache) serve each request in the same time whenever it arrives, so their
latencies come from the offline run placed on the arrivals (first come, first served): no second run.

Each row's limit, measured in the same run (``limits``: the best of the readings taken during it): the FLOPs of the
forward passes that engine performs (``forward_flops``: naive recomputes, static computes its padding, the others
compute each position once) at the GEMM rate, and the bytes it reads (its weights once per model step, the K/V each
decoding query reads) at the memory bandwidth: ``bound_tokens_per_s`` = output tokens / max(FLOP time, byte time),
``bound_kind`` the larger. ``compute_bound``: the workload's FLOPs for an engine that computes each position once,
at the GEMM rate.

That GEMM rate is measured at 256 rows; a decode step of 32 sequences multiplies 32 rows, where a matrix library
does fewer FLOPs per second. So each engine row also gets a **per-step bound** (``step_bound_tokens_per_s``): every
step the engine ran (recorded by ``StepRecorder``) priced at the rate measured in the run for its own number of
rows (``gemm_rates``: the model's own matrices at 1, 2, 4, ... 2048 rows, interpolated), or at its bytes if those
take longer (``roofline.per_step_bound``); with ``step_time``, the model's measured time beside that bound by the
steps' rows, and the time outside the model. ``step_anatomy`` splits one 32-row decode step into its matmuls,
attention and the rest, and times the step's matmuls alone in its own order (each weight once, from memory, as a
step meets them): the most of the per-step bound these kernels could reach if attention and everything else cost
nothing (``matmul_ceiling``).

The accelerated ``continuous`` engine keeps its K/V in the appendix's ``SlotAttentionKVStore`` (chapter 3's
contiguous store whose decoding tokens attend in one numba kernel call per layer; chapter 3's own store without
numba): the row's ``kv_store`` says which.

More rows:

* the **chapter code's run** (``chapter_code``): the float32 rows again on the plain model, without the appendix's
  ``accelerate()`` kernels (offline throughput only), each row beside its bounds at the plain kernels' rates;
* **speculative decoding** (chapter 10): ``spec_ngram_free`` and ``spec_ngram_copy``, chapter 10's engine (chapter
  5's with k = 4 drafts a step) on the same workload. Random weights predict noise, so their acceptance would mean
  nothing: the drafter replays, step by step, the outcomes the trained embedded model's prompt lookup had on chapter
  10's free text and copy task (``ReplayDrafter``, ``embedded_outcomes``). The speed is this engine's on GPT-2
  124M's shape; the acceptance is a trained model's.
* **served** (chapter 7): ``python -m gpt2_core serve`` on these random weights (written to a temporary folder),
  every request sent at once over HTTP (the server at capacity), streamed; skipped with a note without the serve
  extra; and **tp2** (chapter 8, in the chapter code's run): ``prefix_cached``'s engine with its model step on
  two worker processes of 1 BLAS thread (``TensorParallelRunner``), offline.

Timings use random weights of GPT-2 124M's shape (the time of a matmul does not depend on the numbers in it);
``--quick``: 2 of its 12 layers, 6 short requests, a short sweep.
"""

from __future__ import annotations

import asyncio
import importlib.util
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..ch01_forward import generation
from ..ch02_kv_cache import kv_cache
from ..ch06_quantization import quant_kernels
from ..ch05_sharing.caching_engine import CachingLLMEngine
from ..loading.config import GPT2Config, preset
from ..a1_cpu_kernels import accelerate, array_of, is_accelerated
from ..a1_cpu_kernels.attention import SlotAttentionKVStore
from ..ch03_batching.kv_store import ContiguousKVStore
from ..ch06_quantization.quant_kernels import numba_available
from ..ch03_batching.engine import LLMEngine, RequestOutput
from ..ch02_kv_cache.kv_cache import kv_cache_bytes
from ..ch04_paged.paged_kv_store import FP32, PagedKVStore
from ..ch05_sharing.prefix_cache import PrefixCachingKVStore
from ..ch06_quantization.quant_kv_store import Int8Codec
from ..ch06_quantization.quantization import MATRICES, QuantizedEmbedding, bytes_per_token, quantize_model
from ..ch04_paged.block_manager import blocks_needed
from ..ch10_speculative import speculative
from ..ch10_speculative.acceptance import SpecStats
from ..ch10_speculative.drafters import PromptLookupDrafter, Proposal
from ..ch10_speculative.rollback import SpeculativeKVStore
from ..ch10_speculative.spec_engine import SpeculativeEngine
from ..ch08_parallel.tp_runner import TensorParallelRunner
from ..ch11_capstone.roofline import (count_work, forward_flops, per_step_bound, request_passes, roofline,
                                     static_passes, step_seconds, workload_passes)
from ..ch03_batching.sequence import FinishReason, Request, SequenceMetrics
from ..loading.weights import GPT2Model, load_model, random_model
from . import workload as wl
from . import progress
from .batching import decode_step_runner, gemm_bound_tokens_per_s, replay_hf, warm_up
from .common import (GRADING, LLAMA_CPP_INSTALL, QUICK, blas_thread_count, blas_threads, in_spawned_process,
                     llama_cpp_available, median_time)
from .kv_cache import gemv_bandwidth, step_matrices
from .llamacpp import GGUF_TYPES, GGUFWeights, gguf_unsupported, serve_gguf, write_gpt2_gguf
from .paged import fresh
from .replay import replay, replay_static, serve_one_by_one
from .router import missing_extra, run_async, write_random_checkpoint
from .serve import Client
from .spec import NUM_SPECULATIVE, embedded_new_tokens, embedded_workloads

MAX_BATCH = 32  # max_num_seqs of the batched engines, the batch of static and HF
MAX_NUM_BATCHED_TOKENS = 2048
BLOCK_SIZE = 16
NAIVE_STRIDE = 8  # naive runs every 8th request (quick: every 4th)
QUANT_FORMAT = "int8"  # chapter 6's best form: 3.9x fewer bytes, perplexity +0.2%, the kernel ~1.8x at batch 1
GEMM_ROWS = 256  # the GEMM rate: a step's matmuls at this many rows (a prefill's), each timed alone
RATE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)  # the rate curve: row counts measured (full run)
QUICK_RATE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
HEAD_MAX_ROWS = 256  # the LM head runs on one row per sequence (k + 1 when it verifies drafts): at most 160 here
ROW_BUCKETS = ((1, 8), (9, 32), (33, 256), (257, None))  # steps grouped by their rows, for where the time goes
SPEC_K = NUM_SPECULATIVE  # speculative tokens per step: chapter 10's benchmark's
CHAPTER_CODE = "chapter code (plain NumPy: x @ W by BLAS)"
ACCELERATED = "the appendix's accelerate() kernels under the chapter code"
ENGINES = ("naive", "kv_cache", "static", "continuous", "paged", "prefix_cached")
ESSAY = [("naive", 10), ("kv_cache", 100), ("serving engine", 1000)]  # the essay's table, tok/s


# ----------------------------------------------------------------------------------------------------------------
# Serving: one engine, one workload


def at_zero(requests: list[Request]) -> list[Request]:
    """Copies of ``requests``, every one arriving at t=0 (offline)."""
    return [replace(r, arrival_s=0.0) for r in fresh(requests)]


def kv_bytes_per_position(config: GPT2Config) -> int:
    return kv_cache_bytes(config, 1)


def queue_latencies(service: list[tuple[float, list[float]]], arrivals: list[float]) -> dict:
    """A one-at-a-time server, first come first served: request i starts at max(its arrival, the end of i-1) and
    takes the same time as when it was served alone. ``service``: per request (its seconds, its tokens' offsets
    from its start). -> p50 time to first token and p50/p99 inter-token latency, in seconds."""
    order = np.argsort(arrivals, kind="stable")
    free, ttft, gaps = 0.0, [], []
    for i in order:
        seconds, offsets = service[i]
        start = max(arrivals[i], free)
        free = start + seconds
        if offsets:
            ttft.append(start + offsets[0] - arrivals[i])
            gaps += list(np.diff(offsets))
    return latency_fields(ttft, gaps)


def service_times(outputs: list[RequestOutput]) -> list[tuple[float, list[float]]]:
    """Per output served alone: (its seconds, its tokens' offsets from its start), as ``queue_latencies`` takes
    them."""
    return [(o.metrics.finished_time - o.metrics.arrival_time,
             [t - o.metrics.arrival_time for t in o.metrics.token_times]) for o in outputs]


NO_LATENCY = {"ttft_p50_s": None, "itl_p50_s": None, "itl_p99_s": None}


def latency_fields(ttft, gaps) -> dict:
    def pct(v, q):
        return float(np.percentile(v, q)) if len(v) else None
    return {"ttft_p50_s": pct(ttft, 50), "itl_p50_s": pct(gaps, 50), "itl_p99_s": pct(gaps, 99)}


def latencies_of(outputs: list[RequestOutput]) -> dict:
    ok = [o for o in outputs if o.finish_reason is not FinishReason.ERROR]
    return latency_fields([o.metrics.time_to_first_token for o in ok if o.metrics.time_to_first_token is not None],
                          [g for o in ok for g in o.metrics.inter_token_latencies])


def kv_blocks(requests: list[Request], extra_tokens: int = 0, seqs: int = MAX_BATCH) -> int:
    """KV blocks for ``seqs`` of the longest request (``extra_tokens`` more each): room enough that nothing is
    preempted."""
    longest = max(len(r.prompt_token_ids) + r.max_new_tokens for r in requests) + extra_tokens
    return seqs * blocks_needed(longest, BLOCK_SIZE)


def decode_store(model: GPT2Model) -> type[ContiguousKVStore]:
    """The contiguous store for ``model``: the appendix's ``SlotAttentionKVStore`` (a step's decode attention in one
    numba kernel a layer) when the model runs the appendix's kernels and numba is installed, else chapter 3's."""
    return SlotAttentionKVStore if is_accelerated(model) and numba_available() else ContiguousKVStore


def make_engine(model: GPT2Model, method: str, requests: list[Request], max_num_seqs: int = MAX_BATCH):
    """The engine of ``method`` with KV room for ``max_num_seqs`` of the longest request (nothing preempted)."""
    longest = max(len(r.prompt_token_ids) + r.max_new_tokens for r in requests)
    blocks = kv_blocks(requests, seqs=max_num_seqs)
    if method == "continuous":  # on an accelerated model, in the appendix's store (one attention kernel a layer)
        max_len = min(longest, model.config.n_positions)
        store = decode_store(model)(model.config, num_slots=max_num_seqs, max_len=max_len)
        return LLMEngine(model, store=store, max_num_seqs=max_num_seqs, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    if method in ("prefix_cached", "int8_kv"):
        codec = Int8Codec() if method == "int8_kv" else FP32
        return CachingLLMEngine(model, PrefixCachingKVStore(model.config, blocks, BLOCK_SIZE, codec),
                                max_num_seqs=max_num_seqs, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    return LLMEngine(model, store=PagedKVStore(model.config, blocks, BLOCK_SIZE), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)  # paged, and the quantized rows


def serve_engine(model: GPT2Model, method: str, requests: list[Request], arrivals: bool,
                 max_num_seqs: int = MAX_BATCH) -> dict:
    """Serve ``requests`` with ``method``'s engine (``continuous``, ``paged``, ``prefix_cached``, ``int8_kv`` or a
    quantized model's paged engine): offline (``arrivals=False``) or with their arrival times on the wall clock.
    -> {outputs, seconds, model_steps, kv_bytes_peak, kv_bytes_allocated, num_preemptions}."""
    return run_engine(make_engine(model, method, requests, max_num_seqs), requests, arrivals)


class StepRecorder:
    """An engine's ``forward``, wrapped: each step's chunks as (queries, keys, head_rows) and the seconds the model
    took, so that each step can be priced at its own shape (``per_step_bound``) beside the time it took."""

    def __init__(self, forward):
        self.forward, self.steps, self.seconds = forward, [], []

    def __call__(self, model, store, chunks, logits_indices=None):
        lengths = [len(c.token_ids) for c in chunks]
        if logits_indices is None:  # the last row of each chunk
            heads = [1] * len(chunks)
        else:  # the rows named, counted per chunk (a verify chunk has one per row)
            at = np.searchsorted(np.cumsum(lengths), np.asarray(logits_indices), side="right")
            heads = np.bincount(at, minlength=len(chunks)).tolist()
        self.steps.append([(q, c.start + q, h) for q, c, h in zip(lengths, chunks, heads)])
        t0 = time.perf_counter()
        if logits_indices is None:
            out = self.forward(model, store, chunks)
        else:
            out = self.forward(model, store, chunks, logits_indices)
        self.seconds.append(time.perf_counter() - t0)
        return out


def run_engine(engine, requests: list[Request], arrivals: bool) -> dict:
    """Serve ``requests`` with ``engine`` offline or on their arrivals, its steps recorded (``StepRecorder``)."""
    engine.forward = recorder = StepRecorder(engine.forward)
    t0 = time.perf_counter()
    outputs = replay(engine, fresh(requests)) if arrivals else engine.generate_many(at_zero(requests))
    seconds = time.perf_counter() - t0
    per_position = engine.store.bytes_per_token  # K/V of one position as the store keeps them
    return {"outputs": outputs, "seconds": seconds, "model_steps": engine.num_steps,
            "kv_bytes_peak": per_position * max(s.kv_reserved_tokens for s in engine.step_stats),
            "kv_bytes_allocated": int(engine.store.nbytes), "num_preemptions": engine.scheduler.num_preemptions,
            "steps": recorder.steps, "forward_seconds": recorder.seconds}


def serve_static(model: GPT2Model, requests: list[Request], arrivals: bool, batch: int = MAX_BATCH) -> dict:
    """Static batches (chapter 3's first try) offline or on the arrivals; the KV buffer of the largest batch."""
    t0 = time.perf_counter()
    outputs, batches = replay_static(model, fresh(requests), batch_size=batch,
                                     clock="wall" if arrivals else "offline")
    seconds = time.perf_counter() - t0
    columns = max(len(r.prompt_token_ids) for r in requests) + max(r.max_new_tokens for r in requests)
    kv = kv_bytes_per_position(model.config) * min(batch, len(requests)) * columns
    return {"outputs": outputs, "seconds": seconds, "model_steps": sum(len(b["step_times"]) for b in batches),
            "kv_bytes_peak": kv, "kv_bytes_allocated": kv, "num_preemptions": 0}


# ----------------------------------------------------------------------------------------------------------------
# The limits of the machine, measured in the run


def measure_limits(model: GPT2Model, rows: int = GEMM_ROWS) -> dict:
    """One reading of the machine's two limits: the GEMM rate (a model step's matmuls at ``rows`` rows, each timed
    alone, as chapter 3's ``gemm_bound_tokens_per_s`` times them) and the bandwidth a GEMV streams (chapter 2's
    ``gemv_bandwidth``, on the LM head's shape)."""
    gemm = gemm_bound_tokens_per_s(model, rows, repeats=3)
    return {"gemm_flops_per_s": gemm["gemm_flops_per_s"], "bytes_per_s": gemv_bandwidth(repeats=5)}


def best_limits(readings: list[dict]) -> dict:
    """The most the machine was seen to do in any reading, for each limit: a bound is what the machine can do, and
    a busy moment only ever slows a reading down."""
    return {k: float(np.max([r[k] for r in readings])) for k in readings[0]}


def gemm_rates(model: GPT2Model, rows=RATE_ROWS, repeats: int = 5) -> dict:
    """The GEMM rate at each of ``rows`` on the model's own matrices, multiplied as the model holds them (the
    appendix's ``FastWeight`` or a plain array: each run is priced by its own kernels): the first block's four
    products, each timed alone (the block's rate: their FLOPs over their summed medians), and the LM head's
    product up to ``HEAD_MAX_ROWS`` rows. -> ``{"rows", "blocks", "head_rows", "head"}`` (FLOP/s), lists that
    ``step_seconds`` reads."""
    p, E, V = model.params["h"][0], model.config.n_embd, model.config.vocab_size
    mats = [p["attn"]["c_attn"]["weight"], p["attn"]["c_proj"]["weight"], p["mlp"]["c_fc"]["weight"],
            p["mlp"]["c_proj"]["weight"]]
    head, rng = model.params["wte"].T, np.random.default_rng(0)
    out = {"rows": [int(n) for n in rows], "blocks": [], "head_rows": [], "head": []}
    for n in rows:
        xs = {k: rng.standard_normal((n, k), dtype=np.float32) for k in {array_of(w).shape[0] for w in mats}}
        seconds = sum(median_time(lambda w=w: xs[array_of(w).shape[0]] @ w, repeats=repeats) for w in mats)
        out["blocks"].append(2 * n * sum(array_of(w).size for w in mats) / seconds)
        if n <= HEAD_MAX_ROWS:
            x = xs[E]
            out["head_rows"].append(int(n))
            out["head"].append(2 * n * E * V / median_time(lambda: x @ head, repeats=max(3, repeats // 2)))
    return out


def best_rates(readings: list[dict]) -> dict:
    """The highest over readings of each rate of ``gemm_rates`` (the same row counts in each), as ``best_limits``."""
    return {k: readings[0][k] if k.endswith("rows") else [float(np.max(v)) for v in zip(*(r[k] for r in readings))]
            for k in readings[0]}


class MachineReadings:
    """The machine's limits (``measure_limits``) and the GEMM rate curves of both kernels (``gemm_rates``: the
    appendix's on ``fast``, the chapter code's on ``plain``), read a few times during the run; the best of each at
    the end (``best_limits``, ``best_rates``)."""

    def __init__(self, fast: GPT2Model, plain: GPT2Model | None, rows):
        self.fast, self.plain, self.rows = fast, plain, rows
        self.limits, self.fast_rates, self.plain_rates = [], [], []

    def read(self) -> None:
        self.limits.append(measure_limits(self.fast))
        self.fast_rates.append(gemm_rates(self.fast, self.rows))
        if self.plain is not None:
            self.plain_rates.append(gemm_rates(self.plain, self.rows))

    def best(self) -> tuple[dict, dict, dict | None]:
        plain = best_rates(self.plain_rates) if self.plain_rates else None
        return best_limits(self.limits), best_rates(self.fast_rates), plain


# ----------------------------------------------------------------------------------------------------------------
# The rows. Each is measured first and given its bound at the end, once the limits of the whole run are known.


def record(method: str, model: GPT2Model, offline: dict, latency: dict, passes, weights: GPT2Model | None = None,
           kv_bytes_per_position: int | None = None, **extra) -> dict:
    """One benchmark row: offline throughput, latencies on the arrivals, the work counted (``weights``: the model
    whose bytes a step reads, if not ``model`` itself; ``kv_bytes_per_position``: what a decoding query reads per
    key, if not float32 K/V)."""
    tokens = sum(len(o.output_token_ids) for o in offline["outputs"] if o.finish_reason is not FinishReason.ERROR)
    weights = model if weights is None else weights
    if kv_bytes_per_position is not None:
        extra["kv_bytes_per_position"] = kv_bytes_per_position
    weight_bytes_per_step = bytes_per_token(weights)
    work = count_work(model.config, passes, offline["model_steps"], weight_bytes_per_step, kv_bytes_per_position)
    return {"method": method, "batch": extra.pop("batch", 1), "tokens_per_s": tokens / offline["seconds"],
            **latency, "kv_bytes_peak": int(offline["kv_bytes_peak"]), "weight_bytes": int(weights.nbytes()),
            "output_tokens": tokens, "seconds": offline["seconds"], **work,
            "weight_bytes_per_step": int(weight_bytes_per_step),
            "num_preemptions": offline.get("num_preemptions", 0), **extra}


def with_bound(row: dict, limits: dict, rates: dict | None = None, config: GPT2Config | None = None) -> dict:
    """``row`` with its roofline at the run's ``limits`` and the fraction of it reached; an engine row whose steps
    were kept (``_steps``) also with its per-step bound at ``rates`` (``step_pricing``)."""
    bound = roofline(row["flops"], row["bytes_read"], row["output_tokens"], limits["gemm_flops_per_s"],
                     limits["bytes_per_s"])
    out = {**row, **bound, "fraction_of_bound": row["tokens_per_s"] / bound["bound_tokens_per_s"]}
    recorded = out.pop("_steps", None)
    if recorded is not None and rates is not None:
        out.update(step_pricing(config, out, recorded, rates, limits["bytes_per_s"]))
    return out


def step_pricing(config: GPT2Config, row: dict, recorded, rates: dict, bytes_per_s: float) -> dict:
    """``row``'s per-step bound (``per_step_bound``: every step it ran, each at the GEMM rate for its own rows) and
    where its time went: the model's measured time beside the bound, by the steps' rows (``ROW_BUCKETS``), and the
    time outside the model (scheduling, sampling, the engine's bookkeeping)."""
    steps, seconds = recorded
    args = (row["weight_bytes_per_step"], rates, bytes_per_s)
    kv = row.get("kv_bytes_per_position")
    bound = per_step_bound(config, steps, *args, row["output_tokens"], kv)
    rows = [sum(q for q, _, _ in c) for c in steps]
    least = [max(step_seconds(config, c, *args, kv)) for c in steps]
    buckets = []
    for lo, hi in ROW_BUCKETS:
        picked = [i for i, n in enumerate(rows) if lo <= n <= (hi or float("inf"))]
        if picked:
            buckets.append({"rows": f"{lo}-{hi}" if hi else f"{lo}+", "steps": len(picked),
                            "mean_rows": float(np.mean([rows[i] for i in picked])),
                            "bound_s": sum(least[i] for i in picked), "forward_s": sum(seconds[i] for i in picked)})
    return {**bound, "fraction_of_step_bound": row["tokens_per_s"] / bound["step_bound_tokens_per_s"],
            "step_time": {"forward_s": sum(seconds), "outside_forward_s": row["seconds"] - sum(seconds),
                          "by_rows": buckets}}


def lengths_of(requests) -> list[tuple[int, int]]:
    return [(len(r.prompt_token_ids), r.max_new_tokens) for r in requests]


def naive_subset(requests: list, stride: int) -> list:
    """Every ``stride``-th request, from the first: the subset chapter 1's loop runs."""
    return requests[::stride]


def naive_row(model: GPT2Model, requests, stride: int, weights: GPT2Model | None = None) -> tuple[dict, list]:
    """Chapter 1 on a subset, scaled to the whole workload by positions processed (see the module's docstring)."""
    subset = naive_subset(requests, stride)
    outputs, seconds = serve_one_by_one(model, at_zero(subset), generation.generate_stream)
    lengths = lengths_of(requests)
    positions = sum(q for q, _, _ in workload_passes("naive", lengths))
    sub_positions = sum(q for q, _, _ in workload_passes("naive", naive_subset(lengths, stride)))
    rate = sub_positions / seconds  # positions per second, measured on the subset
    scaled = {"outputs": [RequestOutput(r.request_id, [], [0] * r.max_new_tokens, FinishReason.LENGTH, None,
                                        SequenceMetrics(0.0)) for r in requests],
              "seconds": positions / rate, "model_steps": sum(N for _, N in lengths), "kv_bytes_peak": 0}
    service = [(sum(q for q, _, _ in request_passes("naive", P, N)) / rate, []) for P, N in lengths]
    measured = {o.request_id: o for o in outputs}
    for i, r in enumerate(requests):  # the subset's measured token times; the others' by positions at the rate
        if r.request_id in measured:
            m = measured[r.request_id].metrics
            service[i] = (m.finished_time - m.arrival_time, [t - m.arrival_time for t in m.token_times])
    latency = queue_latencies(service, [r.arrival_s for r in requests])
    row = record("naive", model, scaled, latency, workload_passes("naive", lengths), weights,
                 subset={"requests": len(subset), "of": len(requests), "stride": stride,
                         "positions": sub_positions, "of_positions": positions, "seconds": seconds,
                         "positions_per_s": rate,
                         "rule": "chapter 1's generate on every stride-th request; the workload's time = its naive "
                                 "positions / the positions per second measured on the subset"},
                 latency_basis="the subset's measured token times and the others' times by positions, placed on "
                               "the arrivals, first come first served; kv_bytes_peak 0: no cache, K/V recomputed")
    return row, outputs


def kv_cache_row(model: GPT2Model, requests, weights: GPT2Model | None = None) -> tuple[dict, list]:
    """Chapter 2, one request at a time, offline; its latencies by placing each service time on the arrivals."""
    outputs, seconds = serve_one_by_one(model, at_zero(requests), kv_cache.generate_stream)
    service = service_times(outputs)
    lengths = lengths_of(requests)
    kv = max(kv_cache_bytes(model.config, generation.positions_needed(P, N)) for P, N in lengths)
    offline = {"outputs": outputs, "seconds": seconds, "model_steps": sum(N for _, N in lengths), "kv_bytes_peak": kv}
    latency = queue_latencies(service, [r.arrival_s for r in requests])
    return record("kv_cache", model, offline, latency, workload_passes("kv_cache", lengths), weights,
                  latency_basis="offline service times placed on the arrivals, first come first served"), outputs


def batched_row(model: GPT2Model, method: str, requests, engine: str | None = None,
                weights: GPT2Model | None = None, arrivals: bool = True, price_steps: bool = True,
                **extra) -> tuple[dict, list]:
    """``static`` or an engine (``engine``: which one runs ``method``): offline, then (``arrivals``) on the
    arrivals for its latencies. An fp32 engine's steps are kept (``price_steps``) for ``with_bound`` to price."""
    def serve(on_arrivals):
        if method == "static":
            return serve_static(model, requests, on_arrivals)
        return serve_engine(model, engine or method, requests, on_arrivals)
    offline = serve(False)
    latency = latencies_of(serve(True)["outputs"]) if arrivals else dict(NO_LATENCY)
    if not arrivals:
        extra["latency_basis"] = "offline throughput only: not replayed on the arrivals (it would add minutes)"
    row = record(method, model, offline, latency, workload_passes(method, lengths_of(requests)),
                 weights, batch=MAX_BATCH, kv_bytes_allocated=int(offline["kv_bytes_allocated"]), **extra)
    if price_steps and "steps" in offline:
        row["_steps"] = (offline["steps"], offline["forward_seconds"])  # priced, then dropped, by with_bound
    return row, offline["outputs"]


def int8_kv_row(model: GPT2Model, requests, weights: GPT2Model | None = None, **extra) -> tuple[dict, list]:
    """Chapter 6's int8 K/V in chapter 5's engine, fp32 weights: ``prefix_cached`` with its blocks kept by
    ``Int8Codec`` (D int8 values and a float32 scale a head: what a decoding query reads per key)."""
    codec = Int8Codec()
    return batched_row(model, "int8_kv", requests, weights=weights, kv_format=codec.name,
                       kv_bytes_per_position=codec.bytes_per_token(model.config), **extra)


def quant_model(config: GPT2Config, kernel: str, base: GPT2Model | None = None) -> GPT2Model:
    """Chapter 6's best form of ``base`` (default: the timing weights, ``random_model(config, seed=0)``): int8 per
    output channel, the tied head too."""
    base = random_model(config, seed=0) if base is None else base
    return quantize_model(base, QUANT_FORMAT, kernel=kernel, embeddings=True)


def quant_row(config: GPT2Config, kernel: str, requests, base: GPT2Model | None = None) -> tuple[dict, list]:
    """int8 weights (``kernel``: "numpy" or "numba"), chapter 3's engine over chapter 4's store (float32 K/V)."""
    model = quant_model(config, kernel, base)
    serve_engine(model, "paged", requests[:2], arrivals=False, max_num_seqs=2)  # warm-up (numba compiles here)
    method = QUANT_FORMAT if kernel == "numpy" else f"{QUANT_FORMAT}_numba"
    how = "dequantize, then BLAS" if kernel == "numpy" else "the numba kernel reads the int8 bytes"
    return batched_row(model, method, requests, engine="paged", price_steps=False, kernel=kernel,
                       kernels=f"chapter code; int8 weights ({how}); float32 K/V in chapter 4's paged store")


def dequantize_seconds(model: GPT2Model, repeats: int = 3) -> float:
    """What NumPy's path adds to every model step of a quantized ``model``: each matmul first turns its whole
    weight back into float32 (``QuantizedWeight.dequantize``), whatever the batch. The median of ``repeats`` rounds
    of dequantizing every quantized weight once, as one step does."""
    weights = [b[m][n]["weight"] for b in model.params["h"] for m, n in (k.split(".") for k in MATRICES)]
    if isinstance(model.params["wte"], QuantizedEmbedding):
        weights.append(model.params["wte"].T)  # the tied head
    return median_time(lambda: [w.dequantize() for w in weights], repeats=repeats, warmup=1)


def composed_quant_row(config: GPT2Config, paged: dict, requests, base: GPT2Model | None = None) -> dict:
    """The ``int8`` row (NumPy's path) from the paged row of the same run: its steps, each longer by the measured
    ``dequantize_seconds`` (a full-size step takes about a second here, so the end-to-end run would take many
    minutes; ``--quick`` runs it end to end). Its latencies on the arrivals are not composed: None."""
    model = quant_model(config, "numpy", base)
    added = dequantize_seconds(model)
    seconds = paged["seconds"] + paged["model_steps"] * added
    passes = workload_passes("paged", lengths_of(requests))
    work = count_work(config, passes, paged["model_steps"], bytes_per_token(model))
    return {**{k: paged[k] for k in ("batch", "output_tokens", "kv_bytes_peak", "num_preemptions")},
            "method": QUANT_FORMAT, "tokens_per_s": paged["output_tokens"] / seconds, "seconds": seconds,
            "ttft_p50_s": None, "itl_p50_s": paged["itl_p50_s"] + added, "itl_p99_s": paged["itl_p99_s"] + added,
            "weight_bytes": int(model.nbytes()), **work, "kernel": "numpy", "dequantize_seconds_per_step": added,
            "basis": "composed: the paged engine's measured run, each of its steps longer by the measured time "
                     "NumPy's path adds to a step (dequantizing every weight); ITL likewise; TTFT on the "
                     "arrivals not composed (the server falls behind them)",
            "kernels": "chapter code; int8 weights (dequantize, then BLAS); float32 K/V in chapter 4's paged store"}


# ----------------------------------------------------------------------------------------------------------------
# Speculative decoding (chapter 10) on the same workload: speed on GPT-2 124M's shape, acceptance from a trained
# model. Random weights predict noise, so no drafter's acceptance on them means anything; the embedded model is
# trained, and its prompt lookup's outcomes step by step are replayed into the engine that runs the workload.


class PassLog(SpecStats):
    """``SpecStats`` that also keeps each verify pass's (drafts, accepted)."""

    def __init__(self):
        super().__init__()
        self.passes: list[tuple[int, int]] = []

    def record(self, num_drafts: int, num_accepted: int, num_emitted: int) -> None:
        super().record(num_drafts, num_accepted, num_emitted)
        self.passes.append((num_drafts, num_accepted))


class LoggingDrafter:
    """A drafter, wrapped: each request's (k asked for, tokens proposed), in order."""

    def __init__(self, inner):
        self.inner, self.asked = inner, []

    def propose(self, requests):
        proposals = self.inner.propose(requests)
        self.asked += [(r.k, len(p.tokens)) for r, p in zip(requests, proposals)]
        return proposals

    def retain(self, keys) -> None:
        self.inner.retain(keys)


def embedded_outcomes(quick: bool, k: int = SPEC_K) -> dict:
    """The trained embedded model's prompt lookup (k tokens) on chapter 10's two workloads, greedy, one sequence
    at a time: ``free_text`` (novel openings: little to copy) and ``copy_task`` (a held-out passage, then its first
    words again: an editing-like task). Per workload: each full-k step's outcome (proposed, accepted), (0, 0) when
    the lookup found nothing, with alpha and tokens per pass as chapter 10 counts them."""
    model, out = load_model(), {}
    for name, prompts in embedded_workloads(model, quick).items():
        log, drafter = PassLog(), LoggingDrafter(PromptLookupDrafter())
        for p in prompts:
            speculative.generate(model, p, embedded_new_tokens(quick), stop_at_eos=False, drafter=drafter, k=k,
                                 stats=log)
        passes, outcomes = iter(log.passes), []
        for asked, proposed in drafter.asked:
            got = next(passes) if proposed else (0, 0)  # each non-empty proposal was verified, in order
            if asked == k:
                outcomes.append(got)
        out[name] = {"outcomes": outcomes, "alpha": log.alpha, "tokens_per_pass": log.tokens_per_pass,
                     "proposal_rate": sum(d > 0 for d, _ in outcomes) / len(outcomes) if outcomes else 0.0}
    return out


class ReplayDrafter:
    """For each sequence and step, one of ``outcomes`` [(proposed, accepted)] drawn at random (seeded): the first
    ``accepted`` tokens of the target's own greedy continuation (``references``: prompt and output of each
    request), then wrong tokens up to ``proposed`` (nothing when it is 0). The engine that verifies them does
    exactly the work a drafter with that acceptance causes; greedy output is unchanged."""

    def __init__(self, references, outcomes, vocab_size: int, seed: int = 0):
        if not outcomes:
            raise ValueError("ReplayDrafter needs at least one (proposed, accepted) outcome")
        self.references = [list(map(int, r)) for r in references]
        self.outcomes, self.vocab_size = list(outcomes), int(vocab_size)
        self.rng, self.reference_of = np.random.default_rng(seed), {}

    def propose(self, requests) -> list[Proposal]:
        return [Proposal(self.guess(r)) for r in requests]

    def guess(self, r) -> list[int]:
        n, ids = len(r.token_ids), list(r.token_ids)
        if r.key not in self.reference_of:
            self.reference_of[r.key] = next((x for x in self.references if x[:n] == ids), None)
        ref = self.reference_of[r.key]
        if ref is None:
            return []
        proposed, accepted = self.outcomes[int(self.rng.integers(len(self.outcomes)))]
        right = ref[n:n + min(proposed, r.k)]
        return right[:accepted] + [(t + 1) % self.vocab_size for t in right[accepted:]]

    def retain(self, keys) -> None:
        keep = set(keys)
        self.reference_of = {k: v for k, v in self.reference_of.items() if k in keep}


def spec_row(model: GPT2Model, requests, base_row: dict, base_outputs, workload: str, measured: dict,
             weights: GPT2Model | None = None) -> dict:
    """Chapter 10's ``SpeculativeEngine`` (chapter 5's engine, k = ``SPEC_K``) serving ``requests`` offline,
    drafting with ``ReplayDrafter`` at the trained model's outcomes on ``workload`` (``embedded_outcomes``); its
    speed-up over ``base_row`` (``prefix_cached``, the engine it extends) and whether its tokens equal
    ``base_outputs``. Its work is counted from the passes it ran (the rejected drafts' FLOPs included)."""
    refs = {o.request_id: list(o.prompt_token_ids) + list(o.output_token_ids) for o in base_outputs}
    drafter = ReplayDrafter([refs[r.request_id] for r in requests], measured["outcomes"], model.config.vocab_size)
    store = SpeculativeKVStore(model.config, kv_blocks(requests, SPEC_K + 1), BLOCK_SIZE)
    engine = SpeculativeEngine(model, drafter, SPEC_K, store, max_num_seqs=MAX_BATCH,
                               max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    offline = run_engine(engine, requests, arrivals=False)
    passes = [chunk for step in offline["steps"] for chunk in step]
    stats = engine.spec_stats
    row = record(f"spec_ngram_{'copy' if workload == 'copy_task' else 'free'}", model, offline, dict(NO_LATENCY),
                 passes, weights, batch=MAX_BATCH, kv_bytes_allocated=int(offline["kv_bytes_allocated"]),
                 speculative={"k": SPEC_K, "drafter": "prompt lookup (n-grams of 3 down to 1)",
                              "acceptance_from": f"the embedded trained model's prompt lookup on chapter 10's "
                                                 f"{workload.replace('_', ' ')}: each step of each sequence "
                                                 f"replays one of its {len(measured['outcomes'])} measured "
                                                 f"(proposed, accepted) outcomes",
                              "embedded_alpha": measured["alpha"], "embedded_tokens_per_pass":
                                  measured["tokens_per_pass"], "embedded_proposal_rate": measured["proposal_rate"],
                              "alpha": stats.alpha, "tokens_per_pass": stats.tokens_per_pass,
                              "identical_to_plain": {o.request_id: o.output_token_ids for o in offline["outputs"]}
                                                    == {o.request_id: o.output_token_ids for o in base_outputs}},
                 latency_basis="offline throughput only (speed: this engine on GPT-2 124M's shape; acceptance: "
                               "the trained embedded model's, replayed)")
    row["speculative"]["speedup_over_" + base_row["method"]] = row["tokens_per_s"] / base_row["tokens_per_s"]
    row["_steps"] = (offline["steps"], offline["forward_seconds"])
    return row


# ----------------------------------------------------------------------------------------------------------------
# The served engine (chapter 7) and the parallel arm (chapter 8) on the same workload


def tp2_row(base: GPT2Model, requests) -> dict:
    """Chapter 8's tensor parallelism inside chapter 5's engine: each step on two worker processes of 1 BLAS thread
    (the chapter code; ``TensorParallelRunner``), offline, after two untimed warm-up requests on other prompts."""
    store = PrefixCachingKVStore(base.config, kv_blocks(requests) + 8, BLOCK_SIZE)

    def engine(forward):
        return CachingLLMEngine(base, store, max_num_seqs=MAX_BATCH, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                                forward=forward)
    with TensorParallelRunner(base, store, max_rows=MAX_NUM_BATCHED_TOKENS, max_seqs=MAX_BATCH) as tp:
        engine(tp).generate_many([Request(f"warm-{i}", wl.random_prompt(base.config.vocab_size, 16, 9_000 + i), 4,
                                          stop_at_eos=False) for i in range(2)])
        offline = run_engine(engine(tp), requests, arrivals=False)
    row = record("tp2", base, offline, dict(NO_LATENCY), workload_passes("prefix_cached", lengths_of(requests)),
                 base, batch=MAX_BATCH, kv_bytes_allocated=int(offline["kv_bytes_allocated"]), processes=3,
                 blas_threads_per_process=1,
                 latency_basis="offline throughput only: prefix_cached's engine, its model step split over two "
                               "worker processes (heads and MLP columns; two all-reduces a layer)")
    row["_steps"] = (offline["steps"], offline["forward_seconds"])
    return row


async def send_all(base_url: str, requests, vocab_size: int) -> tuple[list[dict], float]:
    """Two untimed warm-up requests, then every request of the workload at once, streamed: the server at capacity
    (more requests than it runs at a time). -> the client's records, in request order, and the seconds taken."""
    client = Client(base_url, "gpt2-random", 16)
    try:
        for i in range(2):
            await client.complete(wl.random_prompt(vocab_size, 16, 9_100 + i), 1, 4)
        t0 = time.perf_counter()
        records = await asyncio.gather(*(client.complete(list(r.prompt_token_ids), 1, r.max_new_tokens)
                                         for r in requests))
        return list(records), time.perf_counter() - t0
    finally:
        await client.http.aclose()


def served_row(base: GPT2Model, requests, threads: int) -> tuple[dict | None, str]:
    """Chapter 7's server (``python -m gpt2_core serve``: chapter 5's engine with the priority scheduler behind
    HTTP, the appendix's kernels, ``threads`` BLAS threads) on these random weights, loaded with every request at
    once (``send_all``); throughput and latencies as its client sees them. Or (None, why not)."""
    from ..ch07_serving.launch import start_servers

    missing = missing_extra()
    if missing is not None:
        return None, f"no served row: {missing}"
    with tempfile.TemporaryDirectory(prefix="gpt2_capstone_") as tmp:
        args = ["--model", str(write_random_checkpoint(base, Path(tmp))), "--served-model-name", "gpt2-random",
                "--max-num-seqs", str(MAX_BATCH), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
                "--num-blocks", str(kv_blocks(requests) + 8)]
        server = start_servers(1, *args, threads=threads)[0]
        try:
            records, seconds = run_async(send_all(server.base_url, requests, base.config.vocab_size))
        finally:
            server.stop()
    return served_record(base, requests, records, seconds), f"served: {threads} BLAS threads, at capacity"


def served_record(base: GPT2Model, requests, records: list[dict], seconds: float) -> dict:
    """The served row from the client's records: each request's tokens as the server reported them (it stops at
    eos, which random weights rarely choose), the work of exactly those tokens, p50 TTFT and ITL."""
    ok = [rec.get("complete", False) and rec["status"] == 200 for rec in records]
    lengths = [(len(r.prompt_token_ids), rec["tokens"]) for r, rec in zip(requests, records)]
    tokens = sum(n for _, n in lengths)
    steps = max(n for _, n in lengths)  # at least one model step per token of the longest request
    work = count_work(base.config, workload_passes("prefix_cached", lengths), steps, bytes_per_token(base))
    lat = latency_fields([rec["ttft_s"] for rec in records if rec["ttft_s"] is not None],
                         [g for rec in records for g in rec["itl_s"]])
    return {"method": "served", "batch": MAX_BATCH, "tokens_per_s": tokens / seconds, **lat, "kv_bytes_peak": None,
            "weight_bytes": int(base.nbytes()), "output_tokens": tokens, "seconds": seconds, **work,
            "completed": sum(ok), "num_requests": len(records), "kernels": ACCELERATED + " (the server's default)",
            "latency_basis": "the client's clock, every request sent at t=0 (the offline load), streamed over HTTP",
            "basis": "model_steps is a lower bound (the longest request's tokens): the server's own step count is "
                     "not read, so the bytes bound is a lower bound too"}


def numba_worker(conn, config, requests, threads) -> None:
    """The ``int8_numba`` row in its own process (numba's threads would slow OpenBLAS in the main one)."""
    with blas_threads(threads):
        row, outputs = quant_row(config, "numba", requests)
    conn.send((row, [o.output_token_ids for o in outputs]))


def numba_row(config: GPT2Config, requests, threads: int | None) -> tuple[dict | None, list | None, str]:
    """The kernel's row and its tokens from a spawned worker process, or (None, None, why not)."""
    if not quant_kernels.numba_available():
        return None, None, f"numba is not installed: no int8_numba row ({quant_kernels.INSTALL})"
    try:
        row, tokens = in_spawned_process(numba_worker, (config, requests, threads), "the int8_numba worker")
    except RuntimeError as e:  # a failure costs this row, not the run
        return None, None, f"int8_numba: {e}"
    return row, tokens, "int8_numba: measured in a spawned worker process (numba's threads slow OpenBLAS)"


def hf_row(model: GPT2Model, requests, threads: int, weights: GPT2Model | None = None,
           arrivals: bool = True) -> tuple[dict | None, str]:
    """HF transformers' batched ``generate`` (random weights of its own, the same shape), offline and (if
    ``arrivals``) on the arrivals, or (None, why not). Its clock starts after torch's warm-up call."""
    got = replay_hf(model, at_zero(requests), MAX_BATCH, threads)
    if got is None:
        return None, "torch/transformers not installed: no hf_transformers row (pip install 'gpt2-numpy[reference]')"
    outputs, batches = got
    if arrivals:
        latency = latencies_of(replay_hf(model, fresh(requests), MAX_BATCH, threads)[0])
    else:
        latency = dict(NO_LATENCY)
    lengths = lengths_of(requests)
    columns = max(P for P, _ in lengths) + max(N for _, N in lengths)
    offline = {"outputs": outputs, "seconds": wl.summarize(outputs)["duration_s"],
               "model_steps": sum(len(b["step_times"]) for b in batches),
               "kv_bytes_peak": kv_bytes_per_position(model.config) * min(MAX_BATCH, len(requests)) * columns}
    import torch

    row = record("hf_transformers", model, offline, latency, workload_passes("hf_transformers", lengths),
                 weights, batch=MAX_BATCH, threads=threads, kernels=f"torch {torch.__version__} (its own BLAS)",
                 latency_basis="the arrivals" if arrivals else "not replayed on the arrivals in a full run (it "
                                                                "would add minutes): throughput only")
    return row, f"hf_transformers: torch {torch.__version__}, {threads} threads, random weights of its own"


def llamacpp_note() -> str:
    """Why there are no llama.cpp rows (``llamacpp_rows`` says so when there are)."""
    return (f"llama-cpp-python is not installed: no llamacpp rows ({LLAMA_CPP_INSTALL}, which compiles llama.cpp "
            f"from source: 6-8 minutes on 2 cores)")


def llamacpp_rows(model: GPT2Model, requests, threads: int | None) -> tuple[list[dict], list[dict]]:
    """llama.cpp's rows (``bench.llamacpp``): this run's weights written as GGUF files in f32 and q8_0, each served
    one request at a time, greedy, in a spawned worker (chapter 2's ``kv_cache`` row, run by llama.cpp), offline,
    its latencies placed on the arrivals as ``kv_cache``'s are; its K/V are float16 (llama.cpp's default).
    -> (the rows, a skipped entry for each row that could not be made: why). A failure costs its row only."""
    if not llama_cpp_available():
        why = llamacpp_note()
    elif importlib.util.find_spec("gguf") is None:
        why = ("llama-cpp-python is installed, but writing GGUF files needs the gguf package "
               "(.venv/bin/pip install gguf)")
    else:
        why = gguf_unsupported(model.config)
    if why is not None:
        return [], [{"method": "llamacpp", "reason": why}]
    lengths, rows, skipped = lengths_of(requests), [], []
    n_ctx = max(P + N for P, N in lengths)
    kv = 2 * model.config.n_layer * model.config.n_embd * 2  # float16 K and V of one position
    for qtype in GGUF_TYPES:
        with tempfile.TemporaryDirectory() as folder:  # one file at a time: 0.5 GB in f32 for GPT-2 124M
            try:
                path = write_gpt2_gguf(model, Path(folder) / f"capstone-{qtype}.gguf", qtype)
                outputs, seconds, version = serve_gguf(path, n_ctx, requests, threads)
                weights = GGUFWeights(path, model.config)
            except Exception as e:  # llama.cpp or the file: this row is lost, not the run
                skipped.append({"method": f"llamacpp_{qtype}", "reason": f"llama.cpp failed on the {qtype} file: "
                                                                          f"{type(e).__name__}: {e}"})
                continue
        offline = {"outputs": outputs, "seconds": seconds, "model_steps": sum(N for _, N in lengths),
                   "kv_bytes_peak": kv * n_ctx}
        latency = queue_latencies(service_times(outputs), [r.arrival_s for r in requests])
        rows.append(record(f"llamacpp_{qtype}", model, offline, latency, workload_passes("kv_cache", lengths),
                           weights, kv_bytes_per_position=kv,
                           kernels=f"llama.cpp (llama-cpp-python {version}), GGUF {qtype}, "
                                   f"{threads or 'its default'} threads",
                           latency_basis="offline service times placed on the arrivals, first come first served"))
    return rows, skipped


def compute_bound_row(config: GPT2Config, requests, limits: dict) -> dict:
    """The workload's FLOPs for an engine that computes each position once (prompt positions without the LM
    head but the last, each generated token's position with it), at the run's GEMM rate."""
    lengths = lengths_of(requests)
    flops = sum(forward_flops(config, q, k, h) for q, k, h in workload_passes("continuous", lengths))
    tokens = sum(N for _, N in lengths)
    return {"method": "compute_bound", "batch": "all", "tokens_per_s": tokens * limits["gemm_flops_per_s"] / flops,
            "bound_tokens_per_s": tokens * limits["gemm_flops_per_s"] / flops, "bound_kind": "flops",
            "flops": int(flops), "output_tokens": tokens, **NO_LATENCY, "kv_bytes_peak": None, "weight_bytes": None}


# ----------------------------------------------------------------------------------------------------------------
# The sweep: the naive -> final span against length


def sweep_point(model: GPT2Model, prompt_len: int, new_tokens: int, num_requests: int, naive_passes: int,
                engine: str = "continuous") -> dict:
    """``num_requests`` requests of ``prompt_len`` + ``new_tokens``, offline: the engine's throughput, and
    chapter 1's naive loop measured on ``naive_passes`` of its forward passes (at lengths spread evenly over the
    request's), scaled to all its passes by positions processed."""
    V = model.config.vocab_size
    requests = [Request(i, wl.random_prompt(V, prompt_len, 7_000 + i), new_tokens, stop_at_eos=False)
                for i in range(num_requests)]
    final = serve_engine(model, engine, requests, arrivals=False, max_num_seqs=num_requests)
    final_tps = num_requests * new_tokens / final["seconds"]
    ids = wl.random_prompt(V, prompt_len + new_tokens - 1, 7_000)
    lengths = sorted({int(x) for x in np.linspace(prompt_len, prompt_len + new_tokens - 1, naive_passes).round()})
    seconds = []
    for T in lengths:
        t0 = time.perf_counter()
        generation.next_token_logits(model, ids[:T])
        seconds.append(time.perf_counter() - t0)
    rate = sum(lengths) / sum(seconds)  # positions per second
    naive_seconds = sum(q for q, _, _ in request_passes("naive", prompt_len, new_tokens)) / rate
    naive_tps = new_tokens / naive_seconds
    return {"prompt_len": prompt_len, "new_tokens": new_tokens, "num_requests": num_requests, "engine": engine,
            "final_tokens_per_s": final_tps, "naive_tokens_per_s": naive_tps, "span": final_tps / naive_tps,
            "naive_passes_measured": lengths, "naive_positions_per_s": rate,
            "naive_positions_per_request": sum(q for q, _, _ in request_passes("naive", prompt_len, new_tokens))}


def sweep(model: GPT2Model, points, num_requests: int, naive_passes: int) -> list[dict]:
    return [sweep_point(model, P, N, num_requests, naive_passes) for P, N in points]


def shortest_span_over(points: list[dict], threshold: float = 100.0) -> dict | None:
    """The sweep point with the fewest positions (prompt + new tokens) whose span reaches ``threshold``."""
    over = [p for p in points if p["span"] >= threshold]
    return min(over, key=lambda p: (p["prompt_len"] + p["new_tokens"], p["span"])) if over else None


# ----------------------------------------------------------------------------------------------------------------
# The benchmark


def quick_capstone_workload(vocab_size: int = 50257) -> list[Request]:
    """``--quick``: 6 short requests arriving at 8/s (prompts 8-48 tokens, outputs 8-20)."""
    return wl.poisson_workload(6, 8.0, vocab_size, seed=0, prompt_len=(24, 0.5, 8, 48), output_len=(12, 0.4, 8, 20))


def capstone_shape(quick: bool) -> GPT2Config:
    """GPT-2 124M; in quick runs and while grading, 2 of its 12 layers (same widths and vocabulary)."""
    return replace(preset("gpt2"), n_layer=2) if quick or GRADING else preset("gpt2")


def capstone_requests(config: GPT2Config, trace: str | None, quick: bool, tokenizer) -> tuple[list[Request], str]:
    """The run's workload and its name: ``trace`` if given, else the quick or the standard workload; eos ignored,
    so that every engine makes every token."""
    if trace is not None:
        requests, name = wl.load_trace(trace, config.vocab_size, tokenizer=tokenizer), str(trace)
    elif quick:
        requests, name = quick_capstone_workload(config.vocab_size), "quick_capstone_workload(): 6 requests at 8/s"
    else:
        requests, name = wl.standard_workload(vocab_size=config.vocab_size), "standard_workload(48, seed=0, 4/s)"
    return [replace(r, stop_at_eos=False) for r in requests], name


def fp32_rows(model: GPT2Model, base: GPT2Model, requests, quick: bool, kernels: str, arrivals: bool = True,
              share: float = 1.0) -> tuple[list[dict], dict]:
    """The float32 rows on ``model`` (``base``: the plain model whose bytes a step reads): naive, kv_cache,
    static, continuous, paged, prefix_cached, int8_kv, each labelled with its ``kernels``. The batched rows'
    latencies are replayed on the arrivals only if ``arrivals`` (naive's and kv_cache's come free from their
    offline runs). ``share``: this pass's part of the progress plan. -> (rows, each row's offline outputs)."""
    rows, outputs = [], {}
    progress.advance(5 * share, "naive: the whole sequence recomputed each token")
    row, outputs["naive"] = naive_row(model, requests, 4 if quick else NAIVE_STRIDE, base)
    rows.append(row)
    progress.advance(20 * share, "KV cache, one request at a time")
    row, outputs["kv_cache"] = kv_cache_row(model, requests, base)
    rows.append(row)
    progress.advance(10 * share, "static batches")
    for method, units in (("static", 10), ("continuous", 3), ("paged", 3), ("prefix_cached", 4)):
        store = {"kv_store": decode_store(model).__name__} if method == "continuous" else {}  # which attention
        row, outputs[method] = batched_row(model, method, requests, weights=base, arrivals=arrivals, **store)
        rows.append(row)
        progress.advance(units * share, f"the batched engines: {method} done")
    row, outputs["int8_kv"] = int8_kv_row(model, requests, base, arrivals=arrivals)
    rows.append(row)
    return [{**r, "kernels": kernels} for r in rows], outputs


def int8_rows(config: GPT2Config, rows: list[dict], requests, threads: int, quick: bool, skipped: list) -> list:
    """``int8`` (NumPy's path: end to end in quick runs, composed from the paged row in full ones) and
    ``int8_numba`` (its own process; skipped with a note without numba)."""
    paged = next(r for r in rows if r["method"] == "paged")
    out = [quant_row(config, "numpy", requests)[0] if quick else composed_quant_row(config, paged, requests)]
    progress.advance(5, "int8 with the numba kernel")
    got, _, note = numba_row(config, requests, threads)
    (out.append(got) if got is not None else skipped.append({"method": f"{QUANT_FORMAT}_numba", "reason": note}))
    return out


def spec_rows(model: GPT2Model, base: GPT2Model, requests, rows: list[dict], outputs: dict,
              quick: bool) -> tuple[list[dict], dict]:
    """The speculative rows (``spec_row``) at the trained model's prompt-lookup outcomes on free text and on the
    copy task (``embedded_outcomes``), against ``prefix_cached``; and what was measured on the trained model."""
    measured = embedded_outcomes(quick)
    prefix = next(r for r in rows if r["method"] == "prefix_cached")
    got = [{**spec_row(model, requests, prefix, outputs["prefix_cached"], w, measured[w], base),
            "kernels": ACCELERATED} for w in ("free_text", "copy_task")]
    return got, {w: {**{k: v for k, v in m.items() if k != "outcomes"}, "steps_recorded": len(m["outcomes"])}
                 for w, m in measured.items()}


def step_matmuls(model: GPT2Model, rows: int):
    """A function making a step's products on ``rows`` rows with the model's kernels, in the step's order
    (``step_matrices``); each weight read once, so from memory, not from a cache warm from the last call as
    ``gemm_rates`` times them."""
    weights, rng = step_matrices(model), np.random.default_rng(0)
    inputs = {n: rng.standard_normal((rows, n), dtype=np.float32) for n in {w.shape[0] for w in weights}}

    def run():
        for w in weights:
            inputs[w.shape[0]] @ w
    return run


def step_anatomy(model: GPT2Model, rates: dict, requests, batch: int = MAX_BATCH, repeats: int = 5) -> dict:
    """Where a decode step's time goes beyond its matmuls, measured now: one ragged decode step of ``batch``
    sequences (chapter 3's step over the store ``continuous`` runs in: ``decode_store``) with the workload's mean
    context cached, the same with 1 token cached (attention all but gone), and its matmuls at the rates measured
    for ``batch`` rows (``step_seconds``, bytes not counted: what the per-step bound prices). attention_s and rest_s
    (layer norms, GELU, residuals, the step's Python, the matmuls slower inside a step than alone) are the
    differences. ``step_matmuls_s``: the same products alone in the step's order, each weight from memory;
    ``matmul_ceiling`` = matmul_s / step_matmuls_s, the most of its per-step bound a step of these kernels reaches
    with attention and everything else at zero."""
    context = int(np.mean([len(r.prompt_token_ids) + r.max_new_tokens / 2 for r in requests]))
    context = max(2, min(context, model.config.n_positions - 1))
    store = decode_store(model)
    full = median_time(decode_step_runner(model, batch, context, store), repeats=repeats)
    short = median_time(decode_step_runner(model, batch, 1, store), repeats=repeats)
    alone = median_time(step_matmuls(model, batch), repeats=repeats)
    matmuls, _ = step_seconds(model.config, [(1, 1, 1)] * batch, 0, rates, float("inf"))
    return {"batch": batch, "context": context, "store": store.__name__, "step_s": full,
            "short_context_step_s": short, "matmul_s": matmuls, "attention_s": full - short,
            "rest_s": short - matmuls, "step_matmuls_s": alone, "matmul_ceiling": matmuls / alone}


def bench_capstone(quick: bool = QUICK, trace: str | None = None, config: GPT2Config | None = None,
                   sweep_points=None, include_optional: bool = True, include_chapter_code: bool = True,
                   include_speculative: bool = True, include_serving: bool = True) -> dict:
    """The whole run (see the module's docstring); ``include_*`` switch parts off (tests): HF transformers, the
    chapter code's run, the speculative rows, the served and tensor-parallel rows."""
    t_start = time.perf_counter()
    config = capstone_shape(quick) if config is None else config
    base = random_model(config, seed=0)
    model = accelerate(base)  # the appendix's kernels under the chapters' code; the chapter code's own run follows
    requests, name = capstone_requests(config, trace, quick, model.tokenizer)
    parts = {"optional": include_optional, "chapter_code": include_chapter_code,
             "speculative": include_speculative, "serving": include_serving,
             "numba_units": progress.if_installed(8, "numba"),
             "hf_units": progress.if_installed(15, "torch", "transformers") if include_optional else 0,
             "llamacpp_units": progress.if_installed(12, "llama_cpp") if include_optional else 0}
    progress.plan(80 + 40 * include_chapter_code + 6 * include_speculative + 9 * include_serving +
                  parts["numba_units"] + parts["hf_units"] + parts["llamacpp_units"],
                  "warming up; the GEMM rates and the bandwidth")
    warm_up(model)
    machine = MachineReadings(model, base if include_chapter_code else None, QUICK_RATE_ROWS if quick else RATE_ROWS)
    machine.read()
    out = measure_rows(model, base, requests, quick, machine, sweep_points, parts)
    limits, fast_rates, plain_rates = machine.best()
    out["rows"] = [with_bound(r, limits, fast_rates, config) for r in out["rows"]]
    out["rows"].append(compute_bound_row(config, requests, limits))
    out["chapter"] = [with_bound(r, limits, plain_rates, config) for r in out["chapter"]]
    out["anatomy"] = {"accelerated": step_anatomy(model, fast_rates, requests)}
    if plain_rates is not None:
        out["anatomy"]["chapter_code"] = step_anatomy(base, plain_rates, requests)
    return summarize_run(out, machine, limits, {"accelerated": fast_rates, "chapter_code": plain_rates}, requests,
                         name, quick, config, time.perf_counter() - t_start)


def measure_rows(model, base, requests, quick: bool, machine: MachineReadings, sweep_points, parts: dict) -> dict:
    """Every row of the run, in the order measured, the machine read between the parts (``bench_capstone``)."""
    threads = blas_thread_count(1)
    rows, outputs = fp32_rows(model, base, requests, quick, ACCELERATED)
    machine.read()
    skipped, spec, chapter = [], None, []
    rows += int8_rows(model.config, rows, requests, threads, quick, skipped)
    progress.advance(parts["numba_units"], "speculative decoding (chapter 10)")
    if parts["speculative"]:
        got, spec = spec_rows(model, base, requests, rows, outputs, quick)
        rows += got
    progress.advance(6 * parts["speculative"], "the served engine (chapter 7)")
    if parts["serving"]:
        got, note = served_row(base, requests, threads)
        (rows.append(got) if got is not None else skipped.append({"method": "served", "reason": note}))
    progress.advance(5 * parts["serving"], "the chapter code's run (no appendix kernels)")
    if parts["chapter_code"]:
        warm_up(base)
        chapter = fp32_rows(base, base, requests, quick, CHAPTER_CODE, arrivals=False, share=0.6)[0]
        if parts["serving"]:
            chapter.append({**tp2_row(base, requests), "kernels": CHAPTER_CODE})
        machine.read()
    progress.advance(7 * parts["chapter_code"] + 4 * parts["serving"], "the naive -> final span, by length")
    points = sweep_points or ([(16, 16), (32, 32), (64, 64)] if quick else
                              [(32, 32), (64, 64), (128, 128), (256, 256), (512, 512)])
    span_sweep = sweep(model, points, 4 if quick else 8, 4 if quick else 8)
    progress.advance(15, "HF transformers" if parts["hf_units"] else None)
    machine.read()
    if parts["optional"]:
        got, note = hf_row(model, requests, threads, base, arrivals=quick)
        (rows.append(got) if got is not None else skipped.append({"method": "hf_transformers", "reason": note}))
    progress.advance(parts["hf_units"], "llama.cpp" if parts["llamacpp_units"] else None)
    if parts["optional"]:
        got, missing = llamacpp_rows(base, requests, threads)
        rows += got
        skipped += missing
    return {"rows": rows, "chapter": chapter, "skipped": skipped, "sweep": span_sweep, "speculative": spec}


def final_of(rows: list[dict]) -> str:
    """The fastest float32 serving engine of ``rows`` (continuous, paged or prefix_cached): the series' final."""
    by = {r["method"]: r for r in rows}
    return max((m for m in ("continuous", "paged", "prefix_cached") if m in by), key=lambda m: by[m]["tokens_per_s"])


def chapter_code_summary(chapter: list[dict], rows: list[dict]) -> dict | None:
    """The chapter code's run: its final engine, each engine's speed with the appendix's kernels over its speed
    without (the same engine, the same workload, the same run), and tensor parallelism over one process."""
    if not chapter:
        return None
    fast, own = {r["method"]: r for r in rows}, {r["method"]: r for r in chapter}
    final = final_of(chapter)
    ratios = {f"{m}_accelerated_over_chapter_code": fast[m]["tokens_per_s"] / r["tokens_per_s"]
              for m, r in own.items() if m in fast}
    if "tp2" in own:
        ratios["tp2_over_prefix_cached"] = own["tp2"]["tokens_per_s"] / own["prefix_cached"]["tokens_per_s"]
    return {"kernels": CHAPTER_CODE, "results": chapter, "final_method": final, "ratios": ratios,
            "final_fraction_of_step_bound": own[final].get("fraction_of_step_bound")}


def summarize_run(out: dict, machine: MachineReadings, limits: dict, rates: dict, requests, name, quick, config,
                  seconds) -> dict:
    rows = out["rows"]
    by = {r["method"]: r for r in rows}
    final = final_of(rows)
    naive = by["naive"]["tokens_per_s"]
    ratios = {f"{m}_over_naive": by[m]["tokens_per_s"] / naive for m in by if m not in ("naive", "compute_bound")}
    ratios["final_fraction_of_compute_bound"] = by[final]["tokens_per_s"] / by["compute_bound"]["tokens_per_s"]
    ratios["final_fraction_of_step_bound"] = by[final]["fraction_of_step_bound"]
    ratios["final_step_bound_over_compute_bound"] = (by[final]["step_bound_tokens_per_s"] /
                                                     by["compute_bound"]["tokens_per_s"])
    first_100 = shortest_span_over(out["sweep"])
    targets = {"final >= 0.8 x compute_bound": ratios["final_fraction_of_compute_bound"] >= 0.8,
               "final >= 0.8 x per-step bound": ratios["final_fraction_of_step_bound"] >= 0.8,
               "sweep reaches 100x naive": first_100 is not None}
    shape = "GPT-2 124M shape" if config.n_layer == 12 else f"GPT-2 124M widths, {config.n_layer} layers"
    return {"benchmark": "capstone", "model": f"random weights, {shape}, float32", "quick": quick,
            "kernels": "cpu_kernels.accelerate (fp32 rows: results); the chapter code without it (fp32 rows: "
                       "chapter_code); chapter code + quantization kernels (int8 rows)",
            "duration_s": seconds, "workload": {"name": name, "num_requests": len(requests),
                                                "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                                                "output_tokens": sum(r.max_new_tokens for r in requests),
                                                "last_arrival_s": max(r.arrival_s for r in requests)},
            "limits": limits, "limits_readings": machine.limits, "gemm_rates_by_rows": rates,
            "final_method": final, "results": rows, "chapter_code": chapter_code_summary(out["chapter"], rows),
            "speculative": out["speculative"], "step_anatomy": out["anatomy"],
            "skipped": out["skipped"], "ratios": ratios, "targets_met": targets, "sweep": out["sweep"],
            "sweep_first_over_100x": first_100, "essay": [{"engine": e, "tokens_per_s": t} for e, t in ESSAY],
            "method_notes": {"throughput": "offline: every request submitted at t=0, eos ignored",
                             "latency": "the workload's arrivals on the wall clock",
                             "bound": "max(FLOPs / GEMM rate, bytes / bandwidth), both measured in this run",
                             "step_bound": "each step the engine ran at the GEMM rate measured for its own rows "
                                           "(its kernels' rate curve, gemm_rates_by_rows), or its bytes at the "
                                           "bandwidth if longer; summed over its steps"}}
